"""What keeping a candidate is worth to Marconi (Eq. 1): the prefill FLOPs a hit at the node saves,
per byte its eviction frees, counted on the paper's compressed tree. The one implementation: the
simulator's caches, the tuner's shadows, the served cache's model (`tree/served_cache.py`), the
served components (`serving/tree_index.py`, `serving/host_tier.py`) and the sliding-window plan
(`rules/window_plan.py`) call these functions through this module, never a copy, so replacing one
here replaces it everywhere (`tests/serving/test_rule_mutants.py` does).

- `anchor_end`: where a hit at a node starts saving. SGLang's tree (and the simulator's models of
  it) keeps stateless single-child nodes the paper's compressed tree would have merged into their
  child (split points whose branch is gone, tombstoned states); a hit at a node resumes from its
  anchor, the nearest ancestor that is the root, has several children or can itself be resumed
  from (`is_anchor`: holds a state; never, for sliding windows, whose reuse points are leaves and
  branch points). The FLOPs saved are `profile.prefill_flops(anchor_end, end)`.
- `flops_saved_per_byte`: those FLOPs per byte freed (0 where nothing is freed).
- `end_position`: tokens from the root to a node's end, memoized by the caller.

FLOPs and bytes themselves are the cost model's (`policy/cost/model_profile.py`: numbers of a
model); which span a hit saves and what one divides by is the policy's rule, kept here.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


def flops_saved_per_byte(flops: float, state_bytes: int, leaf_kv_bytes: int = 0) -> float:
    """Eq. 1, the value Marconi ranks a candidate by: the prefill FLOPs a hit at the node saves
    over its anchor on the compressed tree (`flops`), per byte its eviction frees: its state's
    bytes (an SSM state, or the sliding-window KV a tombstone frees), plus for a leaf deleted whole
    the KV of its edge (`leaf_kv_bytes`; 0 for a node whose KV stays). 0 when nothing is freed."""
    freed = state_bytes + leaf_kv_bytes
    return flops / freed if freed else 0.0


def anchor_end(node, root, is_anchor: Optional[Callable[[Any], bool]], end_of: Callable[[Any], int]) -> int:
    """The end (tokens from the root, `end_of`) of `node`'s anchor on the compressed tree: the
    nearest ancestor that is `root`, has several children or `is_anchor` (None: none is). The
    single-child ancestors skipped belong to `node`'s compressed edge: a hit at `node` saves the
    prefill from the anchor's end to `node`'s."""
    parent = node.parent
    if is_anchor is None:
        while parent is not root and len(parent.children) == 1:
            parent = parent.parent
    else:
        while parent is not root and len(parent.children) == 1 and not is_anchor(parent):
            parent = parent.parent
    return end_of(parent)


def end_position(node, known: Callable[[Any], Optional[int]], remember: Callable[[Any, int], None]) -> int:
    """Tokens from the root to the end of `node`'s edge (`len(n.key)` summed along the path):
    `known(n)` is a node's end where the caller has it (the root's must be known), each end found
    on the way is handed to `remember(n, end)`. An edge's end never moves while the node lives,
    so the walk stops at the first node already known."""
    end = known(node)
    if end is not None:
        return end
    chain = []
    while end is None:
        chain.append(node)
        node = node.parent
        end = known(node)
    for n in reversed(chain):
        end += len(n.key)
        remember(n, end)
    return end
