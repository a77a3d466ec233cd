"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's log-probability
under the model given the tokens before it, and the top k there, as vLLM's prompt_logprobs.

The logits at position p score prompt token p + 1, so a step that feeds positions
[s, s + n) of a prompt scores its tokens s + 1 to s + n (those still in the prompt; the
last position's logits are the first output's, sampled as usual). The runtime learns the
prompt's ids with the request, since the token a chunk's last position scores is the next
chunk's first. A step with such rows returns those rows' logits too: from the reference
forward, or on the fast path through the prefill graphs where the step would take them
(else its eager forward), the scored rows' logits from a product of their own, so the
tokens drawn are those of the same step without scoring; it is never launched ahead.
"""

from __future__ import annotations

import numpy as np
import torch

from lockstep.policy.step import EMPTY_I64, StepPlan


class PromptScores:
    def __init__(self):
        self.asked: dict[int, tuple[int, np.ndarray]] = {}  # rid -> (top k, prompt ids)

    def __bool__(self) -> bool:
        return bool(self.asked)

    def add(self, rid: int, k: int, prompt: bytes) -> None:
        if k >= 0:
            self.asked[rid] = (k, np.frombuffer(prompt, np.int32))

    def forget(self, rids) -> None:
        for rid in rids:
            self.asked.pop(rid, None)

    def rows(self, plan: StepPlan) -> tuple[np.ndarray, list | None]:
        """The token rows of ``plan`` whose logits score a prompt token, and for each one
        (request, prompt index, the token scored, top k); no rows: (empty, None)."""
        if not self.asked:
            return EMPTY_I64, None
        rids = plan.req_ids.tolist()
        out, meta = [], []
        for i in [i for i, r in enumerate(rids) if r in self.asked]:
            k, prompt = self.asked[rids[i]]
            lo, n, start = int(plan.token_offsets[i]), int(plan.num_new[i]), int(plan.start_pos[i])
            last = min(start + n, len(prompt) - 1)  # positions [start, last) score tokens start+1..last
            if last <= start:
                continue
            out.append(np.arange(lo, lo + last - start, dtype=np.int64))
            meta += [(rids[i], p + 1, int(prompt[p + 1]), k) for p in range(start, last)]
        if not out:
            return EMPTY_I64, None
        return np.concatenate(out), meta

    @staticmethod
    def score(logits: torch.Tensor, meta: list) -> dict:
        """StepResult's prompt fields for the rows ``rows`` gave (their logits, in order)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.as_tensor([m[2] for m in meta], dtype=torch.int64, device=lp.device)
        chosen = lp.gather(1, target[:, None])[:, 0]
        ranks = (lp > chosen[:, None]).sum(dim=-1) + 1  # vLLM's rank, also outside the top k
        k = max(m[3] for m in meta)
        top = lp.topk(k, dim=-1) if k > 0 else None
        return dict(prompt_req_ids=np.array([m[0] for m in meta], np.int64),
                    prompt_index=np.array([m[1] for m in meta], np.int64),
                    prompt_token_logprobs=chosen.cpu().numpy().astype(np.float32),
                    prompt_top_ids=None if top is None else top.indices.to(torch.int32).cpu().numpy(),
                    prompt_top_logprobs=None if top is None else top.values.float().cpu().numpy(),
                    prompt_token_ranks=ranks.to(torch.int32).cpu().numpy())
