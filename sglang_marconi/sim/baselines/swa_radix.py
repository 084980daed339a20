"""Furiosa, SGLang+ and Marconi for sliding-window (SWA) hybrids on the simulator's `Policy`
interface. Two trees:

- one byte budget (`--capacity`): `furiosa`, `sglang+` and `marconi` over the policy core's
  `WindowPrefixCache` (`policy/tree/window_cache.py`), the paper-style model;
- the server's two pools (`--kv-tokens` / `--swa-tokens`): `served_marconi_swa`, over
  `ServedWindowCache` (`policy/tree/served_window_cache.py`), the model of SGLang's SWA tree with
  the `marconi` backend, evicting by the rule the server runs (`rules/window_plan.py`); its tuner's
  shadows are the same model (`WindowTuner(pools=...)`), so it tunes the rule the server runs.

- `furiosa`: Furiosa-LLM's rules: every computed token keeps its SWA KV; a static split between a
  global and an SWA pool (`swa_share`, by default in proportion to the per-token bytes, so that SWA
  KV can be kept for every cached token); SWA pressure first reclaims SWA KV beyond each node's
  last window (stale), then drops SWA KV LRU-first at any node, leaves included; global pressure
  evicts LRU leaves.
- `sglang+`: SGLang 0.5.23's SWA component: a request keeps the window before its end and, where
  full KV matched beyond the reusable window, before that point; LRU over leaves (evicted whole)
  and inner nodes (tombstoned: SWA KV dropped, full KV kept); one budget or a static split.
- `marconi`: windows only where reuse is likely (the end and the branch point speculative
  insertion finds); eviction ranks whole leaves and inner windows by recency + alpha x FLOPs saved
  per byte freed and never tombstones inside a branch's last window; alpha tuned online.

On one budget every request's hit is checked (`WindowPrefixCache.verify_hit`) before the request
is admitted: a hit without full KV for all its tokens or without an intact window at its end raises.
"""

from __future__ import annotations

import numpy as np

from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.policy.tree.served_window_cache import ServedWindowCache
from sglang_marconi.policy.tree.window_cache import FURIOSA, MARCONI, SGLANG, WindowPrefixCache, WindowRules
from sglang_marconi.policy.tuning.window_tuner import WindowTuner
from sglang_marconi.sim.policy_api import Outcome, PolicyStats
from sglang_marconi.sim.workload import Request


def proportional_swa_share(profile) -> float:
    """The SWA pool's share that keeps SWA KV for every token the global pool holds."""
    return profile.swa_kv_bytes_per_token / (profile.swa_kv_bytes_per_token + profile.kv_bytes_per_token)


class WindowRadixPolicy:
    """One byte budget (`WindowPrefixCache`)."""

    def __init__(self, name: str, profile, capacity_bytes: int, rules: WindowRules, *, alpha: float = 0.0,
                 swa_share: float | None = None, tuning: ShadowConfig | None = None):
        self.name = name
        self.cache = WindowPrefixCache(profile, capacity_bytes, rules, alpha=alpha, swa_share=swa_share)
        self.tuner = WindowTuner(profile, capacity_bytes, rules, tuning, swa_share) if tuning is not None else None
        self.served = 0
        self.history = [(0, self.cache.alpha)]
        self.end_reasons: list[str] = []

    def serve(self, request: Request) -> Outcome:
        cache = self.cache
        out = request.output_tokens
        lookup = cache.lookup(request.input_tokens)
        cache.verify_hit(request.input_tokens, lookup.hit_tokens)  # the invariant, on every request
        admitted = cache.admit(np.concatenate((request.input_tokens, out)), lookup)
        self.end_reasons.append(lookup.end_reason)
        self.served += 1
        if self.tuner is not None:
            alpha = self.tuner.observe(request.session_id, request.input_tokens, out)
            if alpha is not None:
                cache.alpha = alpha
                self.history.append((self.served, alpha))
        return Outcome(request.input_len, lookup.hit_tokens, lookup.overlap_tokens, admitted)

    def request_records(self) -> dict[str, list]:
        """Per-request fields beyond replay's own: why each hit ended (`HIT_END_REASONS`)."""
        return {"hit_end_reason": list(self.end_reasons)}

    def stats(self) -> PolicyStats:
        c = self.cache
        return PolicyStats(
            kv_tokens_cached=c.full_tokens,
            ssm_states_cached=0,
            bytes_used=c.used_bytes,
            evictions_leaf=c.counters.evictions_leaf,
            evictions_intermediate=c.counters.evictions_window + c.counters.window_trims,
            alpha_history=list(self.history),
            eviction_history=[(at, "window-flops" if c.rules.ranking == "flops" else "lru") for at, _ in self.history],
        )


class ServedWindowPolicy:
    """Marconi on the server's two pools, run as the server runs it (`ServedWindowCache`): a
    request keeps its input + output[:-1] (SGLang never feeds the last decoded token back), and a
    tuned alpha is adopted at the server's sync points (every `sync_every` requests,
    `baselines/served.SyncPoints`) rather than when the tuner decides."""

    def __init__(self, name: str, profile, kv_tokens: int, swa_tokens: int, *, alpha: float = 0.0,
                 tuning: ShadowConfig | None = None, sync_every: int = 32, chunk_size: int | None = None):
        self.name = name
        self.profile = profile
        self.cache = ServedWindowCache(profile, kv_tokens, swa_tokens, alpha=alpha, chunk_size=chunk_size)
        self.tuner = self.sync = None
        if tuning is not None:
            from sglang_marconi.sim.baselines.served import SyncPoints

            self.tuner = WindowTuner(profile, 0, None, tuning, pools=(kv_tokens, swa_tokens), chunk_size=chunk_size)
            self.sync = SyncPoints(self.tuner, sync_every)
        self.served = 0
        self.history = [(0, self.cache.alpha)]

    def serve(self, request: Request) -> Outcome:
        cache = self.cache
        out = request.output_tokens[:-1]
        result = cache.serve_kept(np.concatenate((request.input_tokens, out)), request.input_len)
        self.served += 1
        if self.tuner is not None:
            self.tuner.observe(request.session_id, request.input_tokens, out)
            alpha = self.sync.adopt(self.served, self.tuner.log.requests)
            if alpha is not None and alpha != cache.alpha:
                cache.alpha = alpha
                self.history.append((self.served, alpha))
        return Outcome(request.input_len, result.hit_tokens, result.overlap_tokens, result.tokens_kept)

    def stats(self) -> PolicyStats:
        c = self.cache
        n = c.counters
        return PolicyStats(
            kv_tokens_cached=c.tree_full,
            ssm_states_cached=0,
            bytes_used=c.tree_full * int(self.profile.kv_bytes_per_token) + c.tree_swa * int(
                self.profile.swa_kv_bytes_per_token),
            evictions_leaf=n.evictions_leaf + n.evictions_full_leaf,
            evictions_intermediate=n.evictions_stale + n.evictions_window + n.evictions_fallback,
            alpha_history=list(self.history),
            eviction_history=[(at, "window-flops") for at, _ in self.history],
        )


def furiosa(profile, capacity_bytes: int, *, swa_share: float | None = None) -> WindowRadixPolicy:
    share = proportional_swa_share(profile) if swa_share is None else swa_share
    return WindowRadixPolicy("furiosa", profile, capacity_bytes, FURIOSA, swa_share=share)


def sglang_plus_swa(profile, capacity_bytes: int, *, swa_share: float | None = None) -> WindowRadixPolicy:
    return WindowRadixPolicy("sglang+", profile, capacity_bytes, SGLANG, swa_share=swa_share)


def marconi_swa(profile, capacity_bytes: int, *, alpha: float | None = None, swa_share: float | None = None,
                tuning: ShadowConfig | None = None) -> WindowRadixPolicy:
    """alpha=None tunes alpha online (shadow caches); a number fixes it."""
    if alpha is None:
        return WindowRadixPolicy("marconi", profile, capacity_bytes, MARCONI, swa_share=swa_share,
                                 tuning=tuning or ShadowConfig())
    return WindowRadixPolicy(f"marconi(alpha={alpha:g})", profile, capacity_bytes, MARCONI, alpha=alpha,
                             swa_share=swa_share)


def served_marconi_swa(profile, kv_tokens: int, swa_tokens: int, *, alpha: float | None = None,
                       tuning: ShadowConfig | None = None, sync_every: int = 32,
                       chunk_size: int | None = None) -> ServedWindowPolicy:
    """Marconi's SWA policy on the server's two pools (`--kv-tokens` full-KV token slots,
    `--swa-tokens` SWA token slots, `--chunked-prefill-size`), run as the server runs it.
    alpha=None tunes alpha online."""
    if alpha is None:
        return ServedWindowPolicy("marconi", profile, kv_tokens, swa_tokens, tuning=tuning or ShadowConfig(),
                                  sync_every=sync_every, chunk_size=chunk_size)
    return ServedWindowPolicy(f"marconi(alpha={alpha:g})", profile, kv_tokens, swa_tokens, alpha=alpha,
                              sync_every=sync_every, chunk_size=chunk_size)
