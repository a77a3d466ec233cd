"""The ``timing`` runtime: no model, just the simulator's cost model.

Each step costs what ``lockstep.sim``'s analytic model predicts for its plan (the same
code, so the engine and the simulator agree on step time). The runtime either sleeps for
that long (load tests, ``bench_engine``) or only reports it in ``StepResult.gpu_s``
(``options["sleep"] = False``: the sim-parity test runs the engine in step time).
``StepResult.host_s`` is the time the runtime sat idle waiting for the plan since its previous
step: the share of the step the host did not hide behind the runtime.
Sampled tokens are stand-ins that never equal the end-of-sequence token.

With P/D (prefill and decode pools) nothing is pulled: a request's KV load is done in the
decode step that plans it.

Options: ``deployment`` (a TOML path; default the built-in), ``pool`` (index, default 0),
``sleep`` (default True), ``load_s`` (seconds loading takes, as a checkpoint's weights would;
default 0).
"""

from __future__ import annotations

import os
import time

import numpy as np

from lockstep.policy.deployment_file import default_deployment, load_deployment
from lockstep.policy.step import StepPlan, StepResult
from lockstep.sim.cost import AnalyticCost
from lockstep.sim.load import plan_load

from .base import NewPlacement, NewRequests, Ready, RuntimeSpec


class TimingRuntime:
    def load(self, spec: RuntimeSpec) -> Ready:
        opts = spec.options
        dep = load_deployment(opts["deployment"]) if opts.get("deployment") else default_deployment()
        pool = dep.pools[int(opts.get("pool", 0))]
        self.model = dep.model(pool.model)
        self.cost = AnalyticCost(self.model, dep.hardware, dep.cost, pool.dep, dep.host)
        if dep.cost.profile:  # step times measured on a GPU (lockstep profile), as the simulator uses them
            from lockstep.sim.profile import ProfiledCost, load_profile

            self.cost = ProfiledCost(self.model, dep.hardware, dep.cost, pool.dep, dep.host,
                                     load_profile(dep.cost.profile, f"{dep.source}: [cost] profile"), pool.name)
        # Speculative plans (the engine has a draft model): drafts accepted as the deployment's
        # [speculative] acceptance model says, the draft's passes priced beside the target's
        # step, exactly as the simulator runs them.
        self.spec = None
        if opts.get("draft_model") and dep.speculative is not None:
            from lockstep.sim.spec import DraftCost, Speculation, SpecRuntime

            self.spec = SpecRuntime(Speculation(dep.speculative, spec.seed), self.cost,
                                    DraftCost(dep.speculative.draft, dep.hardware, dep.cost, pool.dep), 1,
                                    spec.block_size)
        self.block_size = spec.block_size
        self.sleep = bool(opts.get("sleep", True))
        self.vocab = self.model.vocab_size
        self.eos = self.model.eos_token_id
        self._last_end = 0.0
        time.sleep(float(opts.get("load_s", 0.0)))
        return Ready(name="timing", vocab_size=self.vocab, eos_token_id=self.eos,
                     num_layers=self.model.num_layers, num_experts=self.model.num_routed_experts,
                     pid=os.getpid())

    def add_requests(self, msg: NewRequests) -> None:
        pass

    def forget(self, req_ids: list[int]) -> None:
        pass

    def new_placement(self, msg: NewPlacement) -> None:
        pass  # no experts here: it never reports the placement ready, so no plan asks for it

    # P/D: there is no KV here to move. A decode side's pull is done in the step that plans
    # its load (``execute`` reports it), priced as the cost model prices that step.
    def kv_connect(self, msg) -> None:
        pass

    def kv_pull(self, msg) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        waited = start - self._last_end if self._last_end else 0.0  # idle, waiting on the host
        if self.spec is not None:
            t = self.spec.step([plan], None)
        else:
            t = float(self.cost.step_time(plan_load([plan], self.block_size)))
        if self.sleep:
            time.sleep(max(0.0, t - (time.perf_counter() - start)))
        self._last_end = time.perf_counter()
        if self.spec is not None:
            num, rids, pos = self._spec_positions(plan)
        else:
            num = plan.samples.astype(np.int32)
            rids = plan.req_ids[plan.samples]
            pos = (plan.start_pos + plan.num_new)[plan.samples].astype(np.int64)
        tokens = (rids * 7919 + pos) % (self.vocab - 1)
        tokens += tokens >= self.eos  # skip the end-of-sequence id
        return StepResult(step_id=plan.step_id, num_sampled=num,
                          token_ids=tokens.astype(np.int32), gpu_s=t, host_s=waited,
                          kv_loads_done=plan.kv_load_req_ids)  # loads are charged inside the step

    def _spec_positions(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens per entry (1 + accepted drafts), and each token's request and position,
        from where the speculative runtime placed each request."""
        ns = np.asarray(self.spec.got[0][0], dtype=np.int32)
        if not ns.any():
            return ns, np.zeros(0, np.int64), np.zeros(0, np.int64)
        pos = self.spec.pos[0]
        rids, where = [], []
        for rid, m in zip(plan.req_ids.tolist(), ns.tolist()):
            if m:
                last = pos[rid][0]  # the position of the entry's last token
                rids += [rid] * m
                where += range(last - m + 1, last + 1)
        return ns, np.asarray(rids, np.int64), np.asarray(where, np.int64)

    def shutdown(self) -> None:
        pass
