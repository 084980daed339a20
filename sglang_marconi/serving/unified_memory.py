"""The `marconi` cache under `--enable-unified-memory`: full KV and Mamba states carved from one
byte buffer (SGLang's `UnifiedKVPool`), so a Mamba state and a run of KV tokens compete for the
same bytes.

SGLang's own answer to a Mamba byte shortfall (`UnifiedRadixCache.evict_for_alloc`, #36713)
walks the FULL component, deleting least recently used KV leaves until the Mamba sub-pool has
the bytes, and only then evicts Mamba states. Here that same walk picks each victim across both
kinds (`MarconiTreeIndex.choose_across`, the policy core's `lowest_across`): a KV leaf (its KV and its state) or an SSM state
tombstoned on a single-child node (its KV stays), whichever has the lowest Marconi utility,
FLOPs saved per byte freed with recency; exact ties to the smallest node id on every rank (then, for
a leaf in both indexes, its KV entry). Scoped to pure Mamba shortfalls (no KV tokens asked in
the same allocation, e.g. a branch state's slot or a decode's state): a KV shortfall keeps the
KV walk over leaves, whose efficiency already counts their state's bytes, because the bytes a
tombstone frees sit in the Mamba band and reach the KV side only through compaction.

The shortfall's walk context (`EvictionWalk.byte_budget`) is added to whatever the caller's
`EvictParams` carried: a probationary state's reservation (`probation_only`) keeps its limit, so
it never takes KV bytes or a regular state (the FULL walk frees nothing under that limit).

The shadow tuner models the same one budget (`runtime.shadow_budget`). Imports SGLang lazily.
"""

from __future__ import annotations

import dataclasses
import functools

from sglang_marconi.serving.cache_state import walk_of


@functools.lru_cache(maxsize=1)
def one_budget_cache_class():
    from sglang_marconi.serving.cache import marconi_cache_class

    class MarconiOneBudgetCache(marconi_cache_class()):
        def _marconi_walk_for(self, params, allocation_reclaim_satisfied):
            walk = walk_of(params)
            pure_mamba = (getattr(params, "mamba_num", 0) > 0 and not getattr(params, "num_tokens", 0)
                          and not getattr(params, "swa_num_tokens", 0))
            if allocation_reclaim_satisfied is None and pure_mamba:
                walk = dataclasses.replace(walk, byte_budget=True)
            return walk

    return MarconiOneBudgetCache
