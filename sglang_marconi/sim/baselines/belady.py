"""`belady`: an offline upper bound on what any eviction can save under Marconi's admission.

The claim, precisely. Take any cache that admits as `HybridPrefixCache` does (the KV of every
served input + output, an SSM state at its end and at its branch checkpoint; with `probation`
also at the end of its input), hits only where it holds the KV of the whole prefix and a state at
its end (at most input length - 1 tokens), and holds at most C bytes at every request arrival,
whatever it evicts and when: SGLang+, Marconi at any fixed or tuned choice, `coverage`, or a
clairvoyant rule. Then its hit tokens (and, separately, its prefill FLOPs saved) over the trace are
at most this bound. It is not a schedule: no eviction is known to reach it.

Why it holds. Let the schedule hit request r with option o_r (`hit_options.py`: a hit needs its
items held over arrival ranges that are pairwise disjoint across requests, and within the
capacity at each arrival t together with the sequence the cache admitted just before t, which an
admission keeps whole until the next one). For prices mu_t >= 0,

    sum_r v(o_r) = sum_r [v(o_r) - cost(o_r)] + sum_r cost(o_r)
                <= sum_r max(0, max_o [v(o) - cost(o)]) + sum_t mu_t (1 - B_{t-1} / C) = D(mu),

since sum_r cost(o_r) = sum_t mu_t x (bytes of the needed items held at t, beyond the forced
B_{t-1}) / C <= sum_t mu_t (C - B_{t-1}) / C. So every D(mu) is a bound (weak duality); we report
the lowest we find (`dual_bound.py`), which is the optimum of the LP relaxation of offline
optimal eviction where the search converges.

What it is not. Belady's rule (evict the item used farthest in the future) is optimal only for
items of one size and one value; there the LP above is an interval packing with a totally
unimodular matrix, its optimum is integral and equals Belady's. Here items differ in size (KV
edges, 26.8 MB states), a hit needs a bundle of them (the whole prefix and one state), and hits
differ in value, so the LP may hold part of a bundle for part of a hit; and where a state can
be produced is relaxed to every position the cache's tree could end at (every boundary of the tree
of all earlier sequences along the input), whatever the eviction did. Both only raise the bound.
"Share of the LRU-to-bound gap" measured against it is therefore a lower estimate of the share of
what is truly achievable.
"""

from __future__ import annotations

import time

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.baselines.dual_bound import DualBound, minimize
from sglang_marconi.sim.baselines.hit_options import HitOptions, hit_options
from sglang_marconi.sim.policy_api import PolicyStats
from sglang_marconi.sim.replay import RunResult
from sglang_marconi.sim.workload import Workload

BELADY = "belady"
NAN = float("nan")


class BeladyBound:
    """The bound for one workload at any capacity (the trace pass is done once)."""

    def __init__(self, workload: Workload, profile, *, checkpoint_grid: int = 1, probation: bool = False,
                 limit: int | None = None, time_limit_s: float = 600.0):
        if getattr(profile, "has_sliding_window", False):
            raise MarconiError(f"{BELADY} does not model sliding-window layers ({profile.name})")
        self.workload, self.profile, self.time_limit_s = workload, profile, time_limit_s
        started = time.perf_counter()
        self.options: HitOptions = hit_options(_first(workload, limit), profile, checkpoint_grid=checkpoint_grid,
                                               probation=probation)
        self.pass_seconds = time.perf_counter() - started

    def bound(self, capacity_bytes: int, values: np.ndarray) -> float:
        """The bound on the summed `values` of the options hit (one value per option)."""
        scale = float(np.abs(values).max()) if values.size else 0.0
        if scale <= 0:
            return 0.0
        # in units of the largest value, so that prices, steps and smoothing are of order one
        unit = values / scale
        _, value = minimize(DualBound(self.options, capacity_bytes, unit), scale=float(unit.mean()),
                            time_limit_s=self.time_limit_s)
        return value * scale

    def run(self, capacity_bytes: int, *, gpu: str = "A100-80GB", flops: bool = True) -> RunResult:
        """A `RunResult` whose hit tokens and FLOPs saved are the bounds (`flops=False`: the FLOPs
        bound is not computed, NaN, which halves the time)."""
        started = time.perf_counter()
        o = self.options
        inputs = o.input_tokens
        hit = min(int(np.floor(self.bound(capacity_bytes, o.option_hit_tokens.astype(np.float64)) + 1e-6)),
                  int(inputs.sum()))
        zeros = np.zeros_like(inputs)
        flops_total = float(self.profile.prefill_flops_array(zeros, inputs).sum())
        flops_saved = min(self.bound(capacity_bytes, o.option_flops_saved), flops_total) if flops else NAN
        wall = time.perf_counter() - started + self.pass_seconds
        total = int(inputs.sum())
        return RunResult(
            policy=BELADY, capacity_bytes=int(capacity_bytes), workload=self.workload.name, model=self.profile.name,
            requests=int(inputs.size), input_tokens=total, hit_tokens=hit, token_hit_rate=hit / max(1, total),
            request_hit_rate=NAN,  # a bound on tokens says nothing per request
            flops_total=flops_total, flops_saved=flops_saved,
            flops_saved_fraction=flops_saved / flops_total if flops_total else 0.0,
            wall_seconds=wall, tuning_seconds=0.0, alpha_history=[], stats=PolicyStats(), gpu=gpu,
            modeled_ttft_p50_s=NAN, modeled_ttft_p95_s=NAN, per_request={"input_tokens": inputs.tolist()},
        )


def replay_belady(workload: Workload, profile, capacity_bytes: int, *, checkpoint_grid: int = 1,
                  probation: bool = False, gpu: str = "A100-80GB", limit: int | None = None, flops: bool = True,
                  **_ignored) -> RunResult:
    """The bound at one capacity (`BeladyBound` reuses the trace pass across capacities)."""
    return BeladyBound(workload, profile, checkpoint_grid=checkpoint_grid, probation=probation,
                       limit=limit).run(capacity_bytes, gpu=gpu, flops=flops)


def _first(workload: Workload, limit: int | None) -> Workload:
    if limit is None or limit >= len(workload):
        return workload
    from sglang_marconi.sim.workload import ListWorkload

    return ListWorkload(f"{workload.name}[:{limit}]", (r for i, r in zip(range(limit), workload)))
