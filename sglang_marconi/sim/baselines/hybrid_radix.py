"""SGLang+, Marconi and coverage on the simulator's `Policy` interface.

All use the policy core's `HybridPrefixCache` with Marconi's admission; they differ only in
eviction: SGLang+ is LRU over leaves with path refresh, Marconi is FLOP-aware with a fixed alpha
or a choice tuned online by shadow caches (`policy/tuning/shadow_tuner.py`), coverage is SGLang PR
#38000's rule (`policy/rules/eviction/coverage.py`).
"""

from __future__ import annotations

import numpy as np

from sglang_marconi.policy.rules.eviction import CoverageEviction, EvictionPolicy, FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, ShadowTuner, adopt_choice, eviction_for
from sglang_marconi.sim.policy_api import Outcome, PolicyStats
from sglang_marconi.sim.workload import Request


class TreePolicy:
    """What every policy-core cache policy shares: the optional tuner, the history of choices, the
    request loop and the stats. A subclass builds `self.cache` and says how a request is admitted
    (`_admit`) and reported (`_outcome`)."""

    def _start(self, name: str, profile, capacity_bytes: int, eviction: EvictionPolicy, checkpoint_grid: int,
               tuning: ShadowConfig | None, probation: bool) -> EvictionPolicy:
        """Name, tuner and history; returns the eviction the cache starts with."""
        self.name = name
        self.tuner = None
        if tuning is not None:
            self.tuner = ShadowTuner(profile, capacity_bytes, tuning, checkpoint_grid=checkpoint_grid,
                                     probation=probation)
            eviction = eviction_for(self.tuner.current)
        self.served = 0
        self.history = [(0, getattr(eviction, "alpha", 0.0), eviction.name)]  # (request index, alpha, policy)
        return eviction

    def serve(self, request: Request) -> Outcome:
        # the cache's serve, keeping the joined input + output for the tuner: it would otherwise
        # copy a long request's tokens a second time
        cache, inp = self.cache, request.input_tokens
        lookup = cache.lookup(inp)
        seq = np.concatenate((inp, np.asarray(request.output_tokens, dtype=np.int64)))
        admitted = self._admit(seq, lookup, len(inp))
        self.served += 1
        if self.tuner is not None:
            choice = self.tuner.observe(request.session_id, inp, request.output_tokens, sequence=seq)
            if choice is not None:
                adopt_choice(cache, choice, self.tuner.record)
                e = cache.eviction
                self.history.append((self.served, getattr(e, "alpha", 0.0), e.name))
        return self._outcome(request, lookup, admitted)

    def stats(self) -> PolicyStats:
        c = self.cache
        return PolicyStats(
            kv_tokens_cached=c.kv_tokens,
            ssm_states_cached=c.ssm_states,
            bytes_used=c.used_bytes,
            evictions_leaf=c.counters.evictions_leaf,
            evictions_intermediate=c.counters.evictions_single_child,
            admissions_skipped=c.counters.admissions_skipped,
            alpha_history=[(at, alpha) for at, alpha, _ in self.history],
            eviction_history=[(at, name) for at, _, name in self.history],
            tuning_seconds=self.tuner.log.seconds if self.tuner else 0.0,
        )


class HybridRadixPolicy(TreePolicy):
    def __init__(self, name: str, profile, capacity_bytes: int, eviction: EvictionPolicy, *,
                 checkpoint_grid: int = 1, tuning: ShadowConfig | None = None, probation: bool = False):
        eviction = self._start(name, profile, capacity_bytes, eviction, checkpoint_grid, tuning, probation)
        self.cache = HybridPrefixCache(profile, capacity_bytes, eviction, checkpoint_grid=checkpoint_grid,
                                       probation=probation)

    def _admit(self, seq: np.ndarray, lookup, input_len: int) -> int:
        return self.cache.admit(seq, lookup.checkpoint_at, input_len if self.cache.probation else None)

    @staticmethod
    def _outcome(request: Request, lookup, admitted: int) -> Outcome:
        return Outcome(request.input_len, lookup.hit_tokens, lookup.overlap_tokens, admitted)


def sglang_plus(profile, capacity_bytes: int, *, checkpoint_grid: int = 1, probation: bool = False) -> HybridRadixPolicy:
    return HybridRadixPolicy("sglang+", profile, capacity_bytes, LruLeafEviction(), checkpoint_grid=checkpoint_grid,
                             probation=probation)


def coverage(profile, capacity_bytes: int, *, checkpoint_grid: int = 1, probation: bool = False) -> HybridRadixPolicy:
    return HybridRadixPolicy("coverage", profile, capacity_bytes, CoverageEviction(), checkpoint_grid=checkpoint_grid,
                             probation=probation)


def marconi(profile, capacity_bytes: int, *, alpha: float | None = None, checkpoint_grid: int = 1,
            tuning: ShadowConfig | None = None, probation: bool = False) -> HybridRadixPolicy:
    """alpha=None tunes the eviction choice online (shadow caches); a number fixes alpha."""
    if alpha is None:
        return HybridRadixPolicy("marconi", profile, capacity_bytes, FlopAwareEviction(0.0),
                                 checkpoint_grid=checkpoint_grid, tuning=tuning or ShadowConfig(), probation=probation)
    return HybridRadixPolicy(f"marconi(alpha={alpha:g})", profile, capacity_bytes, FlopAwareEviction(alpha),
                             checkpoint_grid=checkpoint_grid, probation=probation)
