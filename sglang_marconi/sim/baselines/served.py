"""The served cache on the simulator's `Policy` interface: SGLang's radix cache with the `marconi`
backend, modeled request by request (`policy/tree/served_cache.py`), on the pools the server was given
(`--kv-tokens`, `--mamba-slots`, `--mamba-radix-cache-strategy`, `--chunked-prefill-size`).

`sglang+` is the backend's `lru` choice (Marconi's admission, SGLang's LRU eviction), `marconi:A`
FLOP-aware eviction at alpha A, `marconi` the choice tuned online as the served runtime tunes it
(`serving/runtime.py`), by the same protocol (`shadow_tuner.ServedTuning`): every request's kept
tokens (input + output[:-1]) fed in order to a `ShadowTuner` whose shadows model the same pools
(at sample rate 1 the shadow of the choice in force predicts this cache exactly), keyed by the
trace's session (what a server keys by when clients name their sessions:
`runtime.tuner_session_key`), and its choice adopted at sync points only
(`shadow_tuner.sync_point_of`, `record_adopted_at`: at release k x `sync_every`, the choice the tuner held at
release (k - 1) x `sync_every`).
"""

from __future__ import annotations

import numpy as np

from sglang_marconi.policy.tree.served_cache import ServedCache, ServedPools
from sglang_marconi.policy.tuning.shadow_tuner import (ShadowConfig, ShadowTuner, ServedTuning, eviction_for,
                                                       live_record_for)
from sglang_marconi.sim.policy_api import Outcome, PolicyStats
from sglang_marconi.sim.workload import Request


class ServedPolicy:
    def __init__(self, name: str, profile, pools: ServedPools, choice=None, *, tuning: ShadowConfig | None = None,
                 probation: bool = True, sync_every: int = 32, record: bool = False):
        self.name = name
        self.pools = pools
        self.tuner = self.tuning = None
        if tuning is not None:
            self.tuner = ShadowTuner(profile, 1, tuning, probation=probation, served=pools)
            self.tuning = ServedTuning(self.tuner, sync_every)
            choice = self.tuner.current
        self.sync_every = sync_every
        self.cache = ServedCache(profile, pools, choice, probation=probation, record=record)
        if self.tuner is not None:  # as the served runtime's cache, from the first request
            self.cache.continuation = live_record_for(self.tuner.choices)
        self.served = 0
        self.history = [(0, choice)]  # (request index, choice adopted)
        self.hits: list[int] = []

    def serve(self, request: Request) -> Outcome:
        inp = request.input_tokens
        out = np.asarray(request.output_tokens, dtype=np.int64)
        seq = np.concatenate((inp, out[:-1])) if len(out) > 1 else inp
        outcome = self.cache.serve_kept(seq, len(inp))
        self.served += 1
        self.hits.append(outcome.hit_tokens)
        if self.tuning is not None:
            self.tuning.feed(request.session_id, inp, out[:-1], sequence=seq)
            choice = self.tuning.adopted_after(self.served)
            if choice is not None and choice != self.cache.choice:
                self.cache.set_choice(choice)
                self.history.append((self.served, self.cache.choice))
        return Outcome(request.input_len, outcome.hit_tokens, outcome.overlap_tokens, outcome.states_admitted)

    def stats(self) -> PolicyStats:
        c = self.cache
        history = [(at, getattr(eviction_for(choice), "alpha", 0.0), eviction_for(choice).name)
                   for at, choice in self.history]
        return PolicyStats(
            kv_tokens_cached=c.tree_kv,
            ssm_states_cached=c.tree_states,
            bytes_used=c.tree_kv * c.kv_bytes_per_token + c.tree_states * c.ssm_state_bytes,
            evictions_leaf=c.counters.evictions_leaf,
            evictions_intermediate=c.counters.evictions_single_child,
            admissions_skipped=c.counters.skipped_no_slot,
            alpha_history=[(at, alpha) for at, alpha, _ in history],
            eviction_history=[(at, name) for at, _, name in history],
            tuning_seconds=self.tuner.log.seconds if self.tuner else 0.0,
        )


class SyncPoints(ServedTuning):
    """The served runtime's sync points for a caller that feeds its tuner itself (any tuner with
    `choices`, `current` and `log`)."""

    def adopt(self, served: int, observed: int):
        """After the `served`-th request (the tuner has observed `observed`): the choice a sync
        point adopts now, or None (no sync point here)."""
        self.advance(observed)
        return self.adopted_after(served)


def served_capacity_bytes(profile, pools: ServedPools) -> int:
    """The bytes the two pools hold, for tables that report a capacity."""
    return pools.kv_tokens * int(profile.kv_bytes_per_token) + pools.mamba_slots * int(profile.ssm_state_bytes)
