"""The ``Runtime`` protocol, the messages a runtime process exchanges besides the step
contract, and the registry of runtimes (the ``lockstep.runtimes`` entry-point group).

A runtime executes StepPlans and answers StepResults; it decides nothing. It lives in its
own process (``lockstep.runtime.main``), and the engine reaches it only through the
shared-memory rings. Control messages are msgspec Structs, so nothing is pickled; the
step messages themselves use ``lockstep.transports.step_codec``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Protocol

import msgspec
import numpy as np

from lockstep.policy.step import StepPlan, StepResult

ENTRY_POINT_GROUP = "lockstep.runtimes"

# Message kinds on the rings (1 and 2 are StepPlan and StepResult, see step_codec).
SHUTDOWN, PLAN, RESULT, READY, NEW_REQUESTS, FORGET, FAILURE, NEW_PLACEMENT = 0, 1, 2, 3, 4, 5, 6, 7
KV_CONNECT, KV_PULL = 8, 9


class RuntimeSpec(msgspec.Struct, frozen=True):
    """What a runtime process is asked to be: handed to it at start."""

    runtime: str = "torch"  # a name in the lockstep.runtimes registry
    model: str = "tiny"  # a preset name or a checkpoint directory
    device: str = "cpu"
    dtype: str = "float32"
    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: int = 0  # the scheduler's token budget a step (0: not said)
    seed: int = 0
    rank: int = 0  # this runtime's rank in its DEP instance
    world_size: int = 1  # ranks in the instance
    options: dict = {}  # runtime-specific (the timing runtime's deployment, say)


class Ready(msgspec.Struct, frozen=True):
    """The runtime loaded its model: what the engine needs to know about it."""

    name: str
    vocab_size: int
    eos_token_id: int
    num_layers: int
    num_experts: int
    pid: int
    moe_layers: list[int] = []  # the layers with routed experts (rows of expert_counts)
    kv_peer: bytes = b""  # with options["kv_transport"]: what a P/D peer connects with
    kv_bytes_per_token: int = 0  # the KV pool's real bytes per token (all layers)
    # A speculating runtime whose draft has sharded experts of its own to balance: the
    # draft's routed experts and MoE layers (rows of StepResult.draft_expert_counts); 0: none.
    draft_num_experts: int = 0
    draft_moe_layers: list[int] = []


class LogitsRules(msgspec.Struct, frozen=True):
    """A request's logits processing before sampling (``SamplingParams.processes_logits``).
    Tokens at positions from ``prompt_len`` on are its output; ``min_tokens`` counts them
    from there too (a P/D decode side's request starts with the prefill side's token)."""

    prompt_len: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    suppress: list[int] = []  # ids masked until min_tokens outputs: end of sequence, stop tokens
    bias_ids: list[int] = []  # logit_bias: ids and what is added to their logits
    bias: list[float] = []
    allowed: list[int] = []  # allowed_token_ids (empty: any)
    grammar: list[str] = []  # structured outputs: [kind, text, whitespace] (StructuredOutputsParams.spec)
    grammar_after: list[int] = []  # ... applied after these ids in the output (StructuredOutputsParams.after_tokens)


class NewRequests(msgspec.Struct, frozen=True):
    """Sampling settings of requests about to appear in plans (sent once per request)."""

    req_ids: list[int]
    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    seed: list[int]  # -1: unseeded
    logprobs: list[int] = []  # -1: none; k: the sampled token's log-probability and the top k
    rules: list[LogitsRules | None] = []  # empty: none for any
    # Prompt logprobs: top k (-1: none); the prompt's int32 ids where prompt logprobs or a
    # repetition penalty read them (b"" otherwise)
    prompt_logprobs: list[int] = []
    prompts: list[bytes] = []


class Forget(msgspec.Struct, frozen=True):
    """Requests that are over for good (finished or aborted): drop their settings."""

    req_ids: list[int]


class NewPlacement(msgspec.Struct, frozen=True):
    """An expert placement to stage: ``phy2log`` is (layers, slots) int64 little-endian
    bytes, one row per MoE layer; switched to when a plan's ``placement_gen`` is ``gen``."""

    gen: int
    layers: int
    slots: int
    phy2log: bytes
    model: str = "target"  # or "draft": the speculative draft's own placement

    def array(self) -> np.ndarray:
        return np.frombuffer(self.phy2log, dtype="<i8").reshape(self.layers, self.slots)


class KVConnect(msgspec.Struct, frozen=True):
    """Connect to a P/D peer's KV pool (its ``Ready.kv_peer``)."""

    peer: bytes


class KVPull(msgspec.Struct, frozen=True):
    """Start pulling a request's prompt KV: ``remote`` blocks of ``peer`` into our ``local``
    blocks. An empty ``peer`` means the engine already knows it cannot be pulled: report it
    failed."""

    req_id: int
    peer: str
    remote: list[int]
    local: list[int]


class Failure(msgspec.Struct, frozen=True):
    """The runtime could not go on: its last words before it exits."""

    error: str


class Runtime(Protocol):
    """One model on one device. ``load`` runs once in the runtime process; ``execute`` runs
    every step, in plan order, and must resolve PLACEHOLDER tokens from the previous
    step's samples of the same slot."""

    def load(self, spec: RuntimeSpec) -> Ready: ...

    def add_requests(self, msg: NewRequests) -> None: ...

    def forget(self, req_ids: list[int]) -> None: ...

    def new_placement(self, msg: NewPlacement) -> None: ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def shutdown(self) -> None: ...

    # Optional, for P/D (a runtime without them reports every KV load done at once):
    #   kv_connect(msg: KVConnect), kv_pull(msg: KVPull), and idle(), called about every
    #   millisecond while no plan is waiting, so a transport can make progress.
    # Optional, to run a step ahead (``main._serve``): launch(plan) starts it and returns a
    #   handle with ready() (the device is done), or None when the plan must go through
    #   execute; finish(handle) returns its StepResult. Handles are finished in launch order,
    #   and execute is called only when none is outstanding.


def available() -> dict[str, object]:
    """Runtime names to entry points: built-ins and any installed package's."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def create(name: str) -> Runtime:
    eps = available()
    if name not in eps:
        raise ValueError(f"runtime {name!r} is not registered in entry-point group "
                         f"{ENTRY_POINT_GROUP!r}; available: {sorted(eps)}")
    return eps[name].load()()


def sample_slot_rows(plan: StepPlan) -> np.ndarray:
    """Index, in the plan's flat token array, of each sampling entry's last fed token."""
    return plan.token_offsets[1:][plan.samples] - 1
