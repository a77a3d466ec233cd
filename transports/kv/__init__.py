"""KV transfer between prefill and decode ranks (DESIGN.md, "Prefill/decode disaggregation").

``base`` holds the ``KVTransport`` protocol the runtime drives; ``shm`` moves blocks between
processes of one host through a shared memfd; ``nixl_transport`` moves them with a NIXL agent
(UCX) and needs the optional ``nixl`` extra, so it is not imported here.
"""

from lockstep.transports.kv.base import KVTransferError, KVTransport, PeerInfo, block_runs, recv_peer_info, send_peer_info
from lockstep.transports.kv.shm import ShmKVTransport

__all__ = [
    "KVTransferError", "KVTransport", "PeerInfo", "ShmKVTransport",
    "block_runs", "recv_peer_info", "send_peer_info",
]
