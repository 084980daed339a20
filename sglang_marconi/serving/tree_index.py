"""The eviction candidates of one SGLang tree, kept up to date incrementally (no walk per eviction).

One `CandidateIndex` (policy core) per pressure:
- KV pressure: SGLang's unlocked evictable device leaves (only leaves free KV); deleted whole.
- Mamba pressure: nodes holding an unlocked SSM state with at most one child: a leaf is deleted
  whole, a single-child node only loses its state (its KV stays).
Each entry holds the node's recency and its value column: FLOPs saved per byte freed
(Marconi), the replay length (SegLen), or the positions a state covers (`coverage`, SGLang
#38000's rule: `policy/rules/eviction/coverage.py`; a subtree's change re-scores its nearest stated
ancestor, whose value is a walk of the stateless nodes below it). Who is chosen is the policy core's rule
(`CandidateIndex.lowest`, `lowest_across`); this module only keeps the columns current.

Under the depth rule (`depth_rule`, `--marconi-eviction depth:B|depth:auto`) the same candidates
are ranked by `policy/rules/eviction/depth.py` instead (the largest age / (1 + depth)^B, ages from
the recency column), a node's depth read from the record of finished sequences at the node's
(end, last token) (`node_end_token`); the value column is then unused.

Recency under KV pressure is SGLang's `node.last_access_time` (a match stamps the whole matched
path); under Mamba pressure it is when the node's state was last committed or reused by a match
(`state_time`), so only the node hit is refreshed, as in the paper.

The rules are the policy core's, called here over SGLang's nodes: which nodes are candidates
(`policy/rules/candidates.py`), their value (`policy/rules/value.py`: FLOPs saved per byte, on the
paper's *compressed* tree: end(n) = tokens from the root to the end of n's edge; anchor(n) = the
nearest ancestor that is the root, holds a state or has several children, since SGLang keeps
stateless single-child nodes the paper would have merged into their child, such as split points
whose branch is gone and tombstoned states; value = prefill_flops(anchor_end, end) / bytes freed,
bytes freed = the state's bytes, plus for a leaf the KV of its compressed edge; a node without a
state saves nothing) and the score that ranks them (`policy/rules/score.py`).

Upkeep (O(1) per hook; the components call these): `touched` (recency, lock or leaf-set
membership may have changed), `changed` (state, children or existence may have changed: also
the first non-skippable node under each child when the node's skippability flips, since its
anchor moved), `stamp` / `state_used` (copy a fresh recency in). Dirty nodes are re-evaluated by
`flush()`. `check()` compares every entry with a from-scratch evaluation (tests).

Ties: exact ties among candidates go to the smallest SGLang node id (the indexes' `tie_key`), never
to a slot. SGLang numbers its nodes in creation order (a split keeps the child's id and numbers the
new parent), which the request stream fixes on every rank, and a rebuild creates no node; the
slots, on the contrary, depend on this rank's history of flushes and rebuilds.

Derived state only: everything here is a function of the tree (and of each node's two recorded
facts, `_marconi_end` and `_marconi_state_time`, which the components record before touching the
index). So a fault here is recovered by `invalidate()`: the next use rebuilds the index from the
tree, which every rank of a group holds identically (`faults.py`).

Works on SGLang's tree objects by duck typing (no SGLang import).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

from sglang_marconi.policy.rules import candidates
from sglang_marconi.policy.rules import value as value_rule
from sglang_marconi.policy.rules.eviction.coverage import coverage_value, lowest_coverage
from sglang_marconi.policy.tree.candidate_index import CandidateIndex, keep, lowest_across
from sglang_marconi.serving.leaf_watch import watch_leaves

KV, MAMBA = 0, 1  # index positions: KV pressure, Mamba pressure
PRESSURE_NAMES = ("kv", "mamba")
_FLOPS_MEMO_SIZE = 1 << 16
_node_id = operator.attrgetter("id")


def _edge_length(node) -> int:
    return len(node.key)


def _known_end(node):
    end = getattr(node, "_marconi_end", None)
    return 0 if end is None and node.parent is None else end  # the root: 0


def _remember_end(node, end: int) -> None:
    node._marconi_end = end


def node_end(node) -> int:
    """Tokens from the root to the end of a live node's edge, cached on the nodes
    (`_marconi_end`: an edge's end never moves while the node lives)."""
    return value_rule.end_position(node, _known_end, _remember_end)


def node_end_token(node) -> tuple[int, int]:
    """(end, last token) of a live node: where the record of finished sequences
    (`policy/rules/continuation.py`) looks its depth up."""
    key = node.key
    return node_end(node), int(key.token_ids[len(key) - 1 + bool(key.is_bigram)])


def state_time(node) -> float:
    """Recency under Mamba pressure: when the node's state was last committed or matched."""
    return getattr(node, "_marconi_state_time", node.last_access_time)


def record_state_use(node, now: float) -> None:
    """The node's state was just committed or matched (primary data: recorded before the index)."""
    node._marconi_state_time = now


class MarconiTreeIndex:
    """Bound lazily to `tree_core` (at the first eviction or upkeep after one), rebuilt by one tree
    walk after a reset or `invalidate()`."""

    def __init__(self, tree_core_of, profile, mamba_type):
        self._tree_core_of = tree_core_of  # () -> SGLang's tree core (read at each bind)
        self.profile = profile
        self._mamba_type = mamba_type
        self.root = None
        self._dirty: set = set()
        self._struct: set = set()
        # Told of each change of the tree core's leaf set (`leaf_watch`); the owner may wrap
        # `changed` in its fault guard.
        self.leaf_listener = self.changed
        self.value_kind = "flops"  # the value column: "flops", "seglen" or "coverage"
        self.depth_rule = None  # when set, the victim is this rule's (`eviction/depth.py`), not the score's
        self.rebuilds = 0
        self._clear()

    def _clear(self) -> None:
        self._flops: dict[tuple[int, int], float] = {}  # (start, end) -> prefill_flops, reused
        self.indexes = (CandidateIndex(tie_key=_node_id), CandidateIndex(tie_key=_node_id))
        self._slots: tuple[dict[int, int], dict[int, int]] = ({}, {})
        self._known: dict[int, bool] = {}  # node id -> skippable, as of its last flush

    # -- hooks (cheap; may run mid-mutation, so they only record) ------------------------------
    # Nothing is recorded while unbound: binding rebuilds from the tree, and a cache that never
    # evicts must not accumulate every node it ever touched.
    def touched(self, node) -> None:
        if self.root is not None:
            self._dirty.add(node)

    def changed(self, node) -> None:
        if self.root is not None:
            self._struct.add(node)

    def stamp(self, node) -> None:
        """Copy `node.last_access_time` into the KV index (SGLang has just set it)."""
        slot = self._slots[KV].get(node.id)
        if slot is not None:
            self.indexes[KV].last_access[slot] = node.last_access_time

    def state_used(self, node) -> None:
        """Copy the node's recorded state time into the Mamba index."""
        slot = self._slots[MAMBA].get(node.id)
        if slot is not None:
            self.indexes[MAMBA].last_access[slot] = state_time(node)

    def recency(self, pressure: int, node) -> float:
        return node.last_access_time if pressure == KV else state_time(node)

    # -- binding ---------------------------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self.root is not None

    def _bind(self) -> None:
        tree_core = self._tree_core_of()
        self.tree_core = tree_core
        self.root = tree_core.root_node
        self._arena = tree_core._node_arena
        # leaf status changes on SGLang paths no hook of ours sees (a host-only child revived by an
        # insert, a load back): the leaf set itself reports them
        self._leaves = watch_leaves(tree_core, self.leaf_listener)
        self._has_mamba = self._mamba_type in tree_core.components_by_type
        self._kv_bytes = int(self.profile.kv_bytes_per_token)
        self._state_bytes = int(self.profile.ssm_state_bytes) if self._has_mamba else 0
        self._is_anchor = self._has_state if self._has_mamba else None
        self.root._marconi_end = 0
        self.rebuild()

    def rebuild(self) -> None:
        """Re-evaluate every node (after a bind, or a switch of the value column)."""
        self.rebuilds += 1
        self._clear()
        self._dirty.clear()
        self._struct.clear()
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._known[node.id] = self._skippable(node)
            self._refresh(node)

    def invalidate(self) -> None:
        """Forget everything (after a fault, a reset, or while upstream's walks run instead):
        the next use rebuilds from the tree."""
        self.root = None
        self._dirty = set()
        self._struct = set()
        self._clear()

    def use_value_column(self, kind: str) -> None:
        """"flops" (FLOPs per byte), "seglen" (replay length) or "coverage" (positions covered); a
        switch re-evaluates all."""
        if kind not in ("flops", "seglen", "coverage"):
            raise ValueError(f"value column {kind!r}: expected flops, seglen or coverage")
        if kind != self.value_kind:
            self.value_kind = kind
            if self.root is not None:
                self.rebuild()

    def use_rule(self, value_kind: str, depth_rule=None) -> None:
        """The value column (`use_value_column`) and the depth rule in force (None: the score's)."""
        self.use_value_column(value_kind)
        self.depth_rule = depth_rule

    # -- the compressed tree ---------------------------------------------------------------------
    def _has_state(self, node) -> bool:
        return self._has_mamba and node.component_data[self._mamba_type].value is not None

    def _skippable(self, node) -> bool:
        """A stateless single-child node: the paper's tree would have merged it into its child."""
        return node is not self.root and len(node.children) == 1 and not self._has_state(node)

    def _anchor_end(self, node) -> int:
        return value_rule.anchor_end(node, self.root, self._is_anchor, node_end)

    def evaluate(self, node) -> tuple[Optional[float], Optional[float]]:
        """`node`'s value as a candidate of (KV pressure, Mamba pressure), None where it is not a
        candidate. A live node of the bound tree is assumed. (Runs for every dirty node at each
        eviction step: written flat, with locals.)"""
        leaf = node in self._leaves
        if self._has_mamba:
            data = node.component_data[self._mamba_type]
            if data.value is None:  # no state: nothing can hit here, it only frees KV
                return (0.0 if leaf else None), None
            mamba_cand = candidates.state_candidate(data.lock_ref, leaf, len(node.children))
            if not (leaf or mamba_cand):
                return None, None
            state_bytes = self._state_bytes
        elif not leaf:
            return None, None
        else:
            mamba_cand, state_bytes = False, 0
        if self.value_kind == "coverage":
            value = coverage_value(node, self._has_state, _edge_length)
            return (0.0 if leaf else None), (value if mamba_cand else None)
        end = node_end(node)
        start = self._anchor_end(node)
        if self.value_kind == "seglen":
            return (float(end - start) if leaf else None), (float(end - start) if mamba_cand else None)
        flops = self._flops.get((start, end))
        if flops is None:  # nodes are re-evaluated far more often than their span changes
            if len(self._flops) >= _FLOPS_MEMO_SIZE:
                self._flops.clear()
            flops = self._flops[start, end] = self.profile.prefill_flops(start, end)
        if leaf:
            eff = value_rule.flops_saved_per_byte(flops, state_bytes, self._kv_bytes * (end - start))
            return eff, (eff if mamba_cand else None)
        return None, value_rule.flops_saved_per_byte(flops, state_bytes, 0)

    # -- upkeep ----------------------------------------------------------------------------------
    def _alive(self, node) -> bool:
        return self._arena.get(node.id) is node

    def _refresh(self, node) -> None:
        if node is self.root:
            return
        if not self._alive(node):
            self._set(KV, node, 0.0, None)
            self._set(MAMBA, node, 0.0, None)
            self._known.pop(node.id, None)
            return
        effs = self.evaluate(node)
        self._set(KV, node, node.last_access_time, effs[KV])
        self._set(MAMBA, node, state_time(node), effs[MAMBA])

    def _set(self, p: int, node, last_access, value: Optional[float]) -> None:
        keep(self.indexes[p], self._slots[p], node, None if value is None else (last_access, value))

    def pending(self) -> int:
        return len(self._dirty) + len(self._struct)

    def flush(self) -> None:
        """Bind if needed; re-evaluate what the hooks marked since the last flush."""
        if self.root is None or self._tree_core_of().root_node is not self.root:
            self._bind()
            return
        if not (self._dirty or self._struct):
            return
        todo, self._dirty = self._dirty, set()
        struct, self._struct = self._struct, set()
        coverage = self.value_kind == "coverage"
        for node in struct:
            todo.add(node)
            if coverage:  # what a state covers reaches down to the next states: re-score it
                above = self._stated_ancestor(node)
                if above is not None:
                    todo.add(above)
            if not self._alive(node):
                continue
            skippable = self._skippable(node)
            # A node first seen here is new since the last flush: before, it did not exist,
            # which is the same as being skipped.
            if self._known.get(node.id, True) != skippable:
                for child in node.children.values():
                    while self._skippable(child):
                        child = next(iter(child.children.values()))
                    todo.add(child)
            self._known[node.id] = skippable
        for node in todo:  # any order: slots decide no tie
            self._refresh(node)

    def _stated_ancestor(self, node):
        """The nearest live ancestor of `node` holding a state (None: the root is reached)."""
        parent = node.parent
        while parent is not None and parent is not self.root:
            if self._alive(parent) and self._has_state(parent):
                return parent
            parent = parent.parent
        return None

    # -- choosing --------------------------------------------------------------------------------
    def choose(self, pressure: int, weight: float, counters=None):
        """The lowest-utility candidate for `pressure` (KV or MAMBA) with the rule's weight, or None."""
        self.flush()
        index = self.indexes[pressure]
        if pressure == MAMBA and self.value_kind == "coverage":
            return self._settled(lambda: (pressure, lowest_coverage(index)) if len(index) else None, counters)
        rule = self.depth_rule
        if rule is not None:  # the largest age / (1 + depth)^B, depths read from the nodes' ends
            return self._settled(lambda: (pressure, rule.choose(index)) if len(index) else None, counters)
        return self._settled(lambda: (pressure, index.lowest(weight)) if len(index) else None, counters)

    def choose_across(self, weight: float, counters=None):
        """One byte budget: the lowest-utility candidate of either kind, a KV leaf (deleted whole)
        or an SSM state (tombstoned on a single-child node), normalized over the union
        (`lowest_across`). A leaf holding a state sits in both indexes with the same value and
        counts at the older of its two recencies."""
        self.flush()
        return self._settled(lambda: lowest_across(self.indexes, weight), counters)

    def _settled(self, find, counters):
        """The node `find()` names ((pressure, node) or None), once its entry is current: a stale
        one is refreshed and the choice made again (a node refreshed once is taken as it is)."""
        repaired = None
        while True:
            found = find()
            if found is None:
                return None
            pressure, node = found
            if node is repaired or self._current(pressure, node):
                return node
            if counters is not None:
                counters.stale_repairs += 1
            self._refresh(node)
            repaired = node

    def _current(self, pressure: int, node) -> bool:
        """Safety net on the chosen victim: alive, still a candidate of `pressure`, same recency.
        (Its value is not recomputed here: `check()` verifies every entry in the tests.)"""
        slot = self._slots[pressure][node.id]
        if not self._alive(node) or self.indexes[pressure].last_access[slot] != self.recency(pressure, node):
            return False
        leaf = node in self._leaves
        if pressure == KV:
            return leaf
        data = node.component_data[self._mamba_type]
        return data.value is not None and candidates.state_candidate(data.lock_ref, leaf, len(node.children))

    def check(self) -> None:
        """Flush, then assert both indexes equal a from-scratch evaluation of the whole tree."""
        self.flush()
        expected: tuple[dict, dict] = ({}, {})
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.root:
                continue
            values = self.evaluate(node)
            for p in (KV, MAMBA):
                if values[p] is not None:
                    expected[p][node.id] = (float(self.recency(p, node)), values[p])
        for p in (KV, MAMBA):
            index = self.indexes[p]
            actual = {n.id: (float(index.last_access[i]), float(index.efficiency[i])) for i, n in enumerate(index.items)}
            assert actual == expected[p], (
                f"{PRESSURE_NAMES[p]} index out of date: missing {sorted(expected[p].keys() - actual.keys())}, "
                f"extra {sorted(actual.keys() - expected[p].keys())}, differing "
                f"{sorted(k for k in actual.keys() & expected[p].keys() if actual[k] != expected[p][k])}"
            )
            assert all(self._slots[p][n.id] == i for i, n in enumerate(index.items)), "slot map out of date"

    def items(self, pressure: int) -> list[Any]:
        return list(self.indexes[pressure].items)
