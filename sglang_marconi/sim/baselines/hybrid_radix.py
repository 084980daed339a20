"""SGLang+ and Marconi on the simulator's `Policy` interface.

Both use the policy core's `HybridPrefixCache` with Marconi's admission; they differ only in
eviction: SGLang+ is LRU over leaves with path refresh, Marconi is FLOP-aware with a fixed or
tuned alpha.
"""

from __future__ import annotations

from sglang_marconi.policy.alpha_tuner import AlphaTuner, TuningConfig
from sglang_marconi.policy.eviction import EvictionPolicy, FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.hybrid_cache import HybridPrefixCache
from sglang_marconi.sim.policy_api import Outcome, PolicyStats
from sglang_marconi.sim.workload import Request


class HybridRadixPolicy:
    def __init__(self, name: str, profile, capacity_bytes: int, eviction: EvictionPolicy, *,
                 checkpoint_grid: int = 1, tuning: TuningConfig | None = None):
        self.name = name
        self.cache = HybridPrefixCache(profile, capacity_bytes, eviction, checkpoint_grid=checkpoint_grid)
        self.tuner = AlphaTuner(self.cache, tuning) if tuning is not None else None

    def serve(self, request: Request) -> Outcome:
        lookup, admitted = self.cache.serve(request.input_tokens, request.output_tokens)
        if self.tuner is not None:
            self.tuner.after_request(request.session_id, request.input_tokens, request.output_tokens)
        return Outcome(request.input_len, lookup.hit_tokens, lookup.overlap_tokens, admitted)

    def stats(self) -> PolicyStats:
        c = self.cache
        eviction = c.eviction
        history = self.tuner.log.history if self.tuner else [(0, getattr(eviction, "alpha", 0.0))]
        choices = self.tuner.log.choices if self.tuner else [(0, eviction.name)]
        return PolicyStats(
            kv_tokens_cached=c.kv_tokens,
            ssm_states_cached=c.ssm_states,
            bytes_used=c.used_bytes,
            evictions_leaf=c.counters.evictions_leaf,
            evictions_intermediate=c.counters.evictions_single_child,
            admissions_skipped=c.counters.admissions_skipped,
            alpha_history=list(history),
            eviction_history=list(choices),
            tuning_seconds=self.tuner.log.seconds if self.tuner else 0.0,
        )

    def close(self) -> None:
        if self.tuner is not None:
            self.tuner.close()


def sglang_plus(profile, capacity_bytes: int, *, checkpoint_grid: int = 1) -> HybridRadixPolicy:
    return HybridRadixPolicy("sglang+", profile, capacity_bytes, LruLeafEviction(), checkpoint_grid=checkpoint_grid)


def marconi(profile, capacity_bytes: int, *, alpha: float | None = None, checkpoint_grid: int = 1,
            tuning: TuningConfig | None = None) -> HybridRadixPolicy:
    """alpha=None tunes alpha online (starting at 0); a number fixes it."""
    if alpha is None:
        return HybridRadixPolicy("marconi", profile, capacity_bytes, FlopAwareEviction(0.0),
                                 checkpoint_grid=checkpoint_grid, tuning=tuning or TuningConfig())
    return HybridRadixPolicy(f"marconi(alpha={alpha:g})", profile, capacity_bytes, FlopAwareEviction(alpha),
                             checkpoint_grid=checkpoint_grid)
