"""A step the torch runtime launched and has not finished (``TorchRuntime.launch`` /
``finish``), and the pinned host buffers its sampled ids and expert counts come back through.

The plan's arrays view a ring frame that the runtime process gives back when it takes the
next message, which it does before finishing this step: ``Launched`` keeps copies of what
the result needs. The result's numbers are copied to the host behind the step (a
non-blocking copy into a pinned buffer, and an event), so launching the next step does not
wait for them.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch


@attrs.define(slots=True)
class Launched:
    step_id: int
    num_sampled: np.ndarray
    slots: np.ndarray  # of the sampled tokens
    kv_done: np.ndarray
    host: torch.Tensor  # the sampled ids, then the expert counts (arriving, on CUDA)
    num_tokens: int
    counts_shape: tuple
    event: object  # torch.cuda.Event, or None on the CPU
    want: np.ndarray  # logprobs per sample (-1: none)
    logits: torch.Tensor | None  # kept only when logprobs are wanted (not launched ahead then)
    t0: float
    t1: float
    pending: object = None  # logits.Pending: the counted samples, until their ids are on the host
    prompt: dict | None = None  # StepResult's prompt-logprob fields (a step that scored prompts)

    def ready(self) -> bool:
        """Whether the device is done with it (finishing it will not wait)."""
        return self.event is None or self.event.query()


class HostReturn:
    """Pinned int32 buffers for results on their way back; a buffer is reused once the step
    it carried is finished."""

    def __init__(self):
        self._free: list[torch.Tensor] = []

    def start(self, dev: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying ``dev`` (int32) to the host: (its host tensor, a CUDA event to wait
        on, or None on the CPU, where ``dev`` is the host tensor)."""
        if dev.device.type != "cuda":
            return dev, None
        n = dev.numel()
        i = next((i for i, b in enumerate(self._free) if b.numel() >= n), None)
        buf = torch.empty(max(n, 4096), dtype=torch.int32, pin_memory=True) if i is None else self._free.pop(i)
        buf[:n].copy_(dev, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev.device))
        return buf, event

    def take(self, p: Launched) -> tuple[np.ndarray, np.ndarray]:
        """(sampled ids, expert counts) of ``p``, once they are here; its buffer is free again."""
        if p.event is not None:
            p.event.synchronize()
        s = p.num_tokens
        host = p.host[:s + int(np.prod(p.counts_shape))].numpy().copy()
        if p.event is not None:
            self._free.append(p.host)
        return host[:s], host[s:].reshape(p.counts_shape)
