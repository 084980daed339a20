"""A radix tree over token sequences with copied edges: structure only (no bytes, no policy; the
mechanics over it are `core.TreeCore`'s).

Each node's edge holds the tokens between its parent's end and its own end; `end` is the
absolute prefix length at the node, so it never changes when edges are split or merged.
`page_size` > 1 makes every edge a whole number of pages (as a paged KV pool stores them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from sglang_marconi.policy.errors import MarconiError


class Node:
    __slots__ = ("parent", "children", "tokens", "end", "has_state", "last_access", "lock_count", "slot", "id")

    def __init__(self, parent: Node | None, tokens: np.ndarray, end: int, node_id: int):
        self.parent = parent
        self.children: dict = {}
        self.tokens = tokens
        self.end = end
        self.has_state = False  # an SSM checkpoint taken after token `end`
        self.last_access = 0.0
        self.lock_count = 0
        self.slot = -1  # position in the eviction candidate index, -1 if not a candidate
        self.id = node_id

    @property
    def start(self) -> int:
        return self.end - len(self.tokens)

    def __repr__(self) -> str:
        return f"Node(id={self.id}, [{self.start},{self.end}), state={self.has_state}, children={len(self.children)})"


class PoolNode(Node):
    """A node of a tree over two pools (`core.PoolTree`): `lock_count` locks the KV of the path
    above it, `state_lock` its own state (a running request's reused state); `state_time` is when
    its state was last committed or reused (the recency ranked under state pressure)."""

    __slots__ = ("state_lock", "state_time", "input_end")

    def __init__(self, parent: Node | None, tokens: np.ndarray, end: int, node_id: int):
        super().__init__(parent, tokens, end, node_id)
        self.state_lock = 0
        self.state_time: float | None = None
        self.input_end = False  # its state was kept where a request's input ended


@dataclass(slots=True)
class Walk:
    """Where a sequence leaves the tree: `path` holds the nodes matched whole (root excluded);
    if the match stops inside an edge, `partial` is that child and `partial_len` the tokens of
    its edge that matched. `overlap` is the number of leading tokens present in the tree."""

    path: list[Node]
    partial: Node | None
    partial_len: int
    overlap: int

    @property
    def last(self) -> Node | None:
        return self.path[-1] if self.path else None


def as_token_array(tokens) -> np.ndarray:
    """Validate a token sequence and return it as a 1-D int64 array (no copy if already one)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise MarconiError(f"token sequence must be a 1-D integer array, got dtype={tokens.dtype} ndim={tokens.ndim}")
        arr = tokens.astype(np.int64, copy=False)
    else:
        try:
            seq = list(tokens)
        except TypeError:
            raise MarconiError(f"token sequence must be a sequence of integers, got {type(tokens).__name__}") from None
        bad = next((t for t in seq if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
        if bad is not None:
            raise MarconiError(f"token sequence must contain only integers, found {bad!r}")
        arr = np.asarray(seq, dtype=np.int64)
    if arr.size == 0:
        raise MarconiError("token sequence is empty")
    return arr


class RadixTree:
    def __init__(self, page_size: int = 1, node_type: type = Node):
        if not isinstance(page_size, int) or page_size < 1:
            raise MarconiError(f"page_size must be a positive integer, got {page_size!r}")
        self.page_size = page_size
        self._node_type = node_type
        self._next_id = 1
        self.root = node_type(None, np.empty(0, dtype=np.int64), 0, 0)
        self.root.lock_count = 1  # the root is never evicted

    # -- keys and comparison -------------------------------------------------------------------
    def _key(self, seq: np.ndarray, pos: int):
        if self.page_size == 1:
            return int(seq[pos])
        return seq[pos : pos + self.page_size].tobytes()

    def page_aligned(self, n: int) -> int:
        return n - n % self.page_size

    # -- queries --------------------------------------------------------------------------------
    def walk(self, seq: np.ndarray, below: Node | None = None) -> Walk:
        """Where `seq` leaves the tree, walked from the root, or from `below` (a node whose path
        is seq[:below.end]; `path` then holds the nodes under it)."""
        page = self.page_size
        node, pos, n, path = below or self.root, below.end if below else 0, len(seq) - len(seq) % page, []
        while pos < n:  # `_key` and `_common_prefix`, inline: the hot path of every lookup
            child = node.children.get(int(seq[pos]) if page == 1 else seq[pos : pos + page].tobytes())
            if child is None:
                break
            edge = child.tokens
            lim = min(len(edge), n - pos)
            eq = edge[:lim] == seq[pos : pos + lim]
            k = lim if eq.all() else int(eq.argmin())
            k -= k % page
            if k < len(edge):
                return Walk(path, child, k, pos + k)  # k >= 1 page: the key matched
            path.append(child)
            node, pos = child, pos + k
        return Walk(path, None, 0, pos)

    def nodes(self) -> Iterator[Node]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- mutations ------------------------------------------------------------------------------
    def _new_node(self, parent: Node, tokens: np.ndarray, end: int) -> Node:
        node = self._node_type(parent, tokens, end, self._next_id)
        self._next_id += 1
        return node

    def split(self, child: Node, k: int) -> Node:
        """Cut `child`'s edge after k tokens; return the new node holding the first k."""
        assert 0 < k < len(child.tokens) and k % self.page_size == 0
        parent = child.parent
        head = self._new_node(parent, child.tokens[:k], child.start + k)
        head.last_access = child.last_access
        head.lock_count = child.lock_count  # a lock covers the whole path above the locked node
        parent.children[self._key(child.tokens, 0)] = head
        child.tokens = child.tokens[k:]
        child.parent = head
        head.children[self._key(child.tokens, 0)] = child
        return head

    def add_leaf(self, parent: Node, tokens: np.ndarray) -> Node:
        leaf = self._new_node(parent, tokens, parent.end + len(tokens))
        parent.children[self._key(tokens, 0)] = leaf
        return leaf

    def remove_leaf(self, leaf: Node) -> Node:
        assert not leaf.children and leaf is not self.root
        parent = leaf.parent
        del parent.children[self._key(leaf.tokens, 0)]
        leaf.parent = None
        return parent

    def restore_leaf(self, parent: Node, tokens: np.ndarray) -> Node:
        """A leaf rebuilt from a snapshot's edge (`edge_of`)."""
        return self.add_leaf(parent, tokens)

    @staticmethod
    def edge_of(node: Node) -> tuple:
        """What a snapshot keeps of `node`'s edge: the arguments of `restore_leaf`."""
        return (node.tokens,)

    def check_node(self, node: Node) -> None:
        """Raise AssertionError if `node`'s edge or its children's keys disagree with the tree."""
        assert node.end == node.parent.end + len(node.tokens), node
        assert len(node.tokens) > 0 and len(node.tokens) % self.page_size == 0, node
        for key, child in node.children.items():
            assert child.parent is node and self._key(child.tokens, 0) == key

    def merge_into_child(self, node: Node) -> Node:
        """Remove single-child `node`, prepending its edge to its child's; return the child."""
        assert len(node.children) == 1 and node is not self.root
        (child,) = node.children.values()
        parent = node.parent
        child.tokens = np.concatenate((node.tokens, child.tokens))
        child.parent = parent
        parent.children[self._key(child.tokens, 0)] = child
        node.parent = None
        node.children = {}
        return child
