"""Copy SGLang's live radix tree into the policy core's `CacheSnapshot`, so alpha tuning can
replay a window with the engine-free simulator in worker processes.

SGLang keeps KV tokens and Mamba slots in two pools; the simulator has one byte budget. The
snapshot's capacity is what both pools can hold for the tree, in the model profile's bytes:
KV pool tokens x KV bytes per token + Mamba slots x bytes per SSM checkpoint.
"""

from __future__ import annotations

import numpy as np

from sglang_marconi.policy.hybrid_cache import CacheSnapshot


def node_tokens(node) -> np.ndarray:
    key = node.key
    return np.asarray(key.token_ids[: len(key)], dtype=np.int64)


def tree_capacity_bytes(cache, profile) -> int:
    kv_tokens = cache.token_to_kv_pool_allocator.size
    mamba_slots = cache.req_to_token_pool.mamba_pool.size
    return int(kv_tokens * profile.kv_bytes_per_token + mamba_slots * profile.ssm_state_bytes)


def snapshot_unified_tree(cache, profile, *, checkpoint_grid: int = 1) -> CacheSnapshot:
    """Nodes of `cache` (a UnifiedRadixCache with a MAMBA component) in parent-first order."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    root = cache.tree_core.root_node
    parents, tokens, has_state, last_access = [], [], [], []
    index = {id(root): -1}
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        toks = node_tokens(node)
        if len(toks) == 0:
            continue
        index[id(node)] = len(parents)
        parents.append(index[id(node.parent)])
        tokens.append(toks)
        has_state.append(node.component_data[ComponentType.MAMBA].value is not None)
        last_access.append(float(node.last_access_time))
        stack.extend(node.children.values())
    clock = max(last_access, default=0.0)
    return CacheSnapshot(parents, tokens, has_state, last_access, clock,
                         tree_capacity_bytes(cache, profile), checkpoint_grid, cache.page_size)
