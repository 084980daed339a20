"""The shadow tuner's caches: `HybridPrefixCache`'s admission and eviction, step for step, on edges
that reference the admitting request's tokens instead of holding copies of them.

Both are configurations of `core.TreeCore`, which holds every mechanic once; this module supplies
the edge kind (`ReferencedTree`, `ShadowNode`) and the request form (a `SharedMatch`).

Every decision the tuner makes rests on these caches behaving exactly like the live cache would with
the same choice: the same nodes, the same candidate-index slots in the same order (a near-tie goes
where the reference's arithmetic sends it), the same clock (`tests/test_shadow_cache.py` compares
them on random streams, `tests/test_shadow_equivalence.py` the tuner built on them with the
original tuner). What differs is only what the work costs, which the tuner pays once per choice:

- An edge is (src, start, end): the tokens src[start:end] of the request that admitted them, whose
  own prefix src[:start] is the path above. Splitting moves `start`, merging a node into its child
  moves the child's `start` back (the child's source holds the whole path): no token is copied.
- Matching goes through the request's `SharedMatch`, which compares the request with each source
  once for all shadows (`policy/tree/shared_match.py`); a walk is then dict lookups.
- One walk per request: `lookup` walks the whole sequence and leaves the walk to `admit` (the
  lookup's walk of the input is its prefix).
- FLOPs of a span come from a table shared by the tuner's caches; the candidate index is
  `SmallCandidateIndex` (same slots, cheaper operations, the reference's victim); the value column
  is computed only where the shadow's fixed choice ranks by it.
- The tuner calls `lookup` and `admit` with the request's `SharedMatch` (no validation: the tuner
  validated the tokens once).
"""

from __future__ import annotations

import numpy as np

from sglang_marconi.policy.rules.eviction import EvictionPolicy
from sglang_marconi.policy.tree.core import FlopsTable, TreeCore, TreeSnapshot, check_capacity
from sglang_marconi.policy.tree.shared_match import SharedMatch
from sglang_marconi.policy.tree.small_candidates import SmallCandidateIndex

__all__ = ["FlopsTable", "ReferencedTree", "ShadowCache", "ShadowNode"]


class ShadowNode:
    __slots__ = ("parent", "children", "key", "src", "start", "end", "has_state", "last_access", "lock_count",
                 "slot", "id")

    def __init__(self, parent, key, src, start: int, end: int, node_id: int):
        self.parent = parent
        self.children: dict = {}
        self.key = key  # this node's key in its parent's children (the first page of its edge)
        self.src = src
        self.start = start
        self.end = end
        self.has_state = False
        self.last_access = 0.0
        self.lock_count = 0
        self.slot = -1
        self.id = node_id

    @property
    def tokens(self) -> np.ndarray:
        return self.src[self.start : self.end]

    def __repr__(self) -> str:
        return f"ShadowNode(id={self.id}, [{self.start},{self.end}), state={self.has_state}, children={len(self.children)})"


class ReferencedTree:
    """`RadixTree`'s structure with referenced edges: an edge is (src, start, end), the tokens
    src[start:end] of the request that admitted them; walks take the request's `SharedMatch`."""

    def __init__(self, page_size: int = 1):
        self.page_size = page_size
        self.root = ShadowNode(None, None, np.empty(0, dtype=np.int64), 0, 0, 0)
        self.root.lock_count = 1  # the root is never evicted
        self._next_id = 1

    def key_at(self, src: np.ndarray, pos: int):
        return int(src[pos]) if self.page_size == 1 else src[pos : pos + self.page_size].tobytes()

    def walk(self, match: SharedMatch, n: int):
        """`RadixTree.walk` of match.seq[:n]: (path, partial, partial_len, overlap)."""
        node, pos, path = self.root, 0, []
        page = self.page_size
        keys, agreed_end, seq = match.keys, match.agreed_end, match.seq
        while pos < n:
            child = node.children.get(keys[pos])
            if child is None:
                break
            end = child.end if child.end < n else n
            agreed = end if child.src is seq else agreed_end(child.src, pos, end)
            if agreed < child.end:
                k = agreed - pos
                k -= k % page
                return path, child, k, pos + k
            path.append(child)
            node, pos = child, child.end
        return path, None, 0, pos

    def nodes(self):
        """Every node except the root, parents first (`RadixTree.nodes`' order)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _new_node(self, parent: ShadowNode, key, src: np.ndarray, start: int, end: int) -> ShadowNode:
        node = ShadowNode(parent, key, src, start, end, self._next_id)
        self._next_id += 1
        return node

    def split(self, child: ShadowNode, k: int) -> ShadowNode:
        """Cut `child`'s edge after k tokens; return the new node holding the first k."""
        parent = child.parent
        head = self._new_node(parent, child.key, child.src, child.start, child.start + k)
        head.last_access = child.last_access
        head.lock_count = child.lock_count  # a lock covers the whole path above the locked node
        parent.children[head.key] = head
        child.start += k
        child.key = self.key_at(child.src, child.start)
        child.parent = head
        head.children[child.key] = child
        return head

    def add_leaf(self, parent: ShadowNode, match: SharedMatch, start: int, end: int) -> ShadowNode:
        """A leaf holding match.seq[start:end] (its key is the request's, shared by every shadow)."""
        key = match.keys[start]
        leaf = ShadowNode(parent, key, match.seq, start, end, self._next_id)  # `_new_node`, inline: once per request
        self._next_id += 1
        parent.children[key] = leaf
        return leaf

    def restore_leaf(self, parent: ShadowNode, src: np.ndarray, start: int, end: int) -> ShadowNode:
        """A leaf rebuilt from a snapshot's edge (`edge_of`)."""
        key = self.key_at(src, start)
        leaf = self._new_node(parent, key, src, start, end)
        parent.children[key] = leaf
        return leaf

    @staticmethod
    def edge_of(node: ShadowNode) -> tuple:
        return node.src, node.start, node.end

    def remove_leaf(self, leaf: ShadowNode) -> ShadowNode:
        parent = leaf.parent
        del parent.children[leaf.key]
        leaf.parent = None
        return parent

    def merge_into_child(self, node: ShadowNode) -> ShadowNode:
        """Remove single-child `node`, its child's edge now beginning where `node`'s did (the
        child's source holds the whole path); return the child."""
        (child,) = node.children.values()
        parent = node.parent
        child.start = node.start
        child.key = node.key
        child.parent = parent
        parent.children[child.key] = child
        node.parent = None
        node.children = {}
        return child

    def check_node(self, node: ShadowNode) -> None:
        """Raise AssertionError if `node`'s edge disagrees with its path or its source."""
        assert node.start == node.parent.end and node.end > node.start, node
        assert (node.end - node.start) % self.page_size == 0 and node.end <= len(node.src), node
        assert node.key == self.key_at(node.src, node.start), node
        if node.parent is not self.root:
            assert np.array_equal(node.src[: node.start], node.parent.src[: node.start]), node
        for key, child in node.children.items():
            assert child.parent is node and child.key == key


class ShadowCache(TreeCore):
    # Its own attributes in slots: the core's stay within the 30 an instance keeps inline, where CPython
    # caches both its attribute reads and its method lookups (`own_code.py` on why that matters).
    __slots__ = ("page_size", "root", "_walk", "_walked")

    def __init__(self, profile, capacity_bytes: int, eviction: EvictionPolicy, *, checkpoint_grid: int = 1,
                 page_size: int = 1, state_slots: int | None = None, probation: bool = False,
                 flops: FlopsTable | None = None):
        check_capacity(profile, capacity_bytes, state_slots)
        tree = ReferencedTree(page_size)
        self.page_size = page_size
        self.root = tree.root
        self._walk = tree.walk
        self._walked = None  # (match, walk) that lookup leaves for admit
        # A shadow's choice is fixed for its life (a copy under another choice is another cache).
        self._configure(profile, capacity_bytes, eviction, tree, SmallCandidateIndex(tie_key=SmallCandidateIndex.node_id),
                        checkpoint_grid=checkpoint_grid, state_slots=state_slots, probation=probation, flops=flops,
                        fixed_choice=True)

    def nodes(self):
        """Every node except the root, parents first (`RadixTree.nodes`' order)."""
        return self.tree.nodes()

    _request_edge_is_span = True
    _hot_methods = TreeCore._hot_methods + ("lookup", "admit")

    @staticmethod
    def _request_edge(match: SharedMatch, start: int, end: int) -> tuple:
        return match, start, end

    @staticmethod
    def _input_part(walk, n_in: int):
        """The walk of the input's first n_in tokens (the lookup's), from the walk of the whole
        sequence: its nodes that end by n_in, and the node it stops inside, if any."""
        path, partial, partial_len, overlap = walk
        for j, node in enumerate(path):
            if node.end > n_in:  # it starts at or before n_in
                if node.start == n_in:
                    return path[:j], None, 0, n_in
                return path[:j], node, n_in - node.start, n_in
        if partial is None:
            return walk
        if partial.start >= n_in:
            return path, None, 0, n_in
        if overlap <= n_in:
            return walk
        return path, partial, n_in - partial.start, n_in

    # -- request API -----------------------------------------------------------------------------
    def lookup(self, match: SharedMatch) -> tuple[int, int | None]:
        """`HybridPrefixCache.lookup` of the request's input: (hit tokens, checkpoint_at). It walks
        the whole sequence once and keeps the walk for `admit`, which follows on the same tree."""
        page = self.page_size
        seq, input_len = match.seq, match.input_len
        walk = self._walk(match, len(seq) - len(seq) % page)
        self._walked = (match, walk)
        path, partial, _, overlap = walk
        if not path and partial is None:
            return 0, None  # nothing matched: `_hit` finds no hit and no branch, and touches nothing
        n_in = input_len - input_len % page
        if partial is not None or (path and path[-1].end > n_in):  # else the walk stops within the input
            path, partial, _, overlap = self._input_part(walk, n_in)
        hit, checkpoint_at, _ = self._hit(path, partial, overlap, input_len)
        return hit, checkpoint_at

    def admit(self, match: SharedMatch, checkpoint_at: int | None = None, probation_at: int | None = None) -> int:
        """`HybridPrefixCache.admit` of the request's input + output."""
        seq = match.seq
        n = len(seq) - len(seq) % self.page_size
        walked, self._walked = self._walked, None
        if n == 0:
            return 0
        walk = walked[1] if walked is not None and walked[0] is match else self._walk(match, n)
        return self._admit(match, n, walk, checkpoint_at, probation_at)

    @staticmethod
    def _same_edge(x: ShadowNode, y: ShadowNode) -> bool:
        """`same_contents`' edge test: the same span of one source needs no token compared."""
        return (x.src is y.src and x.start == y.start) or np.array_equal(x.src[x.start:x.end], y.src[y.start:y.end])

    # -- snapshots -------------------------------------------------------------------------------
    @classmethod
    def from_snapshot(cls, profile, snap: TreeSnapshot, eviction: EvictionPolicy, *, flops: FlopsTable | None = None):
        cache = cls(profile, snap.capacity_bytes, eviction, checkpoint_grid=snap.checkpoint_grid,
                    page_size=snap.page_size, state_slots=snap.state_slots, probation=snap.keeps_probation,
                    flops=flops)
        cache._load_snapshot(snap)
        return cache
