"""Which nodes Marconi may evict under state pressure (paper §4.2), the one predicate the
simulator's model of the served cache (`tree/served_cache.py`) and the served components
(`serving/tree_index.py`) call, through this module.

Under KV pressure the candidates are the evictable leaves (only a leaf frees KV; one without a
state is worth nothing). Under state pressure (Mamba slots) a node holding a state is a candidate
when its state is unlocked and it is an evictable leaf (deleted whole) or has exactly one child (it
loses its state, its KV stays): a node with several children is a branch point, where the
requests that share its prefix resume, and is never a candidate.
"""

from __future__ import annotations


def state_candidate(state_locked: bool, evictable_leaf: bool, n_children: int) -> bool:
    """Whether a node holding a state may lose it under state pressure (see the module docstring)."""
    return not state_locked and (evictable_leaf or n_children == 1)
