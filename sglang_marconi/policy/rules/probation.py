"""The probationary SSM states of one tree, oldest first: the state at the end of an input, kept
only in free room (or room freed from other probationary states), evicted first, confirmed by a
reuse. One registry for every cache that keeps them: the served cache (`serving/admission.py`,
`serving/components.py`), the simulator's `HybridPrefixCache`, the shadows' `ShadowCache` and the
served-cache model `ServedCache`.

Every path that removes a node or its state removes its entry (`forget`; in the server the MAMBA
component's `evict_component`, which SGLang calls whenever a state is tombstoned or its node
deleted, under any pressure), and a reset clears them all, so the registry never pins a dead node.
Entries are keyed by node id and hold the node itself (an id reused by another node is not
confused with it). Engine-free.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional


class ProbationRegistry:
    def __init__(self):
        self._nodes: dict[int, Any] = {}  # node id -> node, in admission order

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node) -> bool:
        return self._nodes.get(node.id) is node

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._nodes.values()))

    def add(self, node) -> None:
        self._nodes[node.id] = node

    def confirm(self, node) -> bool:
        """A match reused `node`'s state, or a regular state was committed on it: it is no longer
        on probation. Returns whether it was."""
        if self._nodes.get(node.id) is node:
            del self._nodes[node.id]
            return True
        return False

    forget = confirm  # its state (or the node) is gone: same bookkeeping, another reason

    def clear(self) -> None:
        self._nodes.clear()

    @classmethod
    def of(cls, nodes) -> "ProbationRegistry":
        """A registry holding `nodes`, oldest first (restoring a snapshot)."""
        registry = cls()
        for node in nodes:
            registry.add(node)
        return registry

    def oldest_unlocked(self, locked: Callable[[Any], Any]):
        """The oldest entry `locked(node)` is false for (removed from the registry), or None."""
        for node_id, node in self._nodes.items():
            if not locked(node):
                del self._nodes[node_id]
                return node
        return None

    def oldest(self, usable: Callable[[Any], Optional[bool]]):
        """The oldest entry `usable(node)` accepts (True), dropping entries it reports gone (None);
        entries it declines (False: locked for now) stay."""
        for node_id, node in list(self._nodes.items()):
            verdict = usable(node)
            if verdict is None:
                del self._nodes[node_id]
            elif verdict:
                return node
        return None


def evict_oldest_probationary(cache) -> bool:
    """Under pressure probationary states go first, oldest first, locked ones skipped: a leaf is
    evicted whole (its KV too, as any leaf eviction), a node with children loses only its state.
    For the policy core's caches (`HybridPrefixCache`, `ShadowCache`: `_probation`, `evict`,
    `_drop`, `_refresh`, `_compress`, `ssm_states`, `counters`). False if none could go."""
    node = cache._probation.oldest_unlocked(lambda n: n.lock_count)
    if node is None:
        return False
    if not node.children:
        cache.evict(node)
        return True
    cache._drop(node)
    node.has_state = False
    cache.ssm_states -= 1
    cache.counters.evictions_single_child += 1
    cache._refresh(node)
    cache._compress(node)
    return True
