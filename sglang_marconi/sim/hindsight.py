"""`marconi-best`: the best fixed eviction choice in hindsight, the bound a tuner chases.

Every candidate of the tuner (SGLang's LRU, FLOP-aware eviction at each alpha, SegLen at each weight) is
replayed over the whole trace with that choice fixed; the best by the tuning objective (FLOPs
saved, or hit tokens; ties to the first listed) is reported as `marconi-best`, with every
candidate's figures under `candidates` and the sum of their replays as its wall time.
"""

from __future__ import annotations

from dataclasses import replace

from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, choice_label, eviction_for
from sglang_marconi.sim.baselines.hybrid_radix import HybridRadixPolicy
from sglang_marconi.sim.replay import RunResult, replay
from sglang_marconi.sim.workload import Workload

BEST = "marconi-best"


def replay_best(workload: Workload, profile, capacity_bytes: int, config: ShadowConfig = ShadowConfig(), *,
                checkpoint_grid: int = 1, probation: bool = False, **replay_kwargs) -> RunResult:
    runs = []
    for choice in config.choices:
        policy = HybridRadixPolicy(choice_label(choice), profile, capacity_bytes, eviction_for(choice),
                                   checkpoint_grid=checkpoint_grid, probation=probation)
        runs.append((choice, replay(workload, policy, profile, capacity_bytes, **replay_kwargs)))
    key = (lambda r: r.flops_saved) if config.objective == "flops" else (lambda r: r.hit_tokens)
    best_choice, best = max(runs, key=lambda cr: key(cr[1]))  # max keeps the first of equals
    candidates = {choice_label(c): {"token_hit_rate": r.token_hit_rate, "flops_saved": r.flops_saved,
                                    "wall_seconds": r.wall_seconds} for c, r in runs}
    return replace(best, policy=BEST, wall_seconds=sum(r.wall_seconds for _, r in runs), candidates=candidates,
                   best_choice=choice_label(best_choice))
