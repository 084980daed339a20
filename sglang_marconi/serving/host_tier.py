"""HiCache's host tier under Marconi's policy (issue 24.2), on SGLang's own HiCache tree.

With `--enable-hierarchical-cache --hicache-write-policy write_back`, SGLang's eviction walk hands
each device victim to the cache, which backs it up to host memory and demotes it (upstream's rule:
`tier_rules.UpstreamWriteBack`), and the host pools make room in LRU order. Under the `marconi`
backend the same walk takes Marconi's device victims (`components.py`: recency + alpha x FLOPs
saved per byte, among nodes with <= 1 child), and this module decides, with the policy core's
rule (`tier_rules.MarconiTiering`, the one the simulator's `TieredPrefixCache` runs):

- a device leaf: `MarconiTiering.demotion` on the node's facts (`EvictionFacts`). A leaf with a
  state (or with host-resident nodes below it) is demoted with its state; the host admits what is
  not forced only if the host candidates it would displace rank below it
  (`HostCandidateIndex.ranked_below`, recency + alpha x FLOPs saved per host byte), else it is
  dropped (both tiers); a leaf without a state is dropped (both tiers: no hit can use it). A
  demoted leaf whose KV already has a host copy gets its device-only state backed up first
  (upstream's `_demote` would free it with no copy);
- a state evicted alone (Mamba pressure on a node with one child): demoted (SGLang's internal
  state backup) if the host admits it by rank, else tombstoned;
- host pressure (`evict_host`): SGLang's host duplicates of device KV first (free: the device
  holds them), then the host's own candidates by rank (`host_candidate_bytes`: host-only leaves
  whole, host-only states of nodes with <= 1 child alone), lowest utility first.

A hit on a demoted prefix is SGLang's own load back (`init_load_back`), unchanged: the bytes that
come back are the bytes that went out. Counters: `EvictionCounters.states_demoted`,
`states_dropped`, `kv_tokens_demoted`, `states_loaded_back`, `kv_tokens_loaded_back`,
`host_evictions`, `device_hit_tokens`, `host_hit_tokens` (gauges `marconi_host_*`).

The host candidates are collected from the tree when the host must make room (a walk over the
tree's nodes, not an incremental index: host eviction runs once per backup that finds its pool
full, far less often than device eviction).

Works on SGLang's tree objects by duck typing; the few SGLang names used are imported lazily.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from sglang_marconi.policy.eviction.flop_aware import flops_saved_per_byte
from sglang_marconi.policy.host_candidates import HostCandidateIndex
from sglang_marconi.policy.tier_rules import Demotion, EvictionFacts, MarconiTiering, host_candidate_bytes


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
    cache.marconi.host_tier = tier
    return tier


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


def _end(node) -> int:
    end = 0
    while node.parent is not None:
        end += len(node.key)
        node = node.parent
    return end


class ServedHostTier:
    """Marconi's tier decisions for one SGLang HiCache tree (attached as `cache.marconi.host_tier`)."""

    def __init__(self, cache, profile, rules: Optional[MarconiTiering] = None):
        self.cache = cache
        self.profile = profile
        self.rules = rules or MarconiTiering()
        self.kv_bytes_per_token = int(profile.kv_bytes_per_token)
        self.state_bytes = int(profile.ssm_state_bytes)

    @property
    def counters(self):
        return self.cache.marconi.settings.counters

    @property
    def alpha(self) -> float:
        return self.rules.host_alpha(None)

    # -- values ----------------------------------------------------------------------------------
    def value(self, node, has_state: bool, freed_bytes: int) -> float:
        """FLOPs a hit at `node` saves over its parent per byte (`freed_bytes`); 0 without a state
        (the simulator's `TieredPrefixCache._value`)."""
        if not has_state or not freed_bytes:
            return 0.0
        end = _end(node)
        return flops_saved_per_byte(self.profile.prefill_flops(end - len(node.key), end), freed_bytes, 0)

    # -- host candidates -------------------------------------------------------------------------
    def host_candidates(self, protect=None):
        """(index, facts by slot, KV tokens and state slots each frees) over the host's candidates."""
        full, mamba, _ = _types()
        tree_core = self.cache.tree_core
        index, facts = HostCandidateIndex(), []
        kv_tokens, states = [], []
        stack = list(tree_core.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            f = _Facts(node, full, mamba)
            freed = host_candidate_bytes(
                self.rules, locked=f.locked or node is protect, is_root=False, kv_on_device=f.kv_dev,
                kv_on_host=f.kv_host, state_on_device=f.st_dev, state_on_host=f.st_host,
                n_children=len(node.children), kv_bytes=self.kv_bytes_per_token * f.tokens,
                state_bytes=self.state_bytes)
            if freed is None:
                continue
            whole = not f.kv_dev and not node.children
            if whole and node not in tree_core.evictable_host_leaves:
                continue  # SGLang's own host-leaf set decides what can leave whole
            index.add(node, node.last_access_time, self.value(node, f.st_host, freed), freed)
            facts.append((f, whole))
            kv_tokens.append(f.tokens if whole and f.kv_host else 0)
            states.append(1 if f.st_host else 0)
        return index, facts, np.array(kv_tokens, dtype=np.int64), np.array(states, dtype=np.int64)

    def _pool_free(self):
        from sglang.srt.mem_cache.hicache_storage import PoolName

        group = self.cache.host_pool_group
        kv, st = group.get_pool(PoolName.KV), group.get_pool(PoolName.MAMBA)
        return (kv.available_size() if kv is not None else 0), (st.available_size() if st is not None else 0)

    def _duplicate_tokens(self, protect) -> int:
        tree_core = self.cache.tree_core
        return sum(len(n.key) for n in tree_core.full_host_duplicates.values()
                   if n is not protect and tree_core._can_reclaim_full_host_duplicate(n))

    def host_admits(self, node, kv_needed: int, states_needed: int, footprint: int, has_state: bool) -> bool:
        """The ranked admission: the host's free room, its KV duplicates of device KV and the
        candidates ranking below `node` (recency + alpha x value per byte) cover what it needs."""
        kv_free, st_free = self._pool_free()
        if kv_free >= kv_needed and st_free >= states_needed:
            return True
        index, _, kv_tokens, states = self.host_candidates(protect=node)
        below = index.ranked_below(self.alpha, node.last_access_time, self.value(node, has_state, footprint))
        kv_room = kv_free + self._duplicate_tokens(node) + int(kv_tokens[below].sum())
        st_room = st_free + int(states[below].sum())
        return kv_room >= kv_needed and st_room >= states_needed

    # -- device evictions ------------------------------------------------------------------------
    def evict_device_leaf(self, node_id, tracker, upstream):
        """The cache's `_evict_device_leaf` under Marconi's rule; `upstream` is SGLang's (demote,
        or hand back the write-back BackupKV)."""
        full, mamba, _ = _types()
        cache, tree_core, c = self.cache, self.cache.tree_core, self.counters
        node = tree_core.node_by_id(node_id)
        f = _Facts(node, full, mamba)
        plan = self.rules.demotion(EvictionFacts(
            frees_kv=True, kv_on_host=f.kv_host, state_on_device=f.st_dev, state_on_host=f.st_host,
            host_descendants=bool(node.children)))
        if plan.kv and plan.ranked:
            kv_needed = 0 if f.kv_host else f.tokens
            states_needed = 1 if (plan.state and f.st_dev and not f.st_host) else 0
            footprint = self.kv_bytes_per_token * f.tokens + (self.state_bytes if f.st_dev or f.st_host else 0)
            if not self.host_admits(node, kv_needed, states_needed, footprint, f.st_dev or f.st_host):
                plan = Demotion(kv=f.kv_host, state=f.st_host)  # nothing new gets a host copy
        if not plan.kv:
            if self._drop_leaf(node, f, tracker):
                c.states_dropped += int(f.st_dev)
                c.host_drops += 1
                return None
            plan = Demotion(kv=True, state=f.st_dev or f.st_host)  # locked on the host: upstream's way
        if f.kv_host and f.st_dev and not f.st_host and plan.state:
            # KV already on the host: upstream's `_demote` would free the device-only state with no copy.
            if not cache.backup_node_for_write_back(node_id):
                plan = Demotion(kv=True, state=False)
            f = _Facts(node, full, mamba)
        backup = upstream(node_id, tracker)
        if f.st_dev and not f.st_host and not (plan.state and backup is not None):
            # demoted in place with its state on the device only: the state is lost
            c.states_dropped += int(backup is None)
        if f.st_dev and (f.st_host or backup is not None):
            c.states_demoted += 1
        if backup is not None:
            c.kv_tokens_demoted += f.tokens
        return backup

    def _drop_leaf(self, node, f: _Facts, tracker) -> bool:
        """Free a device leaf on both tiers (it has no children: `host_descendants` forces a keep)."""
        if node.children or f.locked:
            return False
        cache, tree_core = self.cache, self.cache.tree_core
        if not f.kv_host:
            return cache._drop_subtree_no_host(node.id, tracker)
        from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import DropSubtreeNoHostResult

        result = DropSubtreeNoHostResult(is_dropped=True)
        tree_core._delete_unbacked_device_leaf(  # releases every layer, the host copies too
            node, result.tracker, device_frees=result.device_frees, host_frees=result.host_frees,
            cache_actions=result.cache_actions)
        tree_core.full_host_duplicates.pop(node.id, None)
        cache._apply_eviction_result(result)
        cache._accumulate_tracker(tracker, result.tracker)
        return True

    def state_alone(self, node) -> bool:
        """A state evicted alone from the device (Mamba pressure, a node with one child): True to
        demote it (SGLang's internal state backup), False to tombstone it."""
        full, mamba, _ = _types()
        f = _Facts(node, full, mamba)
        if f.st_host or not f.kv_dev:
            return False  # a host copy already exists (nothing to copy), or no device KV to back up with
        plan = self.rules.demotion(EvictionFacts(
            frees_kv=False, kv_on_host=f.kv_host, state_on_device=f.st_dev, state_on_host=f.st_host,
            host_descendants=False))
        if not plan.state:
            return False
        kv_needed = 0 if f.kv_host else f.tokens  # SGLang's internal backup copies the node's KV too
        admitted = self.host_admits(node, kv_needed, 1, self.state_bytes, True)
        if admitted:
            self.counters.states_demoted += 1
        else:
            self.counters.states_dropped += 1
        return admitted

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
        the host's own candidates, lowest utility first. Returns what was freed."""
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
        while freed < num_tokens:
            index, facts, kv_tokens, states = self.host_candidates()
            useful = kv_tokens if component_type == full else states
            if not len(index.items) or not useful.any():
                break
            for slot in np.flatnonzero(useful == 0)[::-1]:  # frees nothing of this pool
                index.remove(int(slot))
            victim = index.lowest(self.alpha)
            f, whole = next(pair for pair in facts if pair[0].node is victim)
            result = DriveHostEvictionResult()
            if whole:
                tree_core._evict_host_leaf(victim, result.tracker, result.device_frees, result.host_frees,
                                           cache_actions=result.cache_actions)
            else:
                _, host_freed = tree_core._evict_component_and_detach_lru(
                    victim, tree_core.components_by_type[mamba], target=layer.HOST, tracker=None,
                    device_frees=result.device_frees, host_frees=result.host_frees,
                    cache_actions=result.cache_actions)
                result.tracker[mamba] += host_freed
            cache._apply_eviction_result(result)
            self.counters.host_evictions += 1
            self.counters.states_evicted_host += int(f.st_host)
            freed += result.tracker.get(component_type, 0)
        return freed
