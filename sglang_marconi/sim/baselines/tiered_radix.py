"""SGLang+ and Marconi with a host tier (`--host-capacity`), on the simulator's `Policy` interface.

Both run the policy core's `TieredPrefixCache` with Marconi's admission. `sglang+` is upstream
HiCache write_back: SGLang's LRU on the device, `UpstreamWriteBack` deciding what a device
eviction writes to the host, LRU on the host. `marconi` is FLOP-aware eviction on the device
(alpha tuned online by device shadow caches, as without a host tier, or fixed) and
`MarconiTiering`: demote or drop by FLOPs saved per byte with recency, the host ranking its own
candidates (`host_alpha`: its weight of FLOPs per byte against recency, None to follow the
device's alpha), or, with `host_depth`, by conversation depth (`tier_rules.DepthOrder`). The tuner's shadows model the device tier alone: they choose how the device
evicts, not what the host keeps.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from sglang_marconi.policy.rules.eviction import EvictionPolicy, FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.policy.rules.tier_rules import MarconiTiering, UpstreamWriteBack
from sglang_marconi.policy.tree.tiered_cache import TieredPrefixCache
from sglang_marconi.sim.baselines.hybrid_radix import TreePolicy
from sglang_marconi.sim.policy_api import Outcome
from sglang_marconi.sim.workload import Request


class TieredRadixPolicy(TreePolicy):
    def __init__(self, name: str, profile, capacity_bytes: int, host_capacity_bytes: int, rules,
                 eviction: EvictionPolicy, *, checkpoint_grid: int = 1, tuning: ShadowConfig | None = None):
        eviction = self._start(name, profile, capacity_bytes, eviction, checkpoint_grid, tuning, False)
        self.cache = TieredPrefixCache(profile, capacity_bytes, host_capacity_bytes, rules, eviction,
                                       checkpoint_grid=checkpoint_grid)

    def _admit(self, seq: np.ndarray, lookup, input_len: int) -> int:
        return self.cache.admit(seq, lookup.checkpoint_at)

    @staticmethod
    def _outcome(request: Request, lookup, admitted: int) -> Outcome:
        return Outcome(request.input_len, lookup.hit_tokens, lookup.overlap_tokens, admitted,
                       host_hit_tokens=lookup.host_hit_tokens, loaded_bytes=lookup.loaded_bytes)

    def tier_summary(self) -> dict:
        """The host tier's size, contents at the end and traffic over the run."""
        c = self.cache
        alpha = c.rules.alpha if isinstance(c.rules, MarconiTiering) else 0.0
        return {"host_capacity_bytes": c.host_capacity_bytes, "host_rules": c.rules.name,
                "host_alpha": "device" if alpha is None else alpha, "host_bytes_used": c.host_used_bytes,
                "host_states_cached": c.host_states, **asdict(c.counters)}


def sglang_plus_host(profile, capacity_bytes: int, host_capacity_bytes: int, *,
                     checkpoint_grid: int = 1) -> TieredRadixPolicy:
    return TieredRadixPolicy("sglang+", profile, capacity_bytes, host_capacity_bytes, UpstreamWriteBack(),
                             LruLeafEviction(), checkpoint_grid=checkpoint_grid)


def marconi_host(profile, capacity_bytes: int, host_capacity_bytes: int, *, alpha: float | None = None,
                 host_alpha: float | None = 1.0, host_depth: float | str | None = None, checkpoint_grid: int = 1,
                 tuning: ShadowConfig | None = None) -> TieredRadixPolicy:
    """alpha=None tunes the device's eviction choice online; host_alpha=None follows the device's alpha.
    `host_depth` (a number B or "auto"): the host ranked by the continuation signal instead
    (`MarconiTiering(depth=...)`, its record fed by this cache), as `--marconi-host-depth` serves it."""
    rules = MarconiTiering(host_alpha, depth=host_depth)
    suffix = "" if host_depth is None else f"+host-depth:{host_depth if host_depth == 'auto' else f'{host_depth:g}'}"
    if alpha is None:
        return TieredRadixPolicy(f"marconi{suffix}", profile, capacity_bytes, host_capacity_bytes, rules,
                                 FlopAwareEviction(0.0), checkpoint_grid=checkpoint_grid,
                                 tuning=tuning or ShadowConfig())
    return TieredRadixPolicy(f"marconi(alpha={alpha:g}){suffix}", profile, capacity_bytes, host_capacity_bytes, rules,
                             FlopAwareEviction(alpha), checkpoint_grid=checkpoint_grid)
