"""The tree core's evictable-device-leaf set, reporting each change of membership to listeners.

A node's leaf status changes on many of SGLang's paths (a child inserted or revived from the host,
a child evicted, a FULL-only lock) that reach no component hook of ours; SGLang routes every one of
them through `evictable_device_leaves.add` / `.discard` (`UnifiedTreeCore._update_evictable_leaf_sets`
and the eviction paths). A listener only records the node (O(1)); nothing is evaluated while SGLang
is mid-mutation. Imports nothing of SGLang.
"""

from __future__ import annotations

from typing import Callable


class LeafSetWatch(set):
    __slots__ = ("listeners",)

    def __init__(self, leaves, listeners=()):
        super().__init__(leaves)
        self.listeners: list[Callable] = list(listeners)

    def add(self, node) -> None:
        if node not in self:
            set.add(self, node)
            for listener in self.listeners:
                listener(node)

    def discard(self, node) -> None:
        if node in self:
            set.discard(self, node)
            for listener in self.listeners:
                listener(node)


def watch_leaves(tree_core, listener: Callable) -> LeafSetWatch:
    """Wrap `tree_core.evictable_device_leaves` once and add `listener` (once); returns the set."""
    leaves = tree_core.evictable_device_leaves
    if not isinstance(leaves, LeafSetWatch):
        leaves = tree_core.evictable_device_leaves = LeafSetWatch(leaves)
    if listener not in leaves.listeners:
        leaves.listeners.append(listener)
    return leaves
