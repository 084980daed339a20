"""HiCache's host tier under Marconi's policy, on SGLang's own HiCache tree.

With `--enable-hierarchical-cache --hicache-write-policy write_back`, SGLang's eviction walk hands
each device victim to the cache, which backs it up to host memory and demotes it (upstream's rule:
`tier_rules.UpstreamWriteBack`), and the host pools make room in LRU order. Under the `marconi`
backend the same walk takes Marconi's device victims (`components.py`: recency + alpha x FLOPs
saved per byte, among nodes with <= 1 child), and this module decides, with the policy core's
rule (`tier_rules.MarconiTiering`, the one the simulator's `TieredPrefixCache` runs):

- a device leaf: `MarconiTiering.demotion` on the node's facts (`EvictionFacts`). A leaf with a
  state (or with host-resident nodes below it) is demoted with its state; the host admits what is
  not forced only if the host candidates it would displace rank below it
  (`ranked_below_across`, recency + alpha x FLOPs saved per host byte), else it is
  dropped (both tiers); a leaf without a state is dropped (both tiers: no hit can use it). A
  demoted leaf whose KV already has a host copy gets its device-only state backed up first
  (upstream's `_demote` would free it with no copy);
- a state evicted alone (Mamba pressure on a node with one child): demoted (SGLang's internal
  state backup) if the host admits it by rank, else tombstoned;
- host pressure (`evict_host`): SGLang's host duplicates of device KV first (free: the device
  holds them), then the host's own candidates by rank (`host_candidate_bytes`: host-only leaves
  whole, host-only states of nodes with <= 1 child alone), lowest utility first.

Under `MarconiTiering(depth=...)` (the continuation signal) the host ranks by `DepthOrder` instead,
each candidate's value its depth in the stream's record of finished sequences
(`settings.continuation`, the record a device `depth:` choice reads: one record, fed once per
finished request by Marconi's admission, created here if none exists yet), looked up by the node's
end and last token (`tree_index.node_end_token`), as the simulator's `TieredPrefixCache` does.

A hit on a demoted prefix is SGLang's own load back (`init_load_back`), unchanged: the bytes that
come back are the bytes that went out. Counters: `EvictionCounters.states_demoted`,
`states_dropped`, `kv_tokens_demoted`, `states_loaded_back`, `kv_tokens_loaded_back`,
`host_evictions`, `device_hit_tokens`, `host_hit_tokens` (gauges `marconi_host_*`).

The host candidates (`HostCandidates`), kept incrementally. Two `HostCandidateIndex`es, one
per host pool (candidates freeing KV tokens; candidates freeing SSM states), each entry: recency
(`last_access_time`), value = prefill FLOPs from the node's compressed-tree anchor to its end
(`policy/rules/value.py`'s `anchor_end`: the nearest ancestor that is the root, holds a state on
either tier or has several children) per host byte freed (`value.flops_saved_per_byte`), 0
without a host state; host bytes and pool
units freed. Ties go to the smaller SGLang node id (`tie_key`). `candidate_entry` is the
definition, node by node; `HostCandidates.check` compares every entry with it over the whole
tree (tests).

Upkeep. `attach_host_tier` wraps, on this cache's tree core and its components (instance
attributes, SGLang's classes untouched), the SGLang methods through which a node's host facts
change: its tiers (`commit_backup`, `commit_hicache_transfer`, `evict_component`,
`set_component_device_value`, `commit_insert_component_data`), its children
(`redistribute_on_node_split`, `_update_evictable_leaf_sets`, `_remove_leaf_from_parent`), its
locks and pins (`inc/dec_lock_ref`, `inc/dec_host_lock_ref`, `inc/dec_full_pin`, load-back pins
`commit_load_back` / `finish_load_back`), its recency (`_touch_node`, `match_prefix`, which
stamps the matched path). Each wrapper runs SGLang's method first, unchanged, then records the
node (or, for a lock, a load back or a match, the node and its path to the root, which SGLang
itself just walked) in a dirty set: O(1) per call, nothing evaluated. `flush` re-evaluates what
is dirty, plus, where a node became or stopped being an anchor, the first node below it on each
child's chain (what a change can do to a value: move its anchor); dirty paths are walked once
per flush (a seen set), so a path costs what SGLang's own walk of it cost.

Cost of one step. A device eviction with a full host (`host_admits`) and a host eviction
(`evict_host`, per victim) each: one flush of what changed since the last decision (the previous
victim: O(1) nodes, and what the requests in between did, already paid for by their own O(depth)
walks), then the vectorized argmin over one pool's index (`CandidateIndex.lowest`) or one
vectorized comparison over both (`ranked_below_across`), plus a re-check of the chosen victim's
entry (O(its chain)). So O(1) amortized tree work + the vectorized scan, as the device's SSM index
(`tree_index.py`); no step walks the tree. The first decision binds (one walk, O(n)); hooks record
nothing while unbound; a dirty set grown past twice the tree drops the index (rebuilt at the next
decision: O(n) paid for by the >= 2n hook calls that grew it). What is not bounded here: the
duplicates a ranked admission counts as room (SGLang's `full_host_duplicates`, read only when free
room and the candidates below do not suffice, until they do), the same dict upstream's own host
eviction walks.

Faults (`faults.py`). The candidates are derived state, a function of the tree: a fault in their
upkeep or in a decision that reads them (nothing in the tree changed yet) is recovered, the
index dropped, rebuilt from the tree and the decision made again, so this rank decides what its
peers decide; a second fault in that decision is unrecoverable. A fault while Marconi's code
changes the tree (a drop, a state backup, a host victim's eviction, mid-way through a
multi-victim `evict_host`) is unrecoverable: a rank of a TP / PP group raises
`MarconiGroupFault`; a rank alone falls back to SGLang's own write_back from here on (the rest of
that host eviction is upstream's). SGLang's own calls (`upstream`, the demotion) stay unguarded.

Works on SGLang's tree objects by duck typing; the few SGLang names used are imported lazily.
"""

from __future__ import annotations

import functools
import operator
from typing import Optional

from sglang_marconi.policy.rules import value as value_rule
from sglang_marconi.policy.rules.continuation import ContinuationRecord
from sglang_marconi.policy.rules.tier_rules import Demotion, EvictionFacts, MarconiTiering, host_candidate_bytes
from sglang_marconi.policy.tree.candidate_index import keep
from sglang_marconi.policy.tree.host_candidates import HostCandidateIndex, ranked_below_across
from sglang_marconi.serving.faults import MarconiGroupFault
from sglang_marconi.serving.tree_index import node_end, node_end_token

KV_POOL, STATE_POOL = 0, 1  # host candidate indexes: what a candidate frees
_MAX_PENDING = 1 << 12
_FLOPS_MEMO_SIZE = 1 << 16
_GONE = object()  # a decision Marconi gave up on (unrecoverable): upstream's way
_node_id = operator.attrgetter("id")


def served_tiers(cache) -> bool:
    """Whether Marconi decides this cache's tiers: HiCache attached, write_back, host pools in the
    tree (not buffer_only), Marconi's components in force."""
    state = getattr(cache, "marconi", None)
    return bool(
        state is not None and getattr(cache, "cache_controller", None) is not None
        and getattr(cache, "is_write_back", False) and getattr(cache, "host_memory_mode", None) != "buffer_only"
        and state.faults.fallen_back is None
    )


def attach_host_tier(cache, profile, rules: Optional[MarconiTiering] = None):
    """Give a Marconi cache with HiCache write_back its host-tier decisions (after `init_hicache`)."""
    tier = ServedHostTier(cache, profile, rules)
    settings = cache.marconi.settings
    if tier.rules.ranks_by_depth and settings.continuation is None:
        settings.continuation = ContinuationRecord()  # fed by Marconi's admission from here on
    cache.marconi.host_tier = tier
    tier.candidates.install_hooks()
    return tier


@functools.cache
def _types():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType, EvictLayer

    return ComponentType.FULL, ComponentType.MAMBA, EvictLayer


class _Facts:
    """One SGLang node's tiers, read once."""

    __slots__ = ("node", "kv_dev", "kv_host", "st_dev", "st_host", "locked", "tokens")

    def __init__(self, node, full, mamba):
        kv, st = node.component_data[full], node.component_data[mamba]
        self.node = node
        self.kv_dev, self.kv_host = kv.value is not None, kv.host_value is not None
        self.st_dev, self.st_host = st.value is not None, st.host_value is not None
        self.locked = bool(
            kv.lock_ref or kv.host_lock_ref or st.lock_ref or st.host_lock_ref
            or getattr(node, "load_back_pending_id", None) is not None
            or getattr(node, "write_through_pending_id", None) is not None
        )
        self.tokens = len(node.key)


# SGLang methods after which a node's host facts may have changed: (owner, name, argument that
# names the node, its position, whether the node's path to the root changed too).
_TREE_CORE_HOOKS = (
    ("_update_evictable_leaf_sets", "node", 0, False),
    ("_update_duplicate_tracking", "node", 0, False),
    ("_touch_node", "node", 0, False),
    ("_remove_leaf_from_parent", "node", 0, False),
    ("commit_backup", "node_id", 0, False),
    ("set_component_device_value", "node_id", 0, False),
    ("inc_lock_ref", "node_id", 0, True),
    ("dec_lock_ref", "node_id", 0, True),
    ("inc_host_lock_ref", "node_id", 0, True),
    ("dec_host_lock_ref", "node_id", 0, True),
    ("inc_full_pin", "node_id", 0, True),
    ("dec_full_pin", "node_id", 0, True),
    ("commit_load_back", "node_id", 0, True),
    ("finish_load_back", "anchor_node_id", 0, True),
)
_COMPONENT_HOOKS = (
    ("evict_component", "node", 0, False),
    ("commit_hicache_transfer", "node", 0, False),
    ("commit_insert_component_data", "node", 0, False),
    ("redistribute_on_node_split", "new_parent", 0, False),
    ("redistribute_on_node_split", "child", 1, False),
)


class HostCandidates:
    """The host tier's candidates of one SGLang tree, kept by hooks; see the module docstring."""

    def __init__(self, tier: "ServedHostTier"):
        self.tier = tier
        self.root = None
        self.rebuilds = 0
        self.evaluated = 0  # nodes evaluated (the cost measure tests hold bounded)
        self.stale_repairs = 0
        self._hooked = None
        self._clear()

    def _clear(self) -> None:
        self.indexes = (HostCandidateIndex(tie_key=_node_id), HostCandidateIndex(tie_key=_node_id))
        self._slots: tuple[dict, dict] = ({}, {})
        self._anchors: dict[int, bool] = {}  # node id -> anchors the chains below it, as last evaluated
        self._dirty: dict = {}
        self._paths: dict = {}

    # -- hooks: record only (they run mid-mutation); nothing while unbound ------------------------
    def changed(self, node) -> None:
        if self.root is None or node is None:
            return
        self._dirty[node.id] = node
        parent = node.parent
        if parent is not None:
            self._dirty[parent.id] = parent
        self._bound_pending()

    def path_changed(self, node) -> None:
        if self.root is None or node is None:
            return
        self._paths[node.id] = node
        self._bound_pending()

    def _bound_pending(self) -> None:
        n = len(self._dirty) + len(self._paths)
        if n > _MAX_PENDING and n > 2 * len(self.tier.cache.tree_core._node_arena):
            self.invalidate()  # rebuilt at the next decision: one walk, paid for by these calls

    def _record(self, node_or_id, path: bool) -> None:
        try:
            node = node_or_id
            if not hasattr(node, "children"):
                node = self.tier.cache.tree_core._node_arena.get(node_or_id)
            (self.path_changed if path else self.changed)(node)
        except Exception as exc:  # derived state: dropped, rebuilt from the tree at the next decision
            self.invalidate()
            self.tier.cache.marconi.faults.recovered("host candidates upkeep", exc)

    def install_hooks(self) -> None:
        """Wrap this cache's tree core and components (once per tree core)."""
        tree_core = self.tier.cache.tree_core
        if self._hooked is tree_core:
            return
        self._hooked = tree_core
        by_name: dict = {}
        for name, arg, pos, path in _TREE_CORE_HOOKS:
            by_name.setdefault((id(tree_core), name), (tree_core, name, []))[2].append((arg, pos, path))
        for component in tree_core.components:
            for name, arg, pos, path in _COMPONENT_HOOKS:
                by_name.setdefault((id(component), name), (component, name, []))[2].append((arg, pos, path))
        for owner, name, args in by_name.values():
            setattr(owner, name, self._wrapped(getattr(owner, name), args, name == "_remove_leaf_from_parent"))
        match = tree_core.match_prefix

        def match_prefix(*a, **kw):
            result = match(*a, **kw)
            self._record(result.best_match_node, True)  # SGLang stamped the matched path
            return result

        tree_core.match_prefix = match_prefix

    def _wrapped(self, method, args, parent_first: bool):
        record = self._record

        def hooked(*a, **kw):
            nodes = [a[pos] if len(a) > pos else kw.get(arg) for arg, pos, _ in args]
            parent = getattr(nodes[0], "parent", None) if parent_first else None
            result = method(*a, **kw)  # SGLang's own, unguarded
            for node, (_, _, path) in zip(nodes, args):
                record(node, path)
            if parent is not None:
                record(parent, False)
            return result

        hooked.__wrapped__ = method
        return hooked

    # -- binding ----------------------------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self.root is not None

    def invalidate(self) -> None:
        """Forget everything (a fault, a reset): the next decision rebuilds from the tree."""
        self.root = None
        self._clear()

    def bind(self) -> None:
        """Evaluate the whole tree (once, or after `invalidate` or a new root)."""
        self._clear()
        self.rebuilds += 1
        self.root = self.tier.cache.tree_core.root_node
        stack = list(self.root.children.values())
        order = []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            order.append(node)
        order.sort(key=_node_id)
        for node in order:
            self._refresh(node)

    # -- upkeep -----------------------------------------------------------------------------------
    def pending(self) -> int:
        return len(self._dirty) + len(self._paths)

    def flush(self) -> None:
        """Bind if needed; re-evaluate what the hooks recorded since the last flush."""
        if self.root is None or self.tier.cache.tree_core.root_node is not self.root:
            self.bind()
            return
        if not (self._dirty or self._paths):
            return
        todo, self._dirty = self._dirty, {}
        paths, self._paths = self._paths, {}
        root, walked = self.root, set()
        for node in paths.values():
            while node is not None and node is not root and node.id not in walked:
                walked.add(node.id)
                todo[node.id] = node
                node = node.parent
        alive = self._alive
        for node in list(todo.values()):
            if node is root or not alive(node):
                continue
            anchors = self.tier.anchors_below(node)
            if self._anchors.get(node.id, False) != anchors:
                # the nodes below whose compressed edge starts here (or no longer does): their
                # anchor moved; the stateless single-child nodes skipped are never candidates
                for child in node.children.values():
                    while not self.tier.anchors_below(child):
                        child = next(iter(child.children.values()))
                    todo[child.id] = child
        for node in sorted(todo.values(), key=_node_id):
            self._refresh(node)

    def _alive(self, node) -> bool:
        return self.tier.cache.tree_core._node_arena.get(node.id) is node

    def _refresh(self, node) -> None:
        if node is self.root:
            return
        self.evaluated += 1
        alive = self._alive(node)
        if alive:
            self._anchors[node.id] = self.tier.anchors_below(node)
        else:
            self._anchors.pop(node.id, None)
        entry = self.tier.candidate_entry(node) if alive else None
        if entry is None:
            self._set(KV_POOL, node, None)
            self._set(STATE_POOL, node, None)
            return
        t, value, freed, kv_tokens, states = entry
        self._set(KV_POOL, node, (t, value, freed, kv_tokens) if kv_tokens else None)
        self._set(STATE_POOL, node, (t, value, freed, states) if states else None)

    def _set(self, pool: int, node, row) -> None:
        keep(self.indexes[pool], self._slots[pool], node, row)

    def _row(self, pool: int, node):
        slot = self._slots[pool].get(node.id)
        if slot is None:
            return None
        index = self.indexes[pool]
        return (float(index.last_access[slot]), float(index.efficiency[slot]), index.freed_bytes(slot),
                index.units(slot))

    # -- decisions --------------------------------------------------------------------------------
    def lowest(self, pool: int, order):
        """The first candidate to evict freeing `pool` under `order` (an alpha: lowest utility,
        normalized over that pool's candidates; a `DepthOrder`: lowest keep score), or None. The
        chosen entry is re-checked against the tree (a safety net: `check` verifies every entry in
        the tests)."""
        self.flush()
        index = self.indexes[pool]
        repaired = None
        while len(index):
            node = index.lowest(order)
            if node is repaired or self._current(pool, node):
                return node
            self.stale_repairs += 1
            self._refresh(node)
            repaired = node
        return None

    def _current(self, pool: int, node) -> bool:
        if not self._alive(node):
            return False
        entry = self.tier.candidate_entry(node)
        if entry is None:
            return False
        t, value, freed, kv_tokens, states = entry
        units = kv_tokens if pool == KV_POOL else states
        return bool(units) and self._row(pool, node) == (float(t), float(value), float(freed), float(units))

    def room_below(self, order, last_access: float, value: float, protect) -> tuple[int, int]:
        """(KV tokens, SSM states) the candidates ranking strictly below an incoming node would
        free; `protect` (the incoming node) is left out, of the ranking too."""
        self.flush()
        rows = [self._row(pool, protect) for pool in (KV_POOL, STATE_POOL)]
        for pool, row in enumerate(rows):
            if row is not None:
                self._set(pool, protect, None)
        try:
            masks = ranked_below_across(self.indexes, order, last_access, value)
            return self.indexes[KV_POOL].units_where(masks[0]), self.indexes[STATE_POOL].units_where(masks[1])
        finally:
            for pool, row in enumerate(rows):
                if row is not None:
                    self._set(pool, protect, row)

    # -- checking ---------------------------------------------------------------------------------
    def entries(self) -> tuple[dict, dict]:
        """Per pool: node id -> (recency, value, bytes, units) as the index holds them."""
        out: tuple[dict, dict] = ({}, {})
        for pool in (KV_POOL, STATE_POOL):
            for node in self.indexes[pool].items:
                out[pool][node.id] = self._row(pool, node)
        return out

    def check(self) -> None:
        """Flush, then assert both indexes equal `brute_force_entries` (the whole tree, from scratch)."""
        self.flush()
        expected, actual = self.tier.brute_force_entries(), self.entries()
        for pool, name in ((KV_POOL, "kv"), (STATE_POOL, "state")):
            exp, act = expected[pool], actual[pool]
            assert act == exp, (
                f"host {name} candidates out of date: missing {sorted(exp.keys() - act.keys())}, extra "
                f"{sorted(act.keys() - exp.keys())}, differing "
                f"{[(k, act[k], exp[k]) for k in sorted(act.keys() & exp.keys()) if act[k] != exp[k]]}")
            index = self.indexes[pool]
            assert all(self._slots[pool][n.id] == i for i, n in enumerate(index.items)), "slot map out of date"


class ServedHostTier:
    """Marconi's tier decisions for one SGLang HiCache tree (attached as `cache.marconi.host_tier`)."""

    def __init__(self, cache, profile, rules: Optional[MarconiTiering] = None):
        self.cache = cache
        self.profile = profile
        self.rules = rules or MarconiTiering()
        self.kv_bytes_per_token = int(profile.kv_bytes_per_token)
        self.state_bytes = int(profile.ssm_state_bytes)
        self.candidates = HostCandidates(self)
        self._flops: dict[tuple[int, int], float] = {}

    @property
    def counters(self):
        return self.cache.marconi.settings.counters

    @property
    def faults(self):
        return self.cache.marconi.faults

    @property
    def record(self) -> Optional[ContinuationRecord]:
        """The stream's record of finished sequences (None until a depth rule asked for one)."""
        return self.cache.marconi.settings.continuation

    @property
    def order(self):
        """The host's order now (`MarconiTiering.host_order`): an alpha or a `DepthOrder`."""
        return self.rules.host_order(None, self.record)

    # -- values ----------------------------------------------------------------------------------
    def _has_state(self, node) -> bool:
        data = node.component_data[_types()[1]]
        return data.value is not None or data.host_value is not None

    def anchors_below(self, node) -> bool:
        """Whether the compressed edges of the nodes below start at `node`'s end: the root, a
        node holding a state on either tier (a hit can resume there), or not a single child."""
        return node.parent is None or len(node.children) != 1 or self._has_state(node)

    def value(self, node, has_state: bool, freed_bytes: int) -> float:
        """FLOPs a hit at `node` saves over its compressed-tree anchor per byte (`freed_bytes`); 0
        without a state."""
        if not has_state or not freed_bytes:
            return 0.0
        start = value_rule.anchor_end(node, self.cache.tree_core.root_node, self._has_state, node_end)
        end = node_end(node)
        flops = self._flops.get((start, end))
        if flops is None:
            if len(self._flops) >= _FLOPS_MEMO_SIZE:
                self._flops.clear()
            flops = self._flops[start, end] = self.profile.prefill_flops(start, end)
        return value_rule.flops_saved_per_byte(flops, freed_bytes)

    def host_value(self, node, has_state: bool, freed_bytes: int) -> float:
        """The host ranking's value column: the node's depth under a depth order, else `value`."""
        if self.rules.ranks_by_depth:
            return self.rules.depth_of(self.record, *node_end_token(node))
        return self.value(node, has_state, freed_bytes)

    # -- host candidates: the definition -----------------------------------------------------------
    def candidate_entry(self, node):
        """(recency, value, host bytes freed, KV tokens freed, states freed) if `node` is a host
        candidate freeing something, else None. A host-only leaf goes whole (if SGLang's own
        host-leaf set has it), a host-only state of a node with <= 1 child alone."""
        full, mamba, _ = _types()
        f = _Facts(node, full, mamba)
        freed = host_candidate_bytes(
            self.rules, locked=f.locked, is_root=node.parent is None, kv_on_device=f.kv_dev,
            kv_on_host=f.kv_host, state_on_device=f.st_dev, state_on_host=f.st_host,
            n_children=len(node.children), kv_bytes=self.kv_bytes_per_token * f.tokens, state_bytes=self.state_bytes)
        if not freed:
            return None
        whole = not f.kv_dev and not node.children
        if whole and node not in self.cache.tree_core.evictable_host_leaves:
            return None
        kv_tokens = f.tokens if whole and f.kv_host else 0
        states = int(f.st_host)
        if not kv_tokens and not states:
            return None
        return node.last_access_time, self.host_value(node, f.st_host, freed), freed, kv_tokens, states

    def brute_force_entries(self) -> tuple[dict, dict]:
        """`candidate_entry` over the whole tree, per pool (what the incremental index must hold)."""
        out: tuple[dict, dict] = ({}, {})
        stack = list(self.cache.tree_core.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            entry = self.candidate_entry(node)
            if entry is None:
                continue
            t, value, freed, kv_tokens, states = entry
            if kv_tokens:
                out[KV_POOL][node.id] = (float(t), float(value), float(freed), float(kv_tokens))
            if states:
                out[STATE_POOL][node.id] = (float(t), float(value), float(freed), float(states))
        return out

    def brute_force_lowest(self, pool: int, order):
        """The victim `evict_host` must take from `pool`, from scratch (a fresh index over the tree)."""
        index = HostCandidateIndex(tie_key=_node_id)
        arena = self.cache.tree_core._node_arena
        for node_id, (t, value, freed, units) in sorted(self.brute_force_entries()[pool].items()):
            index.add(arena[node_id], t, value, freed, units)
        return index.lowest(order) if len(index) else None

    # -- the fault protocol --------------------------------------------------------------------------
    def _decide(self, where: str, decide):
        """A decision that reads the candidates and changes nothing: a fault is recovered (the
        candidates rebuilt from the tree, the decision made again); a second is unrecoverable
        (`_GONE`: the caller goes upstream's way)."""
        try:
            return decide()
        except MarconiGroupFault:
            raise
        except Exception as exc:
            self.candidates.invalidate()
            if not self.faults.recovered(f"host tier {where}", exc):
                return _GONE  # past the recovery bound a rank alone fell back: upstream's way
        try:
            return decide()
        except MarconiGroupFault:
            raise
        except Exception as exc:
            self._unrecoverable(where, exc)
            return _GONE

    def _change(self, where: str, change):
        """Marconi's code changing the tree: a fault here is unrecoverable (`_GONE`)."""
        try:
            return change()
        except MarconiGroupFault:
            raise
        except Exception as exc:
            self._unrecoverable(where, exc)
            return _GONE

    def _unrecoverable(self, where: str, exc: BaseException) -> None:
        self.candidates.invalidate()
        self.faults.unrecoverable(f"host tier {where}", exc)  # raises on a rank of a group

    # -- admission -------------------------------------------------------------------------------
    def _pool_free(self):
        from sglang.srt.mem_cache.hicache_storage import PoolName

        group = self.cache.host_pool_group
        kv, st = group.get_pool(PoolName.KV), group.get_pool(PoolName.MAMBA)
        return (kv.available_size() if kv is not None else 0), (st.available_size() if st is not None else 0)

    def _duplicate_tokens(self, protect, enough: int) -> int:
        """Reclaimable host duplicates of device KV (not `protect`'s), counted until `enough`."""
        tree_core, total = self.cache.tree_core, 0
        for node in tree_core.full_host_duplicates.values():
            if total >= enough:
                break
            if node is not protect and tree_core._can_reclaim_full_host_duplicate(node):
                total += len(node.key)
        return total

    def host_admits(self, node, kv_needed: int, states_needed: int, footprint: int, has_state: bool) -> bool:
        """The ranked admission: the host's free room, its KV duplicates of device KV and the
        candidates ranking below `node` (recency + alpha x value per byte) cover what it needs."""
        kv_free, st_free = self._pool_free()
        if kv_free >= kv_needed and st_free >= states_needed:
            return True
        kv_below, st_below = self.candidates.room_below(
            self.order, node.last_access_time, self.host_value(node, has_state, footprint), node)
        if st_free + st_below < states_needed:
            return False
        kv_room = kv_free + kv_below
        if kv_room < kv_needed:
            kv_room += self._duplicate_tokens(node, kv_needed - kv_room)
        return kv_room >= kv_needed

    def _make_way(self) -> None:
        """At the start of a step: keep the dirty sets small while no decision reads them."""
        if self.candidates.bound and self.candidates.pending() > _MAX_PENDING:
            self.candidates.flush()

    # -- device evictions ------------------------------------------------------------------------
    def evict_device_leaf(self, node_id, tracker, upstream):
        """The cache's `_evict_device_leaf` under Marconi's rule; `upstream` is SGLang's (demote,
        or hand back the write-back BackupKV)."""
        full, mamba, _ = _types()
        node = self.cache.tree_core.node_by_id(node_id)
        plan = self._decide("device leaf demotion", lambda: self._leaf_plan(node))
        if plan is _GONE:
            return upstream(node_id, tracker)
        f, plan = plan
        c = self.counters
        if not plan.kv:
            dropped = self._change("device leaf drop", lambda: self._drop_leaf(node, f, tracker))
            if dropped is _GONE:
                return None  # mid-way through a drop: nothing more of Marconi's on this node
            if dropped:
                c.states_dropped += int(f.st_dev)
                c.host_drops += 1
                return None
            plan = Demotion(kv=True, state=f.st_dev or f.st_host)  # locked on the host: upstream's way
        if f.kv_host and f.st_dev and not f.st_host and plan.state:
            # KV already on the host: upstream's `_demote` would free the device-only state with no copy.
            backed = self._change("device state backup", lambda: self.cache.backup_node_for_write_back(node_id))
            if backed is _GONE:
                return upstream(node_id, tracker)
            if not backed:
                plan = Demotion(kv=True, state=False)
            f = _Facts(node, full, mamba)
        backup = upstream(node_id, tracker)
        self.candidates.changed(node)
        if f.st_dev and not f.st_host and not (plan.state and backup is not None):
            # demoted in place with its state on the device only: the state is lost
            c.states_dropped += int(backup is None)
        if f.st_dev and (f.st_host or backup is not None):
            c.states_demoted += 1
        if backup is not None:
            c.kv_tokens_demoted += f.tokens
        return backup

    def _leaf_plan(self, node):
        full, mamba, _ = _types()
        self._make_way()
        f = _Facts(node, full, mamba)
        plan = self.rules.demotion(EvictionFacts(
            frees_kv=True, kv_on_host=f.kv_host, state_on_device=f.st_dev, state_on_host=f.st_host,
            host_descendants=bool(node.children), kept_for_client=self._kept_for_client(node)))
        if plan.kv and plan.ranked:
            kv_needed = 0 if f.kv_host else f.tokens
            states_needed = 1 if (plan.state and f.st_dev and not f.st_host) else 0
            footprint = self.kv_bytes_per_token * f.tokens + (self.state_bytes if f.st_dev or f.st_host else 0)
            if not self.host_admits(node, kv_needed, states_needed, footprint, f.st_dev or f.st_host):
                plan = Demotion(kv=f.kv_host, state=f.st_host)  # nothing new gets a host copy
        return f, plan

    def _drop_leaf(self, node, f: _Facts, tracker) -> bool:
        """Free a device leaf on both tiers (it has no children: `host_descendants` forces a keep)."""
        if node.children or f.locked:
            return False
        cache, tree_core = self.cache, self.cache.tree_core
        parent = node.parent
        if not f.kv_host:
            dropped = cache._drop_subtree_no_host(node.id, tracker)
            self.candidates.changed(parent)
            return dropped
        from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import DropSubtreeNoHostResult

        result = DropSubtreeNoHostResult(is_dropped=True)
        tree_core._delete_unbacked_device_leaf(  # releases every layer, the host copies too
            node, result.tracker, device_frees=result.device_frees, host_frees=result.host_frees,
            cache_actions=result.cache_actions)
        tree_core.full_host_duplicates.pop(node.id, None)
        cache._apply_eviction_result(result)
        cache._accumulate_tracker(tracker, result.tracker)
        self.candidates.changed(parent)
        return True

    def state_alone(self, node) -> bool:
        """A state evicted alone from the device (Mamba pressure, a node with one child): True to
        demote it (SGLang's internal state backup), False to tombstone it."""
        admitted = self._decide("state demotion", lambda: self._state_plan(node))
        if admitted is _GONE:  # upstream's rule: backed up iff its KV is on the device with no host copy
            full, mamba, _ = _types()
            f = _Facts(node, full, mamba)
            return f.kv_dev and not f.kv_host and not f.st_host
        if admitted is None:
            return False
        if admitted:
            self.counters.states_demoted += 1
        else:
            self.counters.states_dropped += 1
        return admitted

    def _state_plan(self, node):
        """True / False: the rule's answer; None: not the rule's to answer (nothing to copy)."""
        full, mamba, _ = _types()
        self._make_way()
        f = _Facts(node, full, mamba)
        if f.st_host or not f.kv_dev:
            return None  # a host copy already exists (nothing to copy), or no device KV to back up with
        plan = self.rules.demotion(EvictionFacts(
            frees_kv=False, kv_on_host=f.kv_host, state_on_device=f.st_dev, state_on_host=f.st_host,
            host_descendants=False, kept_for_client=self._kept_for_client(node)))
        if not plan.state:
            return None
        if not plan.ranked:
            return True
        kv_needed = 0 if f.kv_host else f.tokens  # SGLang's internal backup copies the node's KV too
        return self.host_admits(node, kv_needed, 1, self.state_bytes, True)

    def _kept_for_client(self, node) -> bool:
        """A client's `24h` cache-hint credit is in force on `node` (`serving/cache_hints.py`)."""
        hints = getattr(self.cache.marconi, "hints", None)
        return hints is not None and hints.broken is None and hints.ledger.kept_for_day(node)

    # -- load back -------------------------------------------------------------------------------
    def load_back_facts(self, node_id):
        """(KV tokens, states) a load back of `node_id` would bring to the device."""
        full, mamba, _ = _types()
        node = self.cache.tree_core.node_by_id(node_id)
        st = node.component_data[mamba]
        states = int(st.value is None and st.host_value is not None)
        tokens = 0
        while node.parent is not None and node.component_data[full].value is None:
            tokens += len(node.key)
            node = node.parent
        return tokens, states

    def load_back_path(self, node_id) -> list:
        """The nodes a load back of `node_id` can change on the device: `node_id` (its state may come
        back alone) and its ancestors up to and including the first one holding device KV (which
        stops being a device leaf). O(path)."""
        full, _, _ = _types()
        node = self.cache.tree_core.node_by_id(node_id)
        path = [node]
        while node.parent is not None and node.component_data[full].value is None:
            node = node.parent
            path.append(node)
        return path

    def loaded_back(self, tokens: int, states: int) -> None:
        self.counters.kv_tokens_loaded_back += tokens
        self.counters.states_loaded_back += states

    # -- host eviction ---------------------------------------------------------------------------
    @staticmethod
    def ranks(component_type) -> bool:
        """Whether Marconi ranks this host pool (KV and SSM states; any other is upstream's)."""
        full, mamba, _ = _types()
        return component_type in (full, mamba)

    def evict_host(self, num_tokens: int, component_type) -> int:
        """Free `num_tokens` of `component_type`'s host pool: SGLang's KV duplicates first, then
        the host's own candidates freeing that pool, lowest utility first. Returns what was freed."""
        from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import DriveHostEvictionResult

        full, mamba, layer = _types()
        cache, tree_core = self.cache, self.cache.tree_core
        freed = 0
        if component_type == full and tree_core.is_write_back:
            result = DriveHostEvictionResult()
            tree_core._reclaim_full_host_duplicates(num_tokens, result.tracker, result.device_frees,
                                                    result.host_frees, cache_actions=result.cache_actions)
            cache._apply_eviction_result(result)
            freed += result.tracker.get(full, 0)
        pool = KV_POOL if component_type == full else STATE_POOL
        while freed < num_tokens:
            victim = self._decide("host victim choice", lambda: self.candidates.lowest(pool, self.order))
            if victim is _GONE:
                return freed + cache.evict_host(num_tokens - freed, component_type)  # upstream's now
            if victim is None:
                break
            got = self._change("host eviction", lambda: self._evict_host_victim(victim, component_type))
            if got is _GONE:
                return freed + cache.evict_host(num_tokens - freed, component_type)  # upstream's now
            if not got:
                break  # a victim that frees nothing of this pool would be chosen again
            freed += got
        return freed

    def _evict_host_victim(self, victim, component_type) -> int:
        from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import DriveHostEvictionResult

        full, mamba, layer = _types()
        cache, tree_core = self.cache, self.cache.tree_core
        f = _Facts(victim, full, mamba)
        parent = victim.parent
        result = DriveHostEvictionResult()
        if not f.kv_dev and not victim.children:
            tree_core._evict_host_leaf(victim, result.tracker, result.device_frees, result.host_frees,
                                       cache_actions=result.cache_actions)
        else:
            _, host_freed = tree_core._evict_component_and_detach_lru(
                victim, tree_core.components_by_type[mamba], target=layer.HOST, tracker=None,
                device_frees=result.device_frees, host_frees=result.host_frees,
                cache_actions=result.cache_actions)
            result.tracker[mamba] += host_freed
        cache._apply_eviction_result(result)
        self.candidates.changed(victim)
        self.candidates.changed(parent)
        self.counters.host_evictions += 1
        self.counters.states_evicted_host += int(f.st_host)
        return result.tracker.get(component_type, 0)
