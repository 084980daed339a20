"""Marconi's victim order under sliding-window (SWA) pool pressure, on any radix tree.

Engine-free: nodes are duck-typed (`.id`, unique for the node's life; `.parent`; `.children`, a
dict; `.key`, its tokens, of which only `len()` is read); what the engine knows about a node comes
through a `WindowView`; FLOPs and bytes through a profile (`prefill_flops(start, end)`,
`kv_bytes_per_token`, `swa_kv_bytes_per_token`). `window` is in tokens.

The rule. Reuse points are leaves (the last token of a branch) and nodes with several children
(branch points); a node's window is the node and its ancestors covering the `window` tokens
before its end. One eviction step frees the first of:
1. stale SWA KV: a live node in no reuse point's window (no hit can read it), oldest first
   (recency, then id); only single-child nodes can be stale;
2. the candidate with the lowest score (`policy/rules/score.py`: norm(recency) + alpha x
   norm(value), min-max over all candidates; exact ties to the lowest tie id), where
   - a leaf is a candidate if the engine may delete it (`evictable_leaf`) and its SWA KV is live:
     it goes whole (full KV and SWA KV), so a leaf's last window is never tombstoned while the
     leaf stays; bytes = (KV + SWA KV) of its edge; tie id: the leaf's;
   - a branch point's window is a candidate if some of its nodes are freeable: live, in no other
     branch point's window and in no leaf's window; it loses the SWA KV of those nodes; bytes =
     their SWA KV; tie id: the deepest of them;
   - value = FLOPs saved per byte freed (`policy/rules/value.py`), FLOPs saved = prefill FLOPs
     from the node's anchor (`value.anchor_end`: the nearest branch point above, or the root) to
     its end; recency = the reuse point's own recency;
3. nothing: the engine's own step (its LRU) is the last resort.
"Live" means SWA KV resident and unlocked.

Two implementations of one rule:
- `reference_plan`: the whole order from scratch, O(nodes): the definition (tests, checks);
- `WindowPlan`: incremental. The engine reports what changed through the hooks (`added`,
  `split`, `removed`, `touched`, `stamped`, `path_stamped`); `next_victim` re-evaluates only
  what those changes can affect, then reads the answer off a lazy heap (stale nodes) and a
  `RankedCandidates` (the rest). `check` compares it, entry by entry, with the reference.

Why the incremental plan is local. Let a chain be a run of single-child nodes; its bottom is the
first reuse point below. A single-child node w is in some window iff d(w) = end(bottom) - end(w)
< window, and then only in its bottom's window or deeper ones; so w is stale iff it is live and
d(w) >= window, and freeable for its bottom X (a branch point) iff d(w) < window and d(w) +
gap(X) >= window, where gap(X) = distance from X's end to the nearest reuse point below it =
min over X's children c of the length of c's chain (down to its bottom, inclusive). A branch point
itself is freeable iff gap(X) >= window. So a change at node v can only affect: v; nodes above v
within `window` tokens and the first branch point there (through gap); the bottom of v's chain
if v is within its window; and, if v became or stopped being a branch point, the bottoms of its
children's chains (their FLOPs are counted from v). Every walk is bounded by `window` tokens or by
one chain's length, never by the size of the tree. Per-branch gaps are kept as lazy min-heaps of
the children's chain lengths (capped at `window`), so a branch point with many children costs
O(log children) per change.

Cost of one eviction step: the flush of what changed since the last one (the previous victim,
and whatever requests did in between), each change read in a window's worth of nodes (plus one
chain's length where a node became or stopped being a branch point, or for the FLOPs' anchor),
then a heap pop (stale SWA KV) or a `RankedCandidates` choice (numpy over per-block values, and
one block rescored when its front runs out). No step reads the whole tree; `bind` does, once.

Assumption (SGLang's): a node's recency only grows, so heap keys read earlier are lower bounds.
`visited` counts the nodes the plan has read (hooks excluded): the cost measure tests hold bounded.
"""

from __future__ import annotations

import heapq
from typing import Any, Protocol

import numpy as np

from sglang_marconi.policy.rules import score
from sglang_marconi.policy.rules import value as value_rule
from sglang_marconi.policy.tree.ranked_candidates import RankedCandidates

STALE, WINDOW, LEAF = "stale", "window", "leaf"
_LEAF, _SINGLE, _BRANCH = 0, 1, 2
_FLOPS_MEMO_SIZE = 1 << 16


class WindowView(Protocol):
    """What the engine knows about a node."""

    def live(self, node) -> bool:
        """SWA KV resident and unlocked."""

    def evictable_leaf(self, node) -> bool:
        """The engine may delete this leaf now."""

    def recency(self, node) -> float:
        """Last access stamp (grows over time)."""

    def alive(self, node) -> bool:
        """Still in the tree (read by the incremental plan only)."""


def leaf_efficiency(profile, anchor_end: int, end: int, tokens: int, flops: float | None = None) -> float:
    """FLOPs saved per byte freed by deleting a leaf of `tokens` tokens ending at `end` (its SWA KV
    and its full KV)."""
    if flops is None:
        flops = profile.prefill_flops(anchor_end, end)
    return value_rule.flops_saved_per_byte(flops, profile.swa_kv_bytes_per_token * tokens,
                                      profile.kv_bytes_per_token * tokens)


def window_efficiency(profile, anchor_end: int, end: int, tokens: int, flops: float | None = None) -> float:
    """FLOPs saved per byte freed by tombstoning `tokens` tokens of a branch point's window (their
    SWA KV; the full KV stays)."""
    if flops is None:
        flops = profile.prefill_flops(anchor_end, end)
    return value_rule.flops_saved_per_byte(flops, profile.swa_kv_bytes_per_token * tokens)


def _kind(node) -> int:
    n = len(node.children)
    return _LEAF if n == 0 else _SINGLE if n == 1 else _BRANCH


# -- the definition -----------------------------------------------------------------------------

def _window_nodes(node, root, window: int) -> list:
    """`node` and its ancestors covering the `window` tokens before its end."""
    out, covered = [], 0
    while node is not root and covered < window:
        out.append(node)
        covered += len(node.key)
        node = node.parent
    return out


def reference_candidates(root, window: int, view: WindowView, profile):
    """From scratch: (stale nodes, oldest first; candidates as (kind, reuse point, nodes, recency,
    efficiency), kind WINDOW or LEAF)."""
    ends, nodes, stack = {root.id: 0}, [], [root]
    while stack:  # every node with its end position (tokens from the root)
        node = stack.pop()
        for child in node.children.values():
            ends[child.id] = ends[node.id] + len(child.key)
            nodes.append(child)
            stack.append(child)

    leaves = [n for n in nodes if not n.children]
    branches = [n for n in nodes if len(n.children) > 1]
    in_leaf_window = {w.id for leaf in leaves for w in _window_nodes(leaf, root, window)}
    branch_windows = {b.id: _window_nodes(b, root, window) for b in branches}
    owners: dict[int, int] = {}
    for nodes_of_b in branch_windows.values():
        for w in nodes_of_b:
            owners[w.id] = owners.get(w.id, 0) + 1

    stale = [n for n in nodes if n.children and view.live(n) and n.id not in in_leaf_window and n.id not in owners]
    stale.sort(key=lambda n: (view.recency(n), n.id))

    def anchor_end(n):  # the nearest reuse point above n (a branch point), or the root
        return value_rule.anchor_end(n, root, None, lambda p: ends[p.id])

    candidates = []
    for b in branches:
        freeable = [w for w in branch_windows[b.id]
                    if view.live(w) and owners[w.id] == 1 and w.id not in in_leaf_window]
        if freeable:
            eff = window_efficiency(profile, anchor_end(b), ends[b.id], sum(len(w.key) for w in freeable))
            candidates.append((WINDOW, b, freeable, view.recency(b), eff))
    for leaf in leaves:
        if view.evictable_leaf(leaf) and view.live(leaf):
            eff = leaf_efficiency(profile, anchor_end(leaf), ends[leaf.id], len(leaf.key))
            candidates.append((LEAF, leaf, [leaf], view.recency(leaf), eff))
    return stale, candidates


def reference_plan(root, window: int, view: WindowView, profile, alpha: float) -> list[tuple[str, list]]:
    """Victims in eviction order, from scratch: (STALE | WINDOW, nodes to tombstone) or (LEAF, [leaf])."""
    stale, candidates = reference_candidates(root, window, view, profile)
    plan = [(STALE, [n]) for n in stale]
    if candidates:
        scores = score.scores(np.asarray([c[3] for c in candidates], float),
                              np.asarray([c[4] for c in candidates], float), alpha)
        order = sorted(range(len(candidates)), key=lambda i: (scores[i], candidates[i][2][0].id))
        plan += [(candidates[i][0], candidates[i][2]) for i in order]
    return plan


# -- the incremental plan -------------------------------------------------------------------------

class _ChildGaps:
    """A branch point's children whose chain is shorter than the window, by chain length."""

    __slots__ = ("length", "heap")

    def __init__(self):
        self.length: dict[int, int] = {}  # child id -> chain length (< window)
        self.heap: list = []  # (length, child id, child), lazily cleaned

    def set(self, child, length: int, window: int) -> None:
        if length >= window:
            self.length.pop(child.id, None)
            return
        if self.length.get(child.id) == length:
            return
        self.length[child.id] = length
        heapq.heappush(self.heap, (length, child.id, child))
        if len(self.heap) > 2 * len(self.length) + 16:
            self.heap = [e for e in self.heap if self.length.get(e[1]) == e[0]]
            heapq.heapify(self.heap)


class WindowPlan:
    """The rule of this module, kept up to date by hooks; see the module docstring."""

    def __init__(self, window: int, view: WindowView, profile):
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.view = view
        self.profile = profile
        self.root = None
        self.visited = 0
        self._clear()

    def _clear(self) -> None:
        self._ranked = RankedCandidates()
        self._stale: dict[int, Any] = {}  # id -> node
        self._stale_heap: list = []  # (recency when pushed, id, node)
        self._ends: dict[int, int] = {}
        self._kinds: dict[int, int] = {}
        self._gaps: dict[int, _ChildGaps] = {}
        self._flops: dict[tuple[int, int], float] = {}
        self._struct: dict[int, Any] = {}  # children or existence changed
        self._local: dict[int, Any] = {}  # liveness or leaf evictability changed
        self._recency: dict[int, Any] = {}  # own recency changed
        self._paths: dict[int, Any] = {}  # recency of the node and all its ancestors changed
        self._removed: dict[int, Any] = {}

    # -- hooks: record only (they may run mid-mutation); no-ops while unbound ----------------
    def added(self, node) -> None:
        """`node` is new under its parent."""
        if self.root is not None:
            self._struct[node.id] = node
            self._struct[node.parent.id] = node.parent

    def split(self, new_parent, child) -> None:
        """`new_parent` was cut off the top of `child` (same tokens, one node more)."""
        if self.root is not None:
            self._struct[new_parent.id] = new_parent
            self._struct[child.id] = child

    def removed(self, node) -> None:
        """`node` leaves the tree (its `.parent` still names its former parent)."""
        if self.root is not None:
            self._removed[node.id] = node
            if node.parent is not None:
                self._struct[node.parent.id] = node.parent

    def touched(self, node) -> None:
        """`node`'s SWA KV, its lock or its leaf evictability may have changed."""
        if self.root is not None:
            self._local[node.id] = node

    def stamped(self, node) -> None:
        """`node`'s recency changed."""
        # Only a candidate's entry holds a recency (stale nodes are re-keyed lazily; a node that
        # becomes a candidate later is evaluated then, with its recency as of then).
        if self.root is not None and node.id in self._ranked:
            self._recency[node.id] = node

    def path_stamped(self, node) -> None:
        """The recency of `node` and of every ancestor changed (a match)."""
        if self.root is not None:
            self._paths[node.id] = node

    def pending(self) -> bool:
        return bool(self._struct or self._local or self._recency or self._paths or self._removed)

    # -- binding ------------------------------------------------------------------------------
    def bind(self, root) -> None:
        """Evaluate the whole tree under `root` (once, or after the engine replaced its root)."""
        self._clear()
        self.root = root
        self._ends[root.id] = 0
        nodes, stack = [], [root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                self._ends[child.id] = self._ends[node.id] + len(child.key)
                nodes.append(child)
                stack.append(child)
        self.visited += len(nodes)
        for node in nodes:
            self._kinds[node.id] = kind = _kind(node)
            if kind == _BRANCH:
                self._fill_gaps(node)
        for node in nodes:
            self._note(node, {}, {})
        reuse: dict[int, Any] = {}
        for node in nodes:
            if self._kinds[node.id] != _SINGLE:
                reuse[node.id] = node
        for node in reuse.values():
            self._evaluate(node)
        self._ranked.compact()  # filled in tree order: sort by recency once

    def detach(self) -> None:
        """Stop keeping the plan (hooks become no-ops) until the next `bind`."""
        self._clear()
        self.root = None

    # -- re-evaluation ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Re-evaluate what the hooks recorded since the last flush."""
        if not self.pending():
            return
        removed, self._removed = self._removed, {}
        struct, self._struct = self._struct, {}
        local, self._local = self._local, {}
        recency, self._recency = self._recency, {}
        paths, self._paths = self._paths, {}
        alive = self.view.alive
        for node in removed.values():
            if not alive(node):
                self._forget(node)
        reuse: dict[int, Any] = {}  # reuse points to re-evaluate
        singles: dict[int, Any] = {}  # single-child nodes already re-checked
        for node in struct.values():
            if node is not self.root and alive(node):
                self._restructure(node, reuse, singles)
        for node in local.values():
            if node is not self.root and alive(node):
                self._note(node, reuse, singles)
        for node in reuse.values():
            if alive(node):
                self._evaluate(node)
        for node in recency.values():
            if node.id not in reuse and node.id in self._ranked and alive(node):
                self._ranked.set_recency(node.id, self.view.recency(node))
        if not paths:
            return
        seen: set[int] = set()
        for node in paths.values():
            while node is not None and node.id not in seen and alive(node):
                seen.add(node.id)
                self.visited += 1
                if node.id in self._ranked and node.id not in reuse:
                    self._ranked.set_recency(node.id, self.view.recency(node))
                node = node.parent

    def _forget(self, node) -> None:
        i = node.id
        self._ranked.remove(i)
        self._stale.pop(i, None)
        self._ends.pop(i, None)
        self._kinds.pop(i, None)
        self._gaps.pop(i, None)

    def _restructure(self, v, reuse: dict, singles: dict) -> None:
        """`v`'s children changed, or `v` is new or was split."""
        old, new = self._kinds.get(v.id), _kind(v)
        self._kinds[v.id] = new
        if old != new and _BRANCH in (old, new):
            # FLOPs of the reuse points under v are counted from v, or no longer are.
            for child in v.children.values():
                bottom = self._bottom(child)
                reuse[bottom.id] = bottom
            if new == _BRANCH:
                self._fill_gaps(v)
            else:
                self._gaps.pop(v.id, None)
        self._note(v, reuse, singles)
        if old == new and new != _SINGLE:
            return  # v still ends the chain above it: nothing there moved
        # Above v: nodes within a window of v's end may change chain bottom (stale or not), and
        # the first branch point there may see one child's chain length change. They all share
        # the bottom of v's chain: one walk down, then d(a) = below + covered.
        window, root = self.window, self.root
        if len(v.children) == 1:
            bottom, below = self._walk_down(v)
        else:
            bottom, below = v, 0
        covered, child, a = len(v.key), v, v.parent
        while a is not root and covered < window:
            self.visited += 1
            if len(a.children) != 1:
                gaps = self._gaps.get(a.id)
                if gaps is None:
                    gaps = self._gaps[a.id] = _ChildGaps()
                gaps.set(child, self._chain_length(child), window)
                reuse[a.id] = a
                break
            if a.id not in singles:
                singles[a.id] = a
                self._single(a, bottom is not None and below + covered < window)
            if bottom is not None and below + covered < window:
                reuse[bottom.id] = bottom
            covered += len(a.key)
            child, a = a, a.parent

    def _note(self, v, reuse: dict, singles: dict) -> None:
        """`v` itself changed: a reuse point is re-evaluated (at the end of the flush); a
        single-child node is re-checked for staleness, and the bottom of its chain, if v is in
        its window, re-evaluated."""
        if len(v.children) != 1:
            reuse[v.id] = v
            return
        if v.id in singles:
            return
        singles[v.id] = v
        bottom, _ = self._walk_down(v)
        if bottom is not None:
            reuse[bottom.id] = bottom
        self._single(v, bottom is not None)

    def _single(self, v, in_window: bool) -> None:
        """Single-child `v` is in its chain bottom's window, or stale if live."""
        self._ranked.remove(v.id)
        if in_window or not self.view.live(v):
            self._stale.pop(v.id, None)
        elif v.id not in self._stale:
            self._stale[v.id] = v
            heapq.heappush(self._stale_heap, (self.view.recency(v), v.id, v))

    def _evaluate(self, x) -> None:
        """Re-evaluate reuse point `x`'s candidate entry."""
        view = self.view
        self._stale.pop(x.id, None)
        self.visited += 1
        if not x.children:
            if view.evictable_leaf(x) and view.live(x):
                end, anchor = self._end(x), self._anchor_end(x)
                eff = leaf_efficiency(self.profile, anchor, end, len(x.key), self._prefill(anchor, end))
                self._ranked.put(x.id, view.recency(x), eff, x.id, (LEAF, [x]))
            else:
                self._ranked.remove(x.id)
            return
        gap = self._gap(x)
        threshold = self.window - gap  # nodes this close to x are in a deeper reuse point's window
        freeable, tokens, d, w = [], 0, 0, x
        while w is not self.root and d < self.window:
            if w is not x:
                self.visited += 1
                if len(w.children) != 1:
                    break  # another branch point: its window holds all the rest
            if d >= threshold and view.live(w):
                freeable.append(w)
                tokens += len(w.key)
            d += len(w.key)
            w = w.parent
        if not freeable:
            self._ranked.remove(x.id)
            return
        end, anchor = self._end(x), self._anchor_end(x)
        eff = window_efficiency(self.profile, anchor, end, tokens, self._prefill(anchor, end))
        self._ranked.put(x.id, view.recency(x), eff, freeable[0].id, (WINDOW, freeable))

    # -- walks ------------------------------------------------------------------------------------
    def _bottom(self, node):
        """The reuse point ending `node`'s chain (one chain's length)."""
        while len(node.children) == 1:
            self.visited += 1
            node = next(iter(node.children.values()))
        return node

    def _walk_down(self, v):
        """(bottom of single-child `v`'s chain, tokens from v's end to the bottom's end) if `v` is
        in the bottom's window, else (None, None)."""
        covered, node = 0, v
        while True:
            node = next(iter(node.children.values()))
            self.visited += 1
            covered += len(node.key)
            if covered >= self.window:
                return None, None
            if len(node.children) != 1:
                return node, covered

    def _chain_length(self, child) -> int:
        """Tokens from `child`'s start to the end of its chain's bottom, capped at the window."""
        covered, node = 0, child
        while True:
            self.visited += 1
            covered += len(node.key)
            if covered >= self.window or len(node.children) != 1:
                return min(covered, self.window)
            node = next(iter(node.children.values()))

    def _fill_gaps(self, branch) -> None:
        gaps = self._gaps[branch.id] = _ChildGaps()
        for child in branch.children.values():
            gaps.set(child, self._chain_length(child), self.window)

    def _gap(self, branch) -> int:
        """min(window, distance from `branch`'s end to the nearest reuse point below)."""
        gaps = self._gaps.get(branch.id)
        if gaps is None:
            self._fill_gaps(branch)
            gaps = self._gaps[branch.id]
        heap, alive = gaps.heap, self.view.alive
        while heap:
            length, i, child = heap[0]
            if gaps.length.get(i) == length and child.parent is branch and alive(child):
                return length
            heapq.heappop(heap)
            if gaps.length.get(i) == length:
                del gaps.length[i]  # the child left (a split or a deletion)
        return self.window

    def _end(self, node) -> int:
        return value_rule.end_position(node, self._known_end, self._remember_end)

    def _known_end(self, node):
        return self._ends.get(node.id)

    def _remember_end(self, node, end: int) -> None:
        self.visited += 1
        self._ends[node.id] = end

    def _anchor_end(self, node) -> int:
        return value_rule.anchor_end(node, self.root, self._skipped, self._end)

    def _skipped(self, node) -> bool:
        """No node is an anchor but for its children (`value.anchor_end`); each one asked is walked past."""
        self.visited += 1
        return False

    def _prefill(self, start: int, end: int) -> float:
        flops = self._flops.get((start, end))
        if flops is None:
            if len(self._flops) >= _FLOPS_MEMO_SIZE:
                self._flops.clear()
            flops = self._flops[start, end] = self.profile.prefill_flops(start, end)
        return flops

    # -- the answer -------------------------------------------------------------------------------
    def next_victim(self, alpha: float):
        """(STALE, [node]), (WINDOW, nodes) or (LEAF, [leaf]): the first step of the plan; None
        when the rule has nothing left (the engine's own step then)."""
        self.flush()
        heap, stale, recency = self._stale_heap, self._stale, self.view.recency
        if len(heap) > 2 * len(stale) + 64:
            self._stale_heap = heap = [(recency(n), i, n) for i, n in stale.items()]
            heapq.heapify(heap)
        while heap:
            t, i, node = heap[0]
            if stale.get(i) is not node:
                heapq.heappop(heap)
                continue
            now = recency(node)
            if now != t:  # stamped since it was pushed: its key only grew
                heapq.heapreplace(heap, (now, i, node))
                continue
            return STALE, [node]
        key = self._ranked.lowest(alpha)
        return None if key is None else self._ranked.payload(key)

    def check(self, alpha: float) -> None:
        """Flush, then assert that every entry (stale set, candidates with their recency,
        efficiency and nodes) and the next victim equal the reference's."""
        self.flush()
        stale, candidates = reference_candidates(self.root, self.window, self.view, self.profile)
        assert set(self._stale) == {n.id for n in stale}, (
            f"stale set: extra {sorted(set(self._stale) - {n.id for n in stale})}, "
            f"missing {sorted({n.id for n in stale} - set(self._stale))}")
        expected = {point.id: (kind, [n.id for n in nodes], float(t), float(e), nodes[0].id)
                    for kind, point, nodes, t, e in candidates}
        actual = {}
        for key in self._ranked.keys():
            kind, nodes = self._ranked.payload(key)
            t, e, tie = self._ranked.entry(key)
            actual[key] = (kind, [n.id for n in nodes], t, e, tie)
        differing = [(k, actual[k], expected[k]) for k in sorted(actual.keys() & expected.keys())
                     if actual[k] != expected[k]]
        assert actual == expected, (
            f"candidates: missing {sorted(expected.keys() - actual.keys())}, "
            f"extra {sorted(actual.keys() - expected.keys())}, differing {differing}")
        plan = reference_plan(self.root, self.window, self.view, self.profile, alpha)

        def ids(step):
            return step and (step[0], [n.id for n in step[1]])

        mine, first = self.next_victim(alpha), plan[0] if plan else None
        assert ids(mine) == ids(first), f"next victim {ids(mine)} != reference {ids(first)}"
