"""The shadow tuner's sample rate for a simulated workload (`--tune-sample-rate auto`).

Tuning costs about `rate x candidates` replays of the shadows' share of the trace, so the rate
starts at COST_BUDGET / candidates (the shadows together about one replay). It is raised where
a sample that small would mislead: fewer than MIN_SESSIONS sessions in it (a sampled workload
with a handful of sessions ranks evictions by luck), or a shadow cache too small to hold
MIN_REQUESTS_HELD average requests (scaling the capacity by the rate then no longer keeps the
contention the full cache sees). Small traces thus tune at rate 1.

At a rate below 1 the sampled shadows only propose: the tuner's verifier checks each proposal on
a second, larger and independent sample before the live cache adopts it (`ShadowConfig.verify`,
`verify_rate`), so a sample that misleads costs a trial, not hit rate.
"""

from __future__ import annotations

from dataclasses import replace

from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.sim.workload import Workload

COST_BUDGET = 1.0
MIN_SESSIONS = 400
MIN_REQUESTS_HELD = 100


def auto_sample_rate(workload: Workload, profile, capacity_bytes: int, n_choices: int) -> float:
    lengths = workload.request_lengths()
    if not len(lengths):
        return 1.0
    sessions = len(set(workload.session_ids()))
    footprint = float(lengths.sum(axis=1).mean()) * profile.kv_bytes_per_token + 2 * profile.ssm_state_bytes
    rate = max(COST_BUDGET / n_choices, MIN_SESSIONS / sessions, MIN_REQUESTS_HELD * footprint / capacity_bytes,
               4 * profile.ssm_state_bytes / capacity_bytes)
    return min(1.0, rate)


def shadow_config_for(workload: Workload, profile, capacity_bytes: int, config: ShadowConfig,
                      sample_rate: float | None, *, depth: bool = True) -> ShadowConfig:
    """`config` with `sample_rate`, or the automatic rate for this workload and capacity if None;
    with `depth`, the depth-aware choices too (`ShadowConfig.with_depth`) unless `config` names some."""
    if depth and not config.has_depth:
        config = config.with_depth()
    if sample_rate is None:
        sample_rate = auto_sample_rate(workload, profile, capacity_bytes, len(config.choices))
    return replace(config, sample_rate=sample_rate)
