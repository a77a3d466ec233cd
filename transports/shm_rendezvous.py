"""How processes on one host join one shared-memory all-reduce group, with nothing named.

Rank 0 listens on a Unix socket in the abstract namespace, under a name the caller derives
from something every rank already knows (a DEP instance uses node 0's address); abstract
names vanish with the socket, so a SIGKILLed process leaves nothing behind. The other ranks
connect (retrying while rank 0 starts) and say who they are. Rank 0 lets in only processes
of its own user, learns each one's pid from the kernel (SO_PEERCRED), makes the group
(``collective_shm``: one memfd, an eventfd per rank), registers every pid and only then
hands out the fds (SCM_RIGHTS): from its first call, every rank can tell a dead peer from a
slow one. That needs one PID namespace: a rank whose own pid differs from the kernel's (two
containers sharing loopback but not PIDs) is refused with an error saying to use TCP.
"""

from __future__ import annotations

import errno
import os
import socket
import struct

import trio

from lockstep.policy.allreduce import CollectiveError, CollectiveTimeout, RankFailed

from .collective_shm import ShmCollective, ShmGroup, send_group, unpack_group

_HELLO = struct.Struct("<QQQQ")  # magic, rank, size, pid: the dialling rank introduces itself
_MAGIC = 0x6C6F636B73686D31
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_GROUP_MSG_BYTES = 1024  # send_group's header, or a refusal
_RETRY_S = 0.05
_REFUSED = b"refused: "


def abstract_name(key: str) -> bytes:
    """The socket name of the group keyed by ``key`` (the same string on every rank)."""
    return b"\0lockstep-allreduce:" + key.encode()


async def join(rank: int, size: int, name: bytes, *, max_values: int = 16, timeout_s: float = 60.0,
               **options) -> ShmCollective:
    """Rank ``rank`` of the ``size``-rank group that meets at ``name``; ``options`` go to
    ``ShmCollective``. ``CollectiveTimeout`` names a rank still missing after ``timeout_s``."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size} ranks")
    if size == 1:
        return ShmCollective(ShmGroup.create(1, max_values), 0, **options)
    joined: dict[int, socket.socket] = {}
    try:
        with trio.fail_after(timeout_s):
            if rank == 0:
                return await _host(size, name, max_values, joined, options)
            return await _dial(rank, size, name, options)
    except trio.TooSlowError:
        raise CollectiveTimeout(0 if rank else min(set(range(1, size)) - set(joined)), timeout_s) from None
    finally:
        for conn in joined.values():
            conn.close()


async def _host(size: int, name: bytes, max_values: int, joined: dict[int, socket.socket],
                options: dict) -> ShmCollective:
    listener = _unix_socket()
    try:
        try:
            listener.bind(name)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise OSError(e.errno, f"another process on this host already hosts the all-reduce group "
                                   f"{name[1:].decode(errors='replace')!r}: is an instance running with "
                                   "the same node 0 address?") from None
        listener.listen(size)
        refused: list[str] = []
        async with trio.open_nursery() as nursery:
            while len(joined) < size - 1:
                conn = await _accept(listener)
                nursery.start_soon(_greet, conn, size, joined, refused, nursery.cancel_scope)
    finally:
        listener.close()
    if refused:
        raise CollectiveError(refused[0])
    group = ShmGroup.create(size, max_values)
    try:
        for peer, conn in joined.items():
            group.register(peer, _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  _PEERCRED.size))[0])
        coll = ShmCollective(group, 0, **options)
    except BaseException:
        group.close()
        raise
    try:
        for peer, conn in sorted(joined.items()):
            await _send_group(conn, peer, group)
    except BaseException:
        coll.close()
        raise
    return coll


async def _greet(conn: socket.socket, size: int, joined: dict[int, socket.socket], refused: list[str],
                 done: trio.CancelScope) -> None:
    """Keep ``conn`` if it is one of our ranks, not yet joined; hang up on strays; refuse a
    rank the shared-memory link cannot serve (and stop: the group cannot form)."""
    try:
        hello = await _recv(conn)
        pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        magic, peer, their_size, their_pid = _HELLO.unpack(hello) if len(hello) == _HELLO.size else (0,) * 4
    except BaseException:
        conn.close()
        raise
    if uid != os.getuid() or magic != _MAGIC or their_size != size or not 0 < peer < size or peer in joined:
        conn.close()  # a stray or misconfigured dialler: not one of ours
        return
    if their_pid != pid:
        why = (f"rank {peer} is pid {their_pid} in its PID namespace but pid {pid} in rank 0's: the ranks "
               "cannot watch each other's processes, so shared memory cannot tell a dead rank from a slow "
               "one; use the TCP link (node_link 'tcp') between these processes")
        try:
            conn.send(_REFUSED + why.encode())
        except OSError:
            pass
        conn.close()
        refused.append(why)
        done.cancel()
        return
    joined[peer] = conn
    if len(joined) == size - 1:
        done.cancel()


async def _dial(rank: int, size: int, name: bytes, options: dict) -> ShmCollective:
    sock = await _connect(name)
    try:
        sock.send(_HELLO.pack(_MAGIC, rank, size, os.getpid()))
        await trio.lowlevel.wait_readable(sock)
        msg, fds, _, _ = socket.recv_fds(sock, _GROUP_MSG_BYTES, size + 1)
    finally:
        sock.close()
    if not msg and not fds:
        raise RankFailed(0, f"hung up on rank {rank} before handing over the all-reduce group (it died, "
                            f"or it hosts a group of another size: check every rank's group size)")
    if msg.startswith(_REFUSED) and not fds:
        raise CollectiveError(f"rank 0 refused rank {rank}: {msg[len(_REFUSED):].decode(errors='replace')}")
    group = unpack_group(msg, fds)
    if group.layout.size != size:
        group.close()
        raise CollectiveError(f"rank 0 sent a group of {group.layout.size} ranks to rank {rank} of {size}")
    try:
        return ShmCollective(group, rank, **options)
    except BaseException:
        group.close()
        raise


async def _connect(name: bytes) -> socket.socket:
    while True:
        sock = _unix_socket()
        try:
            sock.connect(name)
            return sock
        except (ConnectionRefusedError, FileNotFoundError, BlockingIOError):
            sock.close()
            await trio.sleep(_RETRY_S)  # rank 0 is still starting (or its backlog is full)
        except BaseException:
            sock.close()
            raise


async def _send_group(conn: socket.socket, peer: int, group: ShmGroup) -> None:
    while True:
        try:
            return send_group(conn, group)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(conn)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise RankFailed(peer, f"hung up before receiving the all-reduce group ({e})") from e


async def _accept(listener: socket.socket) -> socket.socket:
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listener)
            continue
        conn.setblocking(False)
        return conn


async def _recv(conn: socket.socket) -> bytes:
    while True:
        try:
            return conn.recv(_HELLO.size + 1)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(conn)


def _unix_socket() -> socket.socket:
    # SOCK_SEQPACKET keeps message boundaries: a hello or the group arrives whole or not at all.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    return sock
