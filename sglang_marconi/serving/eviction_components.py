"""FLOP-aware (Marconi) eviction inside SGLang's own `UnifiedRadixCache` (paper §4.2).

SGLang frees memory under two separate pressures, each driven by one tree component's walk
(`UnifiedRadixCache._evict_components`, one `_evict_device_next_node` call per step, at most
one mutation per call):

- KV-token shortage, FULL walk: only leaves free KV, so the candidates are SGLang's unlocked
  evictable device leaves (`tree_core.evictable_device_leaves`). The walk returns the leaf;
  SGLang deletes it whole, its Mamba state included.
- Mamba-slot shortage, MAMBA walk: the candidates are nodes holding a Mamba state whose state
  is unlocked, with at most one child: an evictable leaf is returned and deleted whole; a
  single-child node only has its state tombstoned (SGLang's internal-node tombstone: its KV
  stays and deeper hits still read it). If no such node exists but SGLang still holds unlocked
  states (on nodes with several children, or on leaves whose KV is locked), the walk falls back
  to upstream's choice (the least recently used unlocked state) so an allocation never fails
  where upstream would succeed; these are counted as `evictions_fallback`.

Victim = lowest `norm(recency) + alpha * norm(flop_efficiency)`, min-max normalized over the
candidates of that pressure (`CandidateIndex.lowest`, i.e. `marconi_scores`, the policy core's
code); alpha = 0 is LRU over the same candidates.

Recency under KV pressure is SGLang's `node.last_access_time`; under Mamba pressure it is when
the node's SSM state was last committed or reused by a match (`state_time`), as the paper and
upstream's own Mamba LRU refresh only the node hit. What SGLang stamps: a match stamps the matched
node *and every ancestor* (`unified_tree_core.py:1029-1033`, decreasing by 1e-5 per level so a
parent stays older than its child); an insert stamps every node it walks (`_touch_node`,
`:1096`); a split stamps the suffix node (`:1524`); the MAMBA component stamps the node it
commits a state to (`mamba.py:248,252`). Only the MAMBA component's private LRU list refreshes
just the matched node (`mamba.py:127-149`). So with this recency, a state on a single-child
ancestor of a hit is refreshed too, unlike the paper's "refresh only the node hit"; leaves are
unaffected (a hit's ancestors are never leaves).

flop_efficiency(n) = prefill_flops(anchor_end, end(n)) / bytes freed, with
- end(n) = tokens from the root to the end of n's edge (key lengths up the path, cached on the
  node as `_marconi_end`: SGLang never changes a node's end, a split keeps the suffix node's);
- anchor = n's parent in the paper's *compressed* tree: the nearest ancestor that is the root,
  holds a state, or has several children. SGLang keeps stateless single-child nodes that the
  paper would have merged into their child (split points whose branch is gone, and every state
  this policy tombstones, since SGLang has no node merge); they count as part of the child's
  edge, as in the paper, where the evicted node's edge is absorbed by its child;
- bytes freed = ssm_state_bytes if n holds a state, plus, for a leaf, the KV of its
  (compressed) edge, `(end - anchor_end) * kv_bytes_per_token`;
- a node without a state saves no FLOPs (nothing can hit at it), so its efficiency is 0.
A tree without a MAMBA component (attention only) counts every node as reusable with no state.

Incremental index (no tree walk per eviction): one `CandidateIndex` per pressure, kept in one
`MarconiTreeIndex` per cache (`cache.marconi_index`). Hooks overridden (both components unless
noted), each O(1):
- `redistribute_on_node_split`, `commit_insert_component_data`, `discard_deleted_session_leaf`
  (node deletion), `evict_component` (tombstone / deletion): mark the node, and the parent whose
  child count changed, *structurally* dirty;
- `acquire_component_lock` / `release_component_lock`: mark the lock's anchor dirty (the only
  node whose candidacy a lock changes without HiCache: FULL's path lock only touches
  ancestors, which have children; MAMBA's lock is single-node);
- `update_component_on_insert_overlap` and MAMBA `refresh_lru(WALKDOWN)`: copy the fresh
  `last_access_time` of a walked node into the index (SGLang stamps it just before);
- FULL `finalize_match_result_in_tree_core`: runs after SGLang stamps the matched path, copies
  the matched node's stamp (O(1): the KV index holds leaves only, and every other node on the
  path has a child).
Lazy part: dirty nodes are re-evaluated by `flush()`, at the next eviction step and, with
Marconi's admission, right after each checkpoint and release (`serving/cache.py`), where the tree
is consistent (SGLang stamps a split suffix only after the split hook returns), in node-id order
so that slots, hence ties, are reproducible. A structurally dirty node whose compressed-tree
status (skippable or not) changed also re-evaluates the first non-skippable node under each of
its children, whose anchor moved. As a safety net, the chosen victim is checked before it is
returned (alive, still a candidate, same recency); if not, it is refreshed and the choice
repeated (`counters.stale_repairs`, which the tests keep at 0; `check()` compares every entry,
efficiency included, with a from-scratch evaluation).

Not covered (the components delegate to upstream's walks, unchanged): HiCache host tiers and
session radix cache, detected when a walk starts (the `marconi` factory builds upstream's own cache
for these, `serving/plugin.py`; this is the safety net for a cache built another way). When alpha tuning has chosen SGLang's LRU, Mamba
pressure runs upstream's walk too, and KV pressure takes the index's alpha = 0 victim: with
SGLang's LRU strategy that is the same leaf (the least recently used evictable one), without
upstream's heap of every evictable leaf built at each walk's start (O(leaves) per call).

Fault guard: every Marconi-specific step these components take on the scheduler thread (the
index hooks, the index flush, the victim choice) runs under a guard. An exception there costs one
warning (`MarconiEvictionSettings.fault`, logged once per cache), marks the settings `faulted`,
and that call and every later one fall back to upstream's behaviour: the eviction walks are
upstream's (a walk that faulted mid-way restarts as upstream's), and the index hooks become
no-ops. Upstream's own code (the `super()` calls, and the tree mutations a Marconi victim
triggers) stays outside the guard, so SGLang's own errors propagate as they would upstream.
`observer` is the caller's instrumentation (tests): its exceptions propagate too.
"""

from __future__ import annotations

import functools
import logging
import operator

import numpy as np
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from sglang_marconi.policy.candidate_index import CandidateIndex
from sglang_marconi.policy.eviction.flop_aware import check_alpha

KV_PRESSURE = "kv"
MAMBA_PRESSURE = "mamba"
BYTE_PRESSURE = "bytes"  # one byte budget short of Mamba bytes: victims of either kind (choose_across)
_KV, _MAMBA = 0, 1
_PRESSURES = (KV_PRESSURE, MAMBA_PRESSURE)
_FLOPS_MEMO_SIZE = 1 << 16
_MAX_PENDING = 1 << 12  # dirty nodes flushed while upstream's walks run
_node_id = operator.attrgetter("id")
log = logging.getLogger("sglang_marconi")

__all__ = [
    "EvictionCounters",
    "MarconiEvictionSettings",
    "MarconiTreeIndex",
    "MarconiVictim",
    "marconi_component_overrides",
    "marconi_index",
]  # plus MarconiFullComponent / MarconiMambaComponent, built on first access (imports SGLang)


@dataclass
class EvictionCounters:
    evictions_leaf: int = 0  # leaves deleted whole (KV and state), under either pressure
    evictions_single_child: int = 0  # states tombstoned on single-child nodes (KV kept)
    evictions_fallback: int = 0  # Mamba pressure without Marconi candidates: upstream's LRU state
    evictions_probationary: int = 0  # probationary states, evicted first under Mamba pressure
    stale_repairs: int = 0  # chosen victims whose index entry was out of date (expected 0)


@dataclass(frozen=True)
class MarconiVictim:
    """One eviction decision, reported to `MarconiEvictionSettings.observer` before it is made."""

    pressure: str  # KV_PRESSURE or MAMBA_PRESSURE
    kind: str  # "leaf", "single_child" or "fallback"
    node: Any  # SGLang's UnifiedTreeNode, still untouched
    alpha: float


class MarconiEvictionSettings:
    """What the Marconi components need: the model's FLOP/byte profile and alpha.

    `alpha` may be changed at any time (an alpha tuner does); the next eviction uses it.
    `observer`, if set, is called with a `MarconiVictim` for every decision, before it is applied.

    Faults: `fault(where, exc)` records the first exception in Marconi's own code (`faulted`, a
    one-line description; None while healthy), logs one warning, and calls `on_fault(where, exc)`
    if set (the runtime sets it: stop tuning, tell the other ranks). From then on every Marconi
    path of the components and the cache delegates to upstream.
    """

    def __init__(self, profile, alpha: float = 0.0, observer: Optional[Callable[[MarconiVictim], None]] = None):
        if isinstance(profile, str):
            from sglang_marconi.policy.model_profile import load_profile

            profile = load_profile(profile)
        for attr in ("kv_bytes_per_token", "ssm_state_bytes", "prefill_flops"):
            if not hasattr(profile, attr):
                raise TypeError(f"profile {profile!r} has no {attr}")
        self.profile = profile
        self.alpha = alpha
        self.counters = EvictionCounters()
        self.observer = observer
        # Alpha tuning may choose SGLang's own LRU over any alpha: upstream's walks, except that
        # under KV pressure the index's alpha = 0 choice stands in for the same victim.
        self.use_upstream_lru = False
        # The index's second column: "flops" (FLOP efficiency, Marconi) or "seglen" (the replay
        # length back to the anchor, SegLen-style; `alpha` is then its weight).
        self.value_kind = "flops"
        # Probationary states at the end of each input (`serving/admission.py`), evicted first.
        self.probation = False
        self.faulted: Optional[str] = None
        self.on_fault: Optional[Callable[[str, BaseException], None]] = None

    def fault(self, where: str, exc: BaseException) -> None:
        """Marconi's code raised `exc` in `where`: fall back to upstream from now on (first fault
        only: later ones are already covered by the fallback and cost nothing)."""
        if self.faulted is not None:
            return
        self.faulted = f"{where}: {type(exc).__name__}: {exc}"
        log.warning("Marconi fault in %s (%s: %s); this cache falls back to SGLang's own eviction from now on",
                    where, type(exc).__name__, exc, exc_info=(type(exc), exc, exc.__traceback__))
        callback = self.on_fault
        if callback is not None:
            try:
                callback(where, exc)
            except Exception as cb_exc:  # the fallback itself must never take the scheduler down
                log.warning("Marconi: fault callback failed (%s: %s)", type(cb_exc).__name__, cb_exc)

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha = check_alpha(value)

    def __repr__(self) -> str:
        return f"MarconiEvictionSettings(profile={getattr(self.profile, 'name', self.profile)!r}, alpha={self.alpha})"


class MarconiTreeIndex:
    """The eviction candidates of one SGLang tree, one `CandidateIndex` per pressure.

    Works on SGLang's tree objects by duck typing (no SGLang import). Bound lazily to
    `cache.tree_core` at the first eviction, and rebuilt (one tree walk) if the tree is reset.
    """

    def __init__(self, cache, settings: MarconiEvictionSettings, mamba_type):
        self.cache = cache
        self.settings = settings
        self._mamba_type = mamba_type
        self.root = None
        self._dirty: set = set()
        self._struct: set = set()
        self._seglen = False
        # Probationary states by node id, oldest first (kept whether or not the index is bound:
        # admission records them from the first request). Entries whose node or state is gone
        # are dropped lazily, when a victim is looked for.
        self.probation: dict[int, Any] = {}
        self.probation_only = False  # an eviction walk that may take probationary states only
        # One byte budget (`--enable-unified-memory`) short of Mamba bytes: the FULL walk that
        # funds them picks across kinds (`choose_across`); set by `unified_memory.py`.
        self.byte_budget = False
        self._clear()

    def _clear(self) -> None:
        self._flops: dict[tuple[int, int], float] = {}  # (start, end) -> prefill_flops, reused
        self.indexes = (CandidateIndex(), CandidateIndex())
        self._slots: tuple[dict[int, int], dict[int, int]] = ({}, {})
        self._known: dict[int, bool] = {}  # node id -> skippable, as of its last flush

    # -- hooks (cheap; may run mid-mutation, so they only record) --------------------------
    # Nothing is recorded while the index is unbound (before the first eviction, or after
    # HiCache / a session cache made it step aside): binding rebuilds it from the tree, and a
    # cache that never evicts must not accumulate every node it ever touched.
    def touched(self, node) -> None:
        """Recency, lock or leaf-set membership of `node` may have changed."""
        if self.root is not None:
            self._dirty.add(node)

    def changed(self, node) -> None:
        """`node`'s state, children or existence may have changed."""
        if self.root is not None:
            self._struct.add(node)

    def stamp(self, node) -> None:
        """Copy `node.last_access_time` into the KV index (SGLang has just set it)."""
        slot = self._slots[_KV].get(node.id)
        if slot is not None:
            self.indexes[_KV].last_access[slot] = node.last_access_time

    def state_used(self, node, now: float) -> None:
        """`node`'s SSM state was just committed or matched (at SGLang time `now`): its recency
        under Mamba pressure."""
        node._marconi_state_time = now
        slot = self._slots[_MAMBA].get(node.id)
        if slot is not None:
            self.indexes[_MAMBA].last_access[slot] = node._marconi_state_time

    @staticmethod
    def state_time(node) -> float:
        """Recency under Mamba pressure: when the node's state was last used (the paper refreshes
        only the node hit; SGLang's `last_access_time` is stamped along the whole matched path)."""
        return getattr(node, "_marconi_state_time", node.last_access_time)

    def recency(self, pressure: int, node) -> float:
        return node.last_access_time if pressure == _KV else self.state_time(node)

    def put_on_probation(self, node) -> None:
        self.probation[node.id] = node

    def confirm(self, node) -> None:
        """A match reused `node`'s state, or a regular state was committed on it."""
        if self.probation:
            self.probation.pop(node.id, None)

    def probationary_victim(self):
        """The oldest probationary state that is still there and unlocked, or None."""
        tree_core = self.cache.tree_core
        arena, mamba = tree_core._node_arena, self._mamba_type
        for node_id in list(self.probation):
            node = self.probation[node_id]
            data = node.component_data[mamba]
            if arena.get(node_id) is not node or data.value is None:
                del self.probation[node_id]
            elif data.lock_ref == 0:
                del self.probation[node_id]
                return node
        return None

    # -- binding ---------------------------------------------------------------------------
    def _bind(self, tree_core) -> None:
        self.tree_core = tree_core
        self.root = tree_core.root_node
        self._arena = tree_core._node_arena
        self._leaves = tree_core.evictable_device_leaves
        self._has_mamba = self._mamba_type in tree_core.components_by_type
        profile = self.settings.profile
        self._kv_bytes = int(profile.kv_bytes_per_token)
        self._state_bytes = int(profile.ssm_state_bytes) if self._has_mamba else 0
        self.root._marconi_end = 0
        self.rebuild()

    def rebuild(self) -> None:
        """Re-evaluate every node (after a reset, after swapping the profile or the value column)."""
        self._seglen = self.settings.value_kind == "seglen"
        self._clear()
        self._dirty.clear()
        self._struct.clear()
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._known[node.id] = self._skippable(node)
            self._refresh(node)

    def delegating(self, pressure: int) -> bool:
        """Whether an eviction walk under `pressure` runs upstream's code unchanged: SGLang
        features this policy does not model (HiCache, session cache), or alpha tuning chose
        SGLang's LRU. Under KV pressure SGLang's LRU strategy picks the least recently used
        evictable leaf, which is this index's alpha = 0 choice, so the index serves it (upstream
        heapifies every evictable leaf at each walk's start)."""
        tc = self.cache.tree_core
        if tc.enable_hicache or tc.enable_session_radix_cache:
            self._dirty.clear()
            self._struct.clear()
            self.root = None  # rebuild if ever used again
            return True
        if not self.settings.use_upstream_lru:
            return False
        if pressure == _KV and type(tc.eviction_strategy).__name__ == "LRUStrategy":
            return False
        if len(self._dirty) + len(self._struct) > _MAX_PENDING:
            self.flush()  # keep the index current (and the pending sets small) while delegating
        return True

    def alpha(self) -> float:
        """The alpha victims are chosen with: 0 (LRU) while tuning has chosen SGLang's LRU."""
        return 0.0 if self.settings.use_upstream_lru else self.settings.alpha

    # -- the compressed tree ---------------------------------------------------------------
    def _has_state(self, node) -> bool:
        return self._has_mamba and node.component_data[self._mamba_type].value is not None

    def _skippable(self, node) -> bool:
        """A stateless single-child node: the paper's tree would have merged it into its child."""
        return node is not self.root and len(node.children) == 1 and not self._has_state(node)

    def _end(self, node) -> int:
        end = getattr(node, "_marconi_end", None)
        if end is not None:
            return end
        chain = []
        while end is None:
            chain.append(node)
            node = node.parent
            end = getattr(node, "_marconi_end", None)
        for n in reversed(chain):
            end += len(n.key)
            n._marconi_end = end
        return end

    def _anchor_end(self, node) -> int:
        parent, root = node.parent, self.root
        if self._has_mamba:  # skip stateless single-child ancestors (`_skippable`, inlined)
            mamba = self._mamba_type
            while parent is not root and len(parent.children) == 1 and parent.component_data[mamba].value is None:
                parent = parent.parent
        else:
            while parent is not root and len(parent.children) == 1:
                parent = parent.parent
        return self._end(parent)

    def evaluate(self, node) -> tuple[Optional[float], Optional[float]]:
        """`node`'s flop_efficiency (or, with `value_kind` "seglen", its replay length) as a
        candidate of (KV pressure, Mamba pressure), None where it is not a candidate. A live node of
        the bound tree is assumed. (Runs for every dirty node at each eviction step: written flat,
        with locals.)"""
        leaf = node in self._leaves
        if self._has_mamba:
            data = node.component_data[self._mamba_type]
            if data.value is None:  # no state: nothing can hit here, it only frees KV
                return (0.0 if leaf else None), None
            mamba_cand = data.lock_ref == 0 and (leaf or len(node.children) == 1)
            if not (leaf or mamba_cand):
                return None, None
            state_bytes = self._state_bytes
        elif not leaf:
            return None, None
        else:
            mamba_cand, state_bytes = False, 0
        end = self._end(node)
        start = self._anchor_end(node)
        if self._seglen:
            return (float(end - start) if leaf else None), (float(end - start) if mamba_cand else None)
        flops = self._flops.get((start, end))
        if flops is None:  # nodes are re-evaluated far more often than their span changes
            if len(self._flops) >= _FLOPS_MEMO_SIZE:
                self._flops.clear()
            flops = self._flops[start, end] = self.settings.profile.prefill_flops(start, end)
        if leaf:
            leaf_bytes = state_bytes + self._kv_bytes * (end - start)
            eff = flops / leaf_bytes if leaf_bytes > 0 else 0.0
            return eff, (eff if mamba_cand else None)
        return None, flops / state_bytes if state_bytes > 0 else 0.0

    # -- index maintenance -----------------------------------------------------------------
    def _alive(self, node) -> bool:
        return self._arena.get(node.id) is node

    def _refresh(self, node) -> None:
        if node is self.root:
            return
        if not self._alive(node):
            self._set(_KV, node, 0.0, None)
            self._set(_MAMBA, node, 0.0, None)
            self._known.pop(node.id, None)
            return
        effs = self.evaluate(node)
        self._set(_KV, node, node.last_access_time, effs[_KV])
        self._set(_MAMBA, node, self.state_time(node), effs[_MAMBA])

    def _set(self, p: int, node, last_access, eff: Optional[float]) -> None:
        slots, index = self._slots[p], self.indexes[p]
        slot = slots.get(node.id)
        if eff is None:
            if slot is not None:
                del slots[node.id]
                moved = index.remove(slot)
                if moved is not None:
                    slots[moved.id] = slot
        elif slot is None:
            slots[node.id] = index.add(node, last_access, eff)
        else:
            index.update(slot, last_access, eff)

    def flush(self) -> None:
        """Re-evaluate what the hooks marked since the last eviction step."""
        tree_core = self.cache.tree_core
        if tree_core.root_node is not self.root:
            self._bind(tree_core)
            return
        if not (self._dirty or self._struct):
            return
        todo, self._dirty = self._dirty, set()
        struct, self._struct = self._struct, set()
        for node in struct:
            todo.add(node)
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
        # A fixed order keeps slots, hence the order among equal scores, reproducible.
        for node in sorted(todo, key=_node_id) if len(todo) > 1 else todo:
            self._refresh(node)

    def choose(self, pressure: int):
        """The lowest-utility candidate for `pressure` (_KV or _MAMBA), or None if there is none."""
        if self._seglen != (self.settings.value_kind == "seglen") and self.root is not None:
            self.rebuild()  # tuning switched the value column: every entry changes
        self.flush()
        index, slots = self.indexes[pressure], self._slots[pressure]
        repaired = None
        alpha = self.alpha()
        while len(index):
            node = index.lowest(alpha)
            if node is repaired or self._current(pressure, node, slots[node.id]):
                return node
            self.settings.counters.stale_repairs += 1
            self._refresh(node)
            repaired = node
        return None

    def choose_across(self):
        """Under one byte budget: the lowest-utility candidate of either kind, a KV leaf (deleted
        whole: its KV and state) or an SSM state (tombstoned on a single-child node), both scored
        by FLOPs saved per byte freed with recency, normalized over the union. A leaf that holds a
        state is in both indexes (same efficiency) and counts at the older of its two recencies."""
        if self._seglen != (self.settings.value_kind == "seglen") and self.root is not None:
            self.rebuild()
        self.flush()
        kv, mamba = self.indexes
        repaired = None
        alpha = self.alpha()
        while len(kv) or len(mamba):
            union = CandidateIndex(1)
            union._columns = np.concatenate((kv._columns[:, :len(kv)], mamba._columns[:, :len(mamba)]), axis=1)
            union.items = kv.items + mamba.items
            node = union.lowest(alpha)
            pressure = _KV if node.id in self._slots[_KV] else _MAMBA
            if node is repaired or self._current(pressure, node, self._slots[pressure][node.id]):
                return node
            self.settings.counters.stale_repairs += 1
            self._refresh(node)
            repaired = node
        return None

    def _current(self, pressure: int, node, slot: int) -> bool:
        """Safety net on the chosen victim: alive, still a candidate of `pressure`, same recency.
        (Its efficiency is not recomputed here: `check()` verifies every entry in the tests.)"""
        if not self._alive(node) or self.indexes[pressure].last_access[slot] != self.recency(pressure, node):
            return False
        leaf = node in self._leaves
        if pressure == _KV:
            return leaf
        data = node.component_data[self._mamba_type]
        return data.value is not None and data.lock_ref == 0 and (leaf or len(node.children) == 1)

    def check(self) -> None:
        """Flush, then assert both indexes equal a from-scratch evaluation of the whole tree."""
        self.flush()
        if self.root is None:
            return
        expected: tuple[dict, dict] = ({}, {})
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.root:
                continue
            effs = self.evaluate(node)
            for p in (_KV, _MAMBA):
                if effs[p] is not None:
                    expected[p][node.id] = (float(self.recency(p, node)), effs[p])
        for p in (_KV, _MAMBA):
            index = self.indexes[p]
            actual = {n.id: (float(index.last_access[i]), float(index.efficiency[i])) for i, n in enumerate(index.items)}
            assert actual == expected[p], (
                f"{_PRESSURES[p]} index out of date: missing {sorted(expected[p].keys() - actual.keys())}, "
                f"extra {sorted(actual.keys() - expected[p].keys())}, differing "
                f"{sorted(k for k in actual.keys() & expected[p].keys() if actual[k] != expected[p][k])}"
            )
            assert all(self._slots[p][n.id] == i for i, n in enumerate(index.items)), "slot map out of date"

    def report(self, pressure: str, kind: str, node) -> None:
        """Count one decision and show it to the observer (`count` then `notify`)."""
        self.count(kind)
        self.notify(pressure, kind, node)

    def count(self, kind: str) -> None:
        counters = self.settings.counters
        if kind == "leaf":
            counters.evictions_leaf += 1
        elif kind == "single_child":
            counters.evictions_single_child += 1
        else:
            counters.evictions_fallback += 1

    def notify(self, pressure: str, kind: str, node) -> None:
        observer = self.settings.observer
        if observer is not None:
            observer(MarconiVictim(pressure, kind, node, self.alpha()))

    def detach(self) -> None:
        """Stop tracking the tree (after a fault): drop what is pending, record nothing more."""
        self.root = None
        self._dirty = set()
        self._struct = set()


def marconi_index(cache) -> MarconiTreeIndex:
    """The candidate index of a cache built with `marconi_component_overrides`."""
    return cache.marconi_index


@functools.cache
def _component_classes():
    """Build the SGLang subclasses (imports SGLang; once per process)."""
    from sglang.srt.mem_cache.unified_cache.components.base import (
        ComponentType,
        EvictLayer,
        LRURefreshPhase,
        get_and_increase_time_counter,
    )
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    class _MarconiHooks:
        """Hooks shared by both components: record what may have changed for the index.

        Each override runs upstream's hook first, unguarded, then Marconi's bookkeeping under
        the fault guard (`_marconi_fault`), skipped once the settings are faulted."""

        marconi_settings: Optional[MarconiEvictionSettings] = None

        def __init__(self, cache, params):
            super().__init__(cache, params)
            settings = type(self).marconi_settings
            if not isinstance(settings, MarconiEvictionSettings):
                raise TypeError(f"{type(self).__name__}: build it with marconi_component_overrides(settings)")
            index = getattr(cache, "marconi_index", None)
            if index is None:
                index = MarconiTreeIndex(cache, settings, ComponentType.MAMBA)
                cache.marconi_index = index
            elif index.settings is not settings:
                raise ValueError("the FULL and MAMBA Marconi components of one cache need the same settings")
            self.marconi = index
            self._marconi_settings = settings
            self._marconi_delegate = False

        def _marconi_fault(self, where: str, exc: BaseException) -> None:
            """Marconi's code raised on the scheduler thread: one warning, upstream from now on."""
            self._marconi_settings.fault(f"{type(self).__name__}.{where}", exc)
            try:
                self.marconi.detach()
            except Exception:  # pragma: no cover - nothing left to fall back from
                pass

        def redistribute_on_node_split(self, new_parent, child):
            super().redistribute_on_node_split(new_parent=new_parent, child=child)
            if self._marconi_settings.faulted is None:
                try:
                    self.marconi.changed(new_parent)
                    self.marconi.changed(child)
                except Exception as exc:
                    self._marconi_fault("redistribute_on_node_split", exc)

        def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
            super().commit_insert_component_data(
                node=node, is_new_leaf=is_new_leaf, params=params, result=result, cache_actions=cache_actions
            )
            if self._marconi_settings.faulted is None:
                try:
                    self.marconi.changed(node)
                    if is_new_leaf and node.parent is not None:
                        self.marconi.changed(node.parent)
                except Exception as exc:
                    self._marconi_fault("commit_insert_component_data", exc)

        def update_component_on_insert_overlap(
            self, node, prefix_len, total_prefix_len, value_slice, params, result, cache_actions
        ):
            consumed = super().update_component_on_insert_overlap(
                node=node, prefix_len=prefix_len, total_prefix_len=total_prefix_len, value_slice=value_slice,
                params=params, result=result, cache_actions=cache_actions,
            )
            if self._marconi_settings.faulted is None:
                try:
                    self.marconi.stamp(node)
                except Exception as exc:
                    self._marconi_fault("update_component_on_insert_overlap", exc)
            return consumed

        def acquire_component_lock(self, node, result, lock_host=False):
            result = super().acquire_component_lock(node=node, result=result, lock_host=lock_host)
            if self._marconi_settings.faulted is None:
                try:
                    self.marconi.touched(node)
                except Exception as exc:
                    self._marconi_fault("acquire_component_lock", exc)
            return result

        def release_component_lock(self, node, params, lock_host=False):
            super().release_component_lock(node=node, params=params, lock_host=lock_host)
            if self._marconi_settings.faulted is None:
                try:
                    self.marconi.touched(node)
                except Exception as exc:
                    self._marconi_fault("release_component_lock", exc)

        def evict_component(self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE):
            freed = super().evict_component(
                node, device_frees=device_frees, host_frees=host_frees, cache_actions=cache_actions, target=target
            )
            if self._marconi_settings.faulted is None:
                try:
                    self.marconi.changed(node)
                    if node.parent is not None:
                        self.marconi.touched(node.parent)
                except Exception as exc:
                    self._marconi_fault("evict_component", exc)
            return freed

        def discard_deleted_session_leaf(self, node):
            super().discard_deleted_session_leaf(node)
            if self._marconi_settings.faulted is None:
                try:
                    self.marconi.changed(node)
                    if node.parent is not None:
                        self.marconi.changed(node.parent)
                except Exception as exc:
                    self._marconi_fault("discard_deleted_session_leaf", exc)

        # An eviction walk runs upstream's code unchanged when Marconi delegates (HiCache,
        # session cache, alpha tuning chose SGLang's LRU, or a fault); otherwise the subclass
        # picks victims.
        def _evict_device_start(self, request_cnt: int) -> None:
            delegate = True
            if self._marconi_settings.faulted is None:
                pressure = _MAMBA if self.component_type == ComponentType.MAMBA else _KV
                try:
                    delegate = self.marconi.delegating(pressure)
                except Exception as exc:
                    self._marconi_fault("_evict_device_start", exc)
            self._marconi_delegate = delegate
            if delegate:
                return super()._evict_device_start(request_cnt)
            self._evict_device_request_cnt = request_cnt

        def _evict_device_end(self) -> None:
            if self._marconi_delegate:
                super()._evict_device_end()
            self._marconi_delegate = False

        def _marconi_upstream_step(self, where, exc, tracker, device_frees, host_frees, cache_actions):
            """The victim choice faulted mid-walk: continue this walk as upstream's."""
            self._marconi_fault(where, exc)
            super()._evict_device_start(self._evict_device_request_cnt)
            self._marconi_delegate = True
            return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)

    class MarconiFullComponent(_MarconiHooks, FullComponent):
        """SGLang's FULL component, evicting leaves by Marconi's utility under KV pressure."""

        def finalize_match_result_in_tree_core(self, result, params, value_chunks, best_value_len):
            result = super().finalize_match_result_in_tree_core(
                result=result, params=params, value_chunks=value_chunks, best_value_len=best_value_len
            )
            if self._marconi_settings.faulted is None:
                # SGLang has just stamped best_match_node and all its ancestors; only the node itself
                # can be in the KV index (its ancestors have a child, so none is a leaf).
                try:
                    self.marconi.stamp(result.best_match_node)
                except Exception as exc:
                    self._marconi_fault("finalize_match_result_in_tree_core", exc)
            return result

        def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
            if self._marconi_delegate:
                return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
            if tracker[self.component_type] >= self._evict_device_request_cnt:
                return None
            try:
                node = self.marconi.choose_across() if self.marconi.byte_budget else self.marconi.choose(_KV)
                leaf = node is not None and node in self.tree_core.evictable_device_leaves
                if node is not None:
                    self.marconi.count("leaf" if leaf else "single_child")
            except Exception as exc:
                return self._marconi_upstream_step("victim choice", exc, tracker, device_frees, host_frees,
                                                   cache_actions)
            if node is None:
                return None
            pressure = BYTE_PRESSURE if self.marconi.byte_budget else KV_PRESSURE
            if not leaf:  # one byte budget: an SSM state is the cheapest bytes; tombstone it
                self.marconi.notify(pressure, "single_child", node)
                mamba = self.tree_core.components_by_type[ComponentType.MAMBA]
                return mamba._marconi_evict(node, False, tracker, device_frees, host_frees, cache_actions)
            self.marconi.notify(pressure, "leaf", node)
            return node.id  # SGLang deletes the leaf, its Mamba state included

    class MarconiMambaComponent(_MarconiHooks, MambaComponent):
        """SGLang's MAMBA component, evicting states by Marconi's utility under Mamba-slot pressure."""

        def refresh_lru(self, phase, node, root_node):
            super().refresh_lru(phase, node, root_node)
            if self._marconi_settings.faulted is not None:
                return
            try:
                if phase is LRURefreshPhase.WALKDOWN:
                    self.marconi.stamp(node)  # _touch_node stamped it just before
                elif phase is LRURefreshPhase.MATCH_END and node.component_data[self.component_type].value is not None:
                    # The state a match reuses, the only one refreshed (called before SGLang stamps the path).
                    self.marconi.state_used(node, get_and_increase_time_counter())
                    self.marconi.confirm(node)
            except Exception as exc:
                self._marconi_fault("refresh_lru", exc)

        def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
            super().commit_insert_component_data(
                node=node, is_new_leaf=is_new_leaf, params=params, result=result, cache_actions=cache_actions
            )
            if self._marconi_settings.faulted is None:
                try:
                    self.marconi.state_used(node, get_and_increase_time_counter())
                    if getattr(params, "marconi_probationary", False):
                        if not result.mamba_exist:  # a new state, not a reuse of one already there
                            self.marconi.put_on_probation(node)
                            params.marconi_probation_node = node  # the admission tells the request
                    else:
                        self.marconi.confirm(node)
                except Exception as exc:
                    self._marconi_fault("commit_insert_component_data", exc)

        def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
            ct = self.component_type
            if tracker[ct] >= self._evict_device_request_cnt:
                return None
            probationary = None
            if self._marconi_settings.faulted is None and (self.marconi.probation or self.marconi.probation_only):
                try:
                    probationary = self.marconi.probationary_victim()
                except Exception as exc:
                    self._marconi_fault("probationary victim", exc)
                if probationary is None and self.marconi.probation_only:
                    return None
            if probationary is not None:
                self._marconi_settings.counters.evictions_probationary += 1
                leaf = probationary in self.tree_core.evictable_device_leaves
                self.marconi.notify(MAMBA_PRESSURE, "probationary", probationary)
                return self._marconi_evict(probationary, leaf, tracker, device_frees, host_frees, cache_actions)
            if self._marconi_delegate:
                return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
            tree_core = self.tree_core
            try:
                node = self.marconi.choose(_MAMBA)
                leaf = node is not None and node in tree_core.evictable_device_leaves
                kind = "leaf" if leaf else "single_child"
                if node is None:
                    # No unlocked state on a node with <= 1 child: upstream's least recently used
                    # unlocked state (on a node with several children, or on a KV-locked leaf).
                    node = tree_core.lru_lists[ct].get_lru_no_lock()
                    if node is None:
                        return None
                    kind = "fallback"
                    leaf = node in tree_core.evictable_device_leaves
                self.marconi.count(kind)
            except Exception as exc:
                return self._marconi_upstream_step("victim choice", exc, tracker, device_frees, host_frees,
                                                   cache_actions)
            self.marconi.notify(MAMBA_PRESSURE, kind, node)
            return self._marconi_evict(node, leaf, tracker, device_frees, host_frees, cache_actions)

        def _marconi_evict(self, node, leaf, tracker, device_frees, host_frees, cache_actions):
            tree_core = self.tree_core
            if leaf:
                return node.id  # SGLang deletes the leaf whole
            # One mutation: tombstone the state, keep the node and its KV (upstream's code, unguarded).
            tree_core._evict_component_and_detach_lru(
                node, self, target=EvictLayer.DEVICE, tracker=tracker,
                device_frees=device_frees, host_frees=host_frees, cache_actions=cache_actions,
            )
            tree_core._cascade_evict(
                node, self, tracker, device_frees=device_frees, host_frees=host_frees, cache_actions=cache_actions
            )
            return None

    for cls in (MarconiFullComponent, MarconiMambaComponent):
        cls.__qualname__ = cls.__name__
    return MarconiFullComponent, MarconiMambaComponent, ComponentType


def marconi_component_overrides(
    settings: MarconiEvictionSettings, *, mamba_mixins: Sequence[type] = ()
) -> dict:
    """`CacheInitParams.component_registry_override` for Marconi eviction: {FULL: ..., MAMBA: ...}.

    `mamba_mixins` are placed before the Marconi MAMBA component in its bases (e.g. an
    admission mixin); they must call `super()` cooperatively."""
    if not isinstance(settings, MarconiEvictionSettings):
        raise TypeError(f"expected MarconiEvictionSettings, got {type(settings).__name__}")
    full, mamba, component_type = _component_classes()
    attrs = {"marconi_settings": settings, "__module__": __name__}
    return {
        component_type.FULL: type("MarconiFullComponent", (full,), dict(attrs)),
        component_type.MAMBA: type("MarconiMambaComponent", (*mamba_mixins, mamba), dict(attrs)),
    }


def __getattr__(name: str):
    # `from ... import MarconiFullComponent` builds the classes (and imports SGLang) on demand.
    if name in ("MarconiFullComponent", "MarconiMambaComponent"):
        full, mamba, _ = _component_classes()
        return full if name == "MarconiFullComponent" else mamba
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
