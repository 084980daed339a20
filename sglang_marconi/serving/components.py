"""SGLang's FULL and MAMBA tree components with Marconi's eviction (paper §4.2): thin subclasses
that translate SGLang's hooks into the candidate index (`tree_index.py`), the probation registry
(`policy/rules/probation.py`) and the policy core's choice (`CandidateIndex.lowest`, `lowest_across`).

SGLang frees memory under two pressures, each driven by one component's walk
(`_evict_device_start` / `_evict_device_next_node` / `_evict_device_end`, one mutation per step):

| walk | candidates | a victim that is a leaf | a single-child victim |
|---|---|---|---|
| FULL (KV tokens short) | unlocked evictable leaves | deleted whole (KV + state) | - |
| FULL, one byte budget short of Mamba bytes | leaves and states (`lowest_across`) | deleted whole | state tombstoned |
| MAMBA (Mamba slots short) | probationary states first (oldest), then unlocked states on <= 1-child nodes | deleted whole | state tombstoned (KV kept) |

With no Marconi candidate left under Mamba pressure (states only on multi-child nodes or on
KV-locked leaves) the MAMBA step takes upstream's choice, SGLang's least recently used unlocked
state (`evictions_fallback`), so an allocation never fails where upstream's would succeed.
With HiCache write_back (`host_tier.py`) the walks are Marconi's; what a victim leaf becomes
(demoted to the host or dropped) is the cache's `_evict_device_leaf`, and a state taken alone under
Mamba pressure is demoted (`InternalStateBackup`, SGLang's backup before the tombstone) when
Marconi's tier rule admits it to the host.
A walk that may take probationary states only (`EvictionWalk.probation_only`: a probationary
state's own room) frees nothing else under either walk.

Upstream's walks run unchanged when: the tree has a session cache, or HiCache tiers other than
write_back with host values in the tree (the factory builds upstream's cache for these; this is
the safety net), the rule in force is SGLang's LRU
(under KV pressure the index's recency pick stands in for upstream's leaf heap: the same leaf),
or this cache fell back after an unrecoverable fault.

Hooks overridden, each O(1) for us: split, insert overlap / commit, lock acquire / release,
`evict_component` (a state tombstoned or a node deleted: also drops its probation entry),
`discard_deleted_session_leaf`, FULL `finalize_match_result_in_tree_core` and MAMBA
`refresh_lru` (recency). Upstream's hook always runs first, unguarded: SGLang's own errors
propagate as upstream's would. Marconi's part runs under `faults.py`: a fault in the index is
recovered by rebuilding it from the tree; anything else is unrecoverable.

Built lazily (`marconi_component_overrides`) so importing this module needs no SGLang.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

from sglang_marconi.serving.cache_state import MarconiCacheState, request_state
from sglang_marconi.serving.eviction_settings import (
    BYTE_PRESSURE, KV_PRESSURE, MAMBA_PRESSURE, MarconiEvictionSettings, MarconiVictim,
)
from sglang_marconi.serving.tree_index import KV, MAMBA, MarconiTreeIndex, record_state_use

_MAX_PENDING = 1 << 12  # dirty nodes flushed while upstream's walks run (keeps the sets small)
_GONE = object()


def _count(counters, kind: str) -> None:
    if kind == "leaf":
        counters.evictions_leaf += 1
    elif kind == "single_child":
        counters.evictions_single_child += 1
    elif kind == "probationary":
        counters.evictions_probationary += 1
    else:
        counters.evictions_fallback += 1


@functools.cache
def _component_classes():
    """Build the SGLang subclasses (imports SGLang; once per process)."""
    from sglang.srt.mem_cache.unified_cache.components.base import (
        ComponentType,
        EvictLayer,
        InternalStateBackup,
        LRURefreshPhase,
        get_and_increase_time_counter,
    )
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    class _MarconiHooks:
        """Hooks shared by both components."""

        marconi_settings: Optional[MarconiEvictionSettings] = None

        def __init__(self, cache, params):
            super().__init__(cache, params)
            settings = type(self).marconi_settings
            if not isinstance(settings, MarconiEvictionSettings):
                raise TypeError(f"{type(self).__name__}: build it with marconi_component_overrides(settings)")
            state = cache.__dict__.get("marconi")
            if state is None:
                state = cache.marconi = MarconiCacheState(settings)
            elif state.settings is not settings:
                raise ValueError("the FULL and MAMBA Marconi components of one cache need the same settings")
            if state.index is None:
                state.index = MarconiTreeIndex(lambda: cache.tree_core, settings.profile, ComponentType.MAMBA)
                # a change of leaf status is recorded under the same guard as every other hook
                state.index.leaf_listener = lambda node: self._index("evictable_device_leaves",
                                                                     state.index.changed, node)
            self.marconi = state
            self._marconi_upstream_walk = False

        # -- faults --------------------------------------------------------------------------
        def _marconi_active(self) -> bool:
            return self.marconi.faults.fallen_back is None

        def _index_fault(self, where: str, exc: BaseException) -> bool:
            """The index (derived from the tree) failed: rebuilt from the tree at its next use.
            False past the recovery bound (a rank alone fell back: decide nothing with it)."""
            self.marconi.index.invalidate()
            if self.marconi.faults.recovered(f"{type(self).__name__}.{where}", exc):
                return True
            self.marconi.probation.clear()
            return False

        def _unrecoverable(self, where: str, exc: BaseException) -> None:
            """Raises on a rank of a group; a rank alone falls back to upstream from here on."""
            self.marconi.faults.unrecoverable(f"{type(self).__name__}.{where}", exc)
            self.marconi.index.invalidate()
            self.marconi.probation.clear()

        def _primary(self, where: str, record, *args) -> None:
            """Record primary data (a state's use time, the probation registry): not derived from
            the tree, so a fault midway cannot be rebuilt away and is unrecoverable."""
            try:
                record(*args)
            except Exception as exc:
                self._unrecoverable(where, exc)

        def _index(self, where: str, update, node, *more) -> None:
            if self._marconi_active():
                try:
                    update(node, *more)
                except Exception as exc:
                    self._index_fault(where, exc)

        def _pick(self, where: str, pick):
            """`pick(index)`; a fault is recovered by rebuilding the index and picking again; a
            second fault is unrecoverable (`_GONE`: this walk goes on as upstream's)."""
            index = self.marconi.index
            try:
                index.use_rule(self.marconi.settings.value_kind, self.marconi.settings.depth_rule)
                return pick(index)
            except Exception as exc:
                if not self._index_fault(where, exc):
                    return _GONE
            try:
                return pick(index)
            except Exception as exc:
                self._unrecoverable(where, exc)
                return _GONE

        # -- upkeep --------------------------------------------------------------------------
        def _changed(self, node, parent_touched: bool = False, parent_changed: bool = False) -> None:
            index = self.marconi.index
            index.changed(node)
            if node.parent is not None:
                if parent_changed:
                    index.changed(node.parent)
                elif parent_touched:
                    index.touched(node.parent)

        def redistribute_on_node_split(self, new_parent, child):
            super().redistribute_on_node_split(new_parent=new_parent, child=child)
            self._index("redistribute_on_node_split", self._split, new_parent, child)

        def _split(self, new_parent, child) -> None:
            self.marconi.index.changed(new_parent)
            self.marconi.index.changed(child)

        def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
            super().commit_insert_component_data(
                node=node, is_new_leaf=is_new_leaf, params=params, result=result, cache_actions=cache_actions
            )
            self._index("commit_insert_component_data", self._changed, node, False, is_new_leaf)

        def update_component_on_insert_overlap(
            self, node, prefix_len, total_prefix_len, value_slice, params, result, cache_actions
        ):
            consumed = super().update_component_on_insert_overlap(
                node=node, prefix_len=prefix_len, total_prefix_len=total_prefix_len, value_slice=value_slice,
                params=params, result=result, cache_actions=cache_actions,
            )
            self._index("update_component_on_insert_overlap", self.marconi.index.stamp, node)
            return consumed

        def acquire_component_lock(self, node, result, lock_host=False):
            result = super().acquire_component_lock(node=node, result=result, lock_host=lock_host)
            self._index("acquire_component_lock", self.marconi.index.touched, node)
            return result

        def release_component_lock(self, node, params, lock_host=False):
            super().release_component_lock(node=node, params=params, lock_host=lock_host)
            self._index("release_component_lock", self.marconi.index.touched, node)

        def evict_component(self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE):
            freed = super().evict_component(
                node, device_frees=device_frees, host_frees=host_frees, cache_actions=cache_actions, target=target
            )
            self._index("evict_component", self._changed, node, True)
            return freed

        def discard_deleted_session_leaf(self, node):
            super().discard_deleted_session_leaf(node)
            self._index("discard_deleted_session_leaf", self._changed, node, False, True)

        # -- the walk ------------------------------------------------------------------------
        def _tiers_not_modelled(self) -> bool:
            """A session cache, or HiCache tiers Marconi does not decide (another write policy,
            buffer_only host memory: the factory builds upstream's cache for these; this is the
            safety net for a cache built another way). HiCache write_back is Marconi's
            (`host_tier.py`)."""
            if self.tree_core.enable_session_radix_cache:
                return True
            return bool(self.tree_core.enable_hicache and self.marconi.host_tier is None)

        def _walks_upstream(self) -> bool:
            """Whether this walk is upstream's, unchanged (see the module docstring). A predicate."""
            if not self._marconi_active() or self._tiers_not_modelled():
                return True
            if not self.marconi.settings.use_upstream_lru:
                return False
            return not (self.component_type == ComponentType.FULL
                        and type(self.tree_core.eviction_strategy).__name__ == "LRUStrategy")

        def _evict_device_start(self, request_cnt: int) -> None:
            self._marconi_upstream_walk = self._walks_upstream()
            index = self.marconi.index
            if self._tiers_not_modelled():
                index.invalidate()  # not ours to keep: rebuilt from the tree if ever used again
            elif self._marconi_upstream_walk and index.bound and index.pending() > _MAX_PENDING:
                self._index("flush", lambda _: index.flush(), None)  # keep the pending sets small meanwhile
            if self._marconi_upstream_walk:
                return super()._evict_device_start(request_cnt)
            self._evict_device_request_cnt = request_cnt

        def _evict_device_end(self) -> None:
            if self._marconi_upstream_walk:
                super()._evict_device_end()
            self._marconi_upstream_walk = False

        def _upstream_step(self, tracker, device_frees, host_frees, cache_actions):
            """Marconi's choice is gone for good (an unrecoverable fault): this walk goes on as upstream's."""
            super()._evict_device_start(self._evict_device_request_cnt)
            self._marconi_upstream_walk = True
            return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)

        def _report(self, pressure: str, kind: str, node) -> None:
            settings = self.marconi.settings
            _count(settings.counters, kind)
            if settings.observer is not None:
                settings.observer(MarconiVictim(pressure, kind, node, settings.weight))

    class MarconiFullComponent(_MarconiHooks, FullComponent):
        """SGLang's FULL component, evicting leaves by Marconi's utility under KV pressure."""

        def finalize_match_result_in_tree_core(self, result, params, value_chunks, best_value_len):
            result = super().finalize_match_result_in_tree_core(
                result=result, params=params, value_chunks=value_chunks, best_value_len=best_value_len
            )
            # SGLang has just stamped best_match_node and its ancestors; only the node itself can
            # be in the KV index (its ancestors have a child, so none is a leaf).
            self._index("finalize_match_result_in_tree_core", self.marconi.index.stamp, result.best_match_node)
            return result

        def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
            if self._marconi_upstream_walk:
                return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
            if tracker[self.component_type] >= self._evict_device_request_cnt:
                return None
            walk, settings = self.marconi.walk, self.marconi.settings
            if walk.probation_only:
                return None  # a probationary state only takes free room or another's: no KV goes
            weight, counters = settings.weight, settings.counters
            if walk.byte_budget:
                node = self._pick("victim choice (bytes)", lambda index: index.choose_across(weight, counters))
            else:
                node = self._pick("victim choice (kv)", lambda index: index.choose(KV, weight, counters))
            if node is _GONE:
                return self._upstream_step(tracker, device_frees, host_frees, cache_actions)
            if node is None:
                return None
            pressure = BYTE_PRESSURE if walk.byte_budget else KV_PRESSURE
            if node not in self.tree_core.evictable_device_leaves:  # one byte budget: a state is cheapest
                self._report(pressure, "single_child", node)
                mamba = self.tree_core.components_by_type[ComponentType.MAMBA]
                return mamba._tombstone_or_delete(node, False, tracker, device_frees, host_frees, cache_actions)
            self._report(pressure, "leaf", node)
            return node.id  # SGLang deletes the leaf whole, its Mamba state included

    class MarconiMambaComponent(_MarconiHooks, MambaComponent):
        """SGLang's MAMBA component, evicting states by Marconi's utility under Mamba-slot pressure."""

        def refresh_lru(self, phase, node, root_node):
            super().refresh_lru(phase, node, root_node)
            if not self._marconi_active():
                return
            if phase is LRURefreshPhase.WALKDOWN:
                self._index("refresh_lru", self.marconi.index.stamp, node)  # _touch_node stamped it
            elif phase is LRURefreshPhase.MATCH_END and node.component_data[self.component_type].value is not None:
                # The state a match reuses, the only one refreshed (before SGLang stamps the path).
                self._primary("refresh_lru (state use)", self._state_reused, node, get_and_increase_time_counter())
                self._index("refresh_lru", self.marconi.index.state_used, node)

        def _state_reused(self, node, now) -> None:
            record_state_use(node, now)
            self.marconi.probation.confirm(node)

        def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
            super().commit_insert_component_data(
                node=node, is_new_leaf=is_new_leaf, params=params, result=result, cache_actions=cache_actions
            )
            if not self._marconi_active():
                return
            self._primary("commit_insert_component_data (state use, probation)", self._state_committed, node,
                          get_and_increase_time_counter(), params, result)
            self._index("commit_insert_component_data", self.marconi.index.state_used, node)

        def _state_committed(self, node, now, params, result) -> None:
            record_state_use(node, now)
            intent = getattr(params, "marconi", None)  # the inserting request's MarconiRequestState
            if not result.mamba_exist:  # a new state: is it one where an input ended?
                node._marconi_input_end = intent is not None and intent.input_end_insert
            if intent is not None and intent.probationary_insert:
                if not result.mamba_exist:  # a new state, not a reuse of one already there
                    self.marconi.probation.add(node)
                    intent.probation_node = node
            else:
                self.marconi.probation.confirm(node)

        def evict_component(self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE):
            freed = super().evict_component(node, device_frees, host_frees, cache_actions, target=target)
            # its state (or the node) is gone, whoever took it
            self._primary("evict_component (probation)", self.marconi.probation.forget, node)
            return freed

        def _probationary_victim(self):
            arena, ct = self.tree_core._node_arena, self.component_type

            def usable(node):
                data = node.component_data[ct]
                if arena.get(node.id) is not node or data.value is None:
                    return None
                return data.lock_ref == 0

            return self.marconi.probation.oldest(usable)

        def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
            ct = self.component_type
            if tracker[ct] >= self._evict_device_request_cnt:
                return None
            walk, settings = self.marconi.walk, self.marconi.settings
            if self._marconi_active() and (settings.probation or walk.probation_only):
                try:
                    probationary = self._probationary_victim()
                except Exception as exc:  # the registry is primary data: nothing to rebuild it from
                    self._unrecoverable("victim choice (probationary)", exc)
                    if walk.probation_only:
                        return None  # a probationary state's room: nothing else may go for it
                    if self._marconi_upstream_walk:
                        return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
                    return self._upstream_step(tracker, device_frees, host_frees, cache_actions)
                if probationary is not None:
                    self._report(MAMBA_PRESSURE, "probationary", probationary)
                    leaf = probationary in self.tree_core.evictable_device_leaves
                    return self._tombstone_or_delete(probationary, leaf, tracker, device_frees, host_frees,
                                                     cache_actions, may_back_up=True)
                if walk.probation_only:
                    return None
            if self._marconi_upstream_walk:
                return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
            settings_weight, counters = settings.weight, settings.counters
            node = self._pick("victim choice (mamba)", lambda index: index.choose(MAMBA, settings_weight, counters))
            if node is _GONE:
                return self._upstream_step(tracker, device_frees, host_frees, cache_actions)
            tree_core = self.tree_core
            kind = "leaf" if node is not None and node in tree_core.evictable_device_leaves else "single_child"
            if node is None:
                # No unlocked state on a node with <= 1 child: upstream's least recently used
                # unlocked state (on a node with several children, or on a KV-locked leaf).
                node = tree_core.lru_lists[ct].get_lru_no_lock()
                if node is None:
                    return None
                kind = "fallback"
            self._report(MAMBA_PRESSURE, kind, node)
            return self._tombstone_or_delete(node, node in tree_core.evictable_device_leaves, tracker, device_frees,
                                             host_frees, cache_actions, may_back_up=True)

        def _tombstone_or_delete(self, node, leaf, tracker, device_frees, host_frees, cache_actions,
                                 may_back_up=False):
            if leaf:
                return node.id  # SGLang deletes the leaf whole (or, with a host tier, demotes it)
            tier = self.marconi.host_tier
            if may_back_up and tier is not None and self.tree_core.enable_hicache and tier.state_alone(node):
                # Marconi's tier rule demotes this state: SGLang's internal backup, then the tombstone
                return InternalStateBackup(node_id=node.id, num_tokens=1)
            # One mutation: tombstone the state, keep the node and its KV (upstream's code, unguarded).
            tree_core = self.tree_core
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

    `mamba_mixins` are placed before the Marconi MAMBA component in its bases (e.g. the admission
    mixin); they must call `super()` cooperatively."""
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
