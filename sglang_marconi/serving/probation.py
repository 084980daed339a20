"""The probationary SSM states of one tree (`admission.py`: the state at the end of an input, kept
only in free room, evicted first, confirmed by a reuse), oldest first.

Primary data, the same on every rank (a function of the request stream). Every path that removes
a node or its state removes its entry (`forget`: the MAMBA component's `evict_component`, which
SGLang calls whenever a state is tombstoned or its node deleted, under any pressure), and a reset
clears them all, so the registry never pins a dead node. Engine-free.
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
