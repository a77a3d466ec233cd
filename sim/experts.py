"""Expert loads that drift, and what the load balancer makes of them: the balancedness the
cost model's MoE term uses, window by window.

With ``[cost] expert_skew > 0`` a DEP instance's per-layer expert loads are drawn once
(power law with that exponent over a random order of the experts, per layer) and drift each
``expert_window_s`` by a log-normal factor (sigma ``expert_drift``). Without a balancer the
placement stays the naive contiguous one; with ``[eplb]`` the same planner the engine runs
(``lockstep.policy.eplb.plan``, incremental) re-places the experts on each window's loads, and
the placement serves the next window, whose loads have drifted (the engine plans on a window
and then runs on the next). Balancedness is the planner's own figure: mean/max tokens per GPU,
averaged over layers, with tokens split evenly among replicas.
"""

from __future__ import annotations

import numpy as np

from lockstep.policy.deployment import CostSpec, ModelSpec
from lockstep.policy.eplb import Topology, evaluate, naive, plan
from lockstep.policy.rebalance import EplbConfig

MAX_LAYERS = 16  # layers simulated: balancedness is a mean over layers, and planning is per layer


class ExpertLoads:
    def __init__(self, model: ModelSpec, dep: int, cost: CostSpec, eplb: EplbConfig | None, seed: int,
                 balance: bool = True, gpus_per_node: int = 8):
        """``balance=False`` keeps the naive layout on the same slots (for comparison)."""
        self.cost, self.eplb = cost, eplb if balance else None
        e = model.num_routed_experts
        redundant = eplb.redundant_experts if eplb is not None else 0
        # nodes: the scale-up domains the group spans (a GB300 NVL72 rack is one); EPLB keeps
        # each expert's home copy inside its domain
        nodes = dep // gpus_per_node if dep % gpus_per_node == 0 else 1
        self.topo = Topology(experts=e, slots=e + redundant, ranks=dep, nodes=nodes)
        layers = min(model.moe_layers, MAX_LAYERS)
        self.rng = np.random.default_rng(seed)
        ranks = np.argsort(self.rng.random((layers, e)), axis=1) + 1  # a random order per layer
        self.load = ranks.astype(np.float64) ** -cost.expert_skew
        self.placement = naive(self.topo, layers)
        self.series: list[tuple[float, float]] = []  # (window start, balancedness)

    def window(self, t: float) -> float:
        """Balancedness of the window starting at ``t``; plans for the next one."""
        if self.series:  # the loads drift from one window to the next
            self.load = self.load * self.rng.lognormal(0.0, self.cost.expert_drift, self.load.shape)
        bal = float(evaluate(self.placement, self.load, self.topo).mean)
        self.series.append((t, bal))
        if self.eplb is not None:
            self.placement = plan(self.load, self.topo, self.placement,
                                  incremental=self.eplb.incremental, eps=self.eplb.eps).placement
        return bal

    def report(self) -> dict:
        values = np.array([b for _, b in self.series])
        return {"balancer": self.eplb is not None, "windows": len(values),
                "mean": float(values.mean()) if len(values) else None,
                "min": float(values.min()) if len(values) else None,
                "series": [[round(t, 3), round(b, 4)] for t, b in self.series]}
