"""The shadow tuner's sample rate for a simulated workload (`--tune-sample-rate auto`).

Tuning costs about `rate x candidates` replays of the shadows' share of the trace, so the rate
starts at COST_BUDGET / candidates (the shadows together about one replay). It is raised where
a sample that small would mislead: fewer than MIN_SESSIONS sessions in it (a sampled workload
with a handful of sessions ranks evictions by luck), or a shadow cache too small to hold
MIN_REQUESTS_HELD average requests (scaling the capacity by the rate then no longer keeps the
contention the full cache sees; MIN_REQUESTS_HELD_DEPTH with the depth-aware choices, whose gains
lie in reuse far apart). Small traces thus tune at rate 1.

At a rate below 1 the sampled shadows only propose: the tuner's verifier checks each proposal on
a second, larger and independent sample before the live cache adopts it (`ShadowConfig.verify`,
`verify_rate`), so a sample that misleads costs a trial, not hit rate.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.sim.workload import Workload

COST_BUDGET = 1.0
MIN_SESSIONS = 400
MIN_REQUESTS_HELD = 100
# With the depth-aware choices the shadows hold at least this many average requests. Their gain comes
# from continuations that arrive hundreds of requests later, near the cache's horizon, and a session
# sample estimates that tail with a bias that grows as the shadows shrink (Mooncake, paper-7b at
# 400 GB, depth:1 over LRU: the full cache +1.62 points; shadows at rate 0.216 -0.27 to +1.48 over
# five samples, mean +0.51; at 0.5 +0.10 to +1.90, mean +1.05; at 0.865 +1.44). Below rate 1 a
# proposal also waits for the verifier, which on that trace confirms the depth rule too late to pay
# (nemotron-h-8b at 200 GB: adopted at request 10,361 of 12,031, 1% of the LRU-to-bound gap closed;
# at rate 1, 10%), so on conversation traces this floor means rate 1.
MIN_REQUESTS_HELD_DEPTH = 1000


def auto_sample_rate(workload: Workload, profile, capacity_bytes: int, n_choices: int, depth: bool = False) -> float:
    """`depth`: the choices include the depth-aware ones (MIN_REQUESTS_HELD_DEPTH)."""
    lengths = workload.request_lengths()
    if not len(lengths):
        return 1.0
    sessions = len(set(workload.session_ids()))
    footprint = float(lengths.sum(axis=1).mean()) * profile.kv_bytes_per_token + 2 * profile.ssm_state_bytes
    held = MIN_REQUESTS_HELD_DEPTH if depth else MIN_REQUESTS_HELD
    rate = max(COST_BUDGET / n_choices, MIN_SESSIONS / sessions, held * footprint / capacity_bytes,
               4 * profile.ssm_state_bytes / capacity_bytes)
    return min(1.0, rate)


def shadow_config_for(workload: Workload, profile, capacity_bytes: int, config: ShadowConfig,
                      sample_rate: float | None, *, depth: bool = True) -> ShadowConfig:
    """`config` with `sample_rate`, or the automatic rate for this workload and capacity if None;
    with `depth`, the depth-aware choices too (`ShadowConfig.with_depth`) unless `config` names some."""
    if depth and not config.has_depth:
        config = config.with_depth()
    if sample_rate is None:
        sample_rate = auto_sample_rate(workload, profile, capacity_bytes, len(config.choices), config.has_depth)
    return replace(config, sample_rate=sample_rate)


def shadow_predictions(workload: Workload, profile, capacity_bytes: int, config: ShadowConfig) -> dict:
    """What the tuner's sampled shadows predict each choice gains over the safe one (LRU), in
    points of token hit rate over the sampled requests, as the tuner would see it with `config`
    (its sample rate, sampling and capacity scaling): the shadows run to the end of the trace,
    never switching and never pruned. Compare with the full cache's gains (`full_gains`)."""
    from sglang_marconi.policy.tuning.shadow_tuner import ShadowTuner, choice_label

    tuner = ShadowTuner(profile, capacity_bytes, replace(config, margin=1e9, persist=1e18, prune_after=0,
                                                          prior_scale=0.0, verify=False))
    hits = np.zeros(len(tuner.choices))
    total = 0
    for request in workload:
        sampled = tuner.log.sampled
        tuner.observe(request.session_id, request.input_tokens, request.output_tokens)
        if tuner.log.sampled > sampled:
            hits += np.asarray(tuner.last_hits, dtype=float)
            total += request.input_len
    points = 100 * (hits - hits[0]) / max(total, 1)
    return {choice_label(c): float(p) for c, p in zip(tuner.choices, points)}


def full_gains(workload: Workload, profile, capacity_bytes: int, choices) -> dict:
    """Each fixed choice's token hit rate over the whole trace, in points above the first (LRU)."""
    from sglang_marconi.policy.tuning.shadow_tuner import choice_label, eviction_for
    from sglang_marconi.sim.baselines.hybrid_radix import HybridRadixPolicy
    from sglang_marconi.sim.replay import replay

    rates = [replay(workload, HybridRadixPolicy(choice_label(c), profile, capacity_bytes, eviction_for(c)), profile,
                    capacity_bytes, progress=False).token_hit_rate for c in choices]
    return {choice_label(c): 100 * (r - rates[0]) for c, r in zip(choices, rates)}
