"""Marconi for sliding-window-attention (SWA) hybrids inside SGLang's `UnifiedRadixCache`.

A hit at position p needs the full KV of every global layer for [0, p) and, for every SWA layer,
the KV of the `window` tokens before p, contiguous and resident (SGLang's SWA match validator).
SGLang's SWA component frees a running request's SWA KV once it leaves the window and, under SWA
pool pressure, walks its SWA LRU: a leaf goes whole, an inner node is tombstoned (SWA freed, full
KV kept). One tombstone inside the last window of a branch makes that branch unmatchable while its
full KV stays (SGLang #35515); LRU order does not know that, nor what a hit saves.

Admission (where SWA windows are kept): SGLang's own, which is Marconi's speculative insertion for
windows: a request whose full-KV match runs past its SWA-valid match (a new branch point,
`swa_branching_seqlen`) inserts its prefix up to that point while the window before it is live,
and every finished request keeps the window before its last token. `swa_retain_floor` adds that a
request never frees the window before its branch point before that insertion.

Eviction under SWA pressure (`MarconiSWAComponent`): the rule of `policy/rules/window_plan.py` (stale
SWA KV first, oldest first; a leaf's last window is never tombstoned: the leaf goes whole; branch
windows and leaves ranked by recency + alpha x FLOPs saved per byte freed), kept incrementally by
a `WindowPlan` per cache. This module only translates SGLang's nodes and hooks into it:
- the plan is bound when the cache is built (an empty tree), and again after a reset (at the
  next release or eviction: one walk over what the tree then holds);
- hooks, each O(1) (the lock hooks walk the lock's own segment, as SGLang does): a new leaf
  (`commit_insert_component_data`), a split (`redistribute_on_node_split`), a deletion
  (`discard_deleted_session_leaf`), SWA KV freed or set (`evict_component`,
  `apply_component_action`), SWA locks (`acquire_component_lock`, `release_component_lock`,
  `release_window_lock`: every node of the segment), recency (`window_time`: a hit refreshes the
  nodes of the window it reads, `finalize_match_result_in_tree_core`; an insert those of the
  window it keeps, `commit_insert_component_data`; the simulator's rule, not SGLang's whole-path
  `last_access_time`), and leaf evictability (the tree core's evictable-leaf set is wrapped so
  that every add or discard is reported: FULL-only lock changes reach no SWA hook);
- each eviction step flushes what changed (bounded work per change, independent of the tree's
  size) and takes the plan's next victim; a cache release flushes too, off the allocation path;
- with nothing of ours left (everything locked, or held only by locked windows) the step is
  upstream's LRU walk, so an allocation never fails where upstream's would succeed. Faults follow
  `faults.py`: the plan is derived from the tree and the window times, so a fault in it or in
  a hook's plan upkeep drops it and it is rebuilt from the tree (one warning); a second fault in
  a row, or one past the recovery bound, is unrecoverable (a rank alone: upstream's walk from
  then on; a rank of a group: one clear error). The window times are primary data: written
  whole before the plan hears of them, and a fault while writing them is unrecoverable.
`plan_victims` is the from-scratch order (`window_plan.reference_plan`) on SGLang's tree: the
reference, for tests. Full-KV pressure keeps SGLang's leaf LRU.

Imports SGLang lazily (classes built on first use).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

from sglang_marconi.policy.rules.window_plan import LEAF, STALE, WindowPlan, reference_plan
from sglang_marconi.serving.cache_state import MarconiCacheState
from sglang_marconi.serving.faults import MarconiFaults
from sglang_marconi.serving.leaf_watch import watch_leaves
from sglang_marconi.serving.swa_runtime import SWAFigures, SWARuntime

log = logging.getLogger("sglang_marconi")


def profile_for_swa(config: dict):
    """The policy core's profile of an SWA hybrid config. Mellum (Qwen3-MoE with interleaved
    SWA, served by SGLang's `MellumForCausalLM`) is read through the MiMo-V2-Flash parser, which
    has the same per-layer SWA / dense-or-MoE layout keys under other names."""
    from sglang_marconi.policy.cost.model_profile import profile_from_config

    arch = (config.get("architectures") or [""])[0]
    if arch == "MellumForCausalLM":
        config = dict(
            config, architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash",
            hybrid_layer_pattern=[int(t == "sliding_attention") for t in config["layer_types"]],
            moe_layer_freq=[int(t == "sparse") for t in config["mlp_layer_types"]],
            n_routed_experts=config.get("num_experts", config.get("num_local_experts")), n_shared_experts=0)
    return profile_from_config(config, name=config.get("_name_or_path") or arch or None)


@dataclass
class SWASettings:
    """What the SWA component evicts by: the FLOP weight in force (`alpha`, which the runtime's
    directives change, as `choice`), the window, the figures and the cache's fault protocol."""
    profile: object
    alpha: float
    window: int
    figures: object  # swa_runtime.SWAFigures
    faults: MarconiFaults = field(default_factory=MarconiFaults)  # the cache's fault protocol (faults.py)
    probation = False  # (the runtime's interface: no probationary windows)

    @property
    def faulted(self) -> str | None:
        """Why this cache serves upstream's SWA eviction (a rank alone after an unrecoverable fault)."""
        return self.faults.fallen_back

    @property
    def choice(self) -> float:
        return self.alpha

    @choice.setter
    def choice(self, alpha: float) -> None:
        self.alpha = float(alpha)

    @property
    def kind(self) -> str:
        return "flops"

    @property
    def weight(self) -> float:
        return self.alpha

    @property
    def label(self) -> str:
        from sglang_marconi.policy.tuning.shadow_tuner import choice_label

        return choice_label(self.alpha)


def window_time(node) -> float:
    """A node's recency for Marconi's window eviction: when a hit last read its window, or an insert
    kept it (the simulator's rule, `WindowRules.refresh_path=False`: a hit refreshes what it reads,
    not the whole matched path as SGLang's `last_access_time` does; 0.5 points better on the SWA
    benchmarks). Only grows; 0 for a node never stamped."""
    return node.__dict__.get("_marconi_window_time", 0.0)


class SGLangWindowView:
    """What the window plan reads of SGLang's nodes (duck-typed: no SGLang import). `arena`:
    the tree core's id -> node map (None: every node is taken as alive)."""

    __slots__ = ("_swa", "_leaves", "_arena")

    def __init__(self, swa_type, evictable_leaves, arena=None):
        self._swa, self._leaves, self._arena = swa_type, evictable_leaves, arena

    def live(self, node) -> bool:
        data = node.component_data[self._swa]
        return data.value is not None and data.lock_ref == 0

    def evictable_leaf(self, node) -> bool:
        return node in self._leaves

    def recency(self, node) -> float:
        return window_time(node)

    def alive(self, node) -> bool:
        return self._arena is None or self._arena.get(node.id) is node


def plan_victims(tree_core, ct, full_ct, settings: SWASettings, evictable_leaves) -> list[tuple[str, list]]:
    """Victims in eviction order, from scratch (`window_plan.reference_plan`): ("stale" | "window",
    nodes to tombstone) or ("leaf", [leaf]). The reference the incremental plan is checked against."""
    view = SGLangWindowView(ct, evictable_leaves)
    return reference_plan(tree_core.root_node, settings.window, view, settings.profile, settings.alpha)


@functools.lru_cache(maxsize=1)
def marconi_swa_component_class():
    from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer, get_and_increase_time_counter
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    class MarconiSWAComponent(SWAComponent):
        marconi_swa_settings: SWASettings = None  # set on the subclass the factory builds
        marconi_plan: WindowPlan | None = None  # bound by `marconi_start` (the factory), or at the first eviction

        # -- the walk ----------------------------------------------------------------------
        def _evict_device_start(self, request_cnt: int) -> None:
            self._marconi_pending: list = []
            self._marconi_upstream = bool(self.tree_core.enable_session_radix_cache or self.tree_core.enable_hicache)
            if self._marconi_upstream or self.marconi_swa_settings.faulted:
                self._marconi_upstream = True
                if self.marconi_plan is not None:  # host tiers and sessions are not modelled: stop keeping it
                    self.marconi_plan.detach()
                return super()._evict_device_start(request_cnt)
            self._evict_device_request_cnt = request_cnt
            self._evict_device_cursor = None
            try:
                if self.marconi_plan is None or self.marconi_plan.root is not self.tree_core.root_node:
                    self._marconi_bind()
            except Exception as exc:
                self._marconi_unrecoverable("plan bind", exc)
                self._marconi_upstream = True
                super()._evict_device_start(request_cnt)

        def _evict_device_end(self) -> None:
            self._marconi_pending = []
            super()._evict_device_end()

        def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
            if self._marconi_upstream:
                return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
            ct = self.component_type
            if tracker[ct] >= self._evict_device_request_cnt:
                return None
            settings = self.marconi_swa_settings
            unusable = None  # a victim whose every node was skipped: the plan must not repeat it
            while True:
                while self._marconi_pending:
                    node = self._marconi_pending.pop(0)
                    cd = node.component_data[ct]
                    if cd.value is None or cd.lock_ref > 0 or node.parent is None:
                        continue
                    self._tombstone(node, tracker, device_frees, host_frees, cache_actions)
                    return None
                victim = None if settings.faulted else self._marconi_next_victim(unusable)
                if victim is None:
                    break
                kind, nodes = victim
                if kind == LEAF:
                    settings.figures.evictions_leaf += 1
                    return nodes[0].id
                if kind == STALE:
                    settings.figures.evictions_stale += 1
                else:
                    settings.figures.evictions_window += 1
                self._marconi_pending = list(nodes)
                unusable = nodes
            # Nothing of ours left: upstream's LRU step from the LRU tail.
            settings.figures.evictions_fallback += 1
            self._marconi_upstream = True
            super()._evict_device_start(self._evict_device_request_cnt)
            return super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)

        def _tombstone(self, node, tracker, device_frees, host_frees, cache_actions):
            self.tree_core._evict_component_and_detach_lru(
                node, self, target=EvictLayer.DEVICE, tracker=tracker, device_frees=device_frees,
                host_frees=host_frees, cache_actions=cache_actions)
            self.tree_core._cascade_evict(node, self, tracker, device_frees=device_frees,
                                          host_frees=host_frees, cache_actions=cache_actions)

        # -- the plan --------------------------------------------------------------------------
        def _marconi_bind(self) -> None:
            tree_core = self.tree_core
            plan = self.marconi_plan
            if plan is None:
                plan = WindowPlan(self.marconi_swa_settings.window, None, self.marconi_swa_settings.profile)
            # a leaf's evictability also changes with FULL-only locks, which reach no SWA hook
            leaves = watch_leaves(tree_core, self._marconi_leaf)
            plan.view = SGLangWindowView(self.component_type, leaves, tree_core._node_arena)
            plan.bind(tree_core.root_node)
            self.marconi_plan = plan

        def marconi_start(self) -> None:
            """Bind the plan now, to the (empty) tree: from then on each change costs its share,
            never a whole-tree evaluation at the first eviction."""
            if self.marconi_swa_settings.faulted:
                return
            try:
                self._marconi_bind()
            except Exception as exc:
                self._marconi_fault(exc, "plan bind")

        def marconi_upkeep(self) -> None:
            """Flush what changed since the last step (a safe point: the tree is consistent), or
            rebind after a reset (the tree is new, and small)."""
            plan = self.marconi_plan
            if plan is None or self.marconi_swa_settings.faulted:
                return
            try:
                if plan.root is not self.tree_core.root_node:  # a reset, or dropped after a fault
                    self._marconi_bind()
                else:
                    plan.flush()
            except Exception as exc:
                self._marconi_fault(exc, "plan upkeep")

        def _marconi_next_victim(self, unusable):
            """The plan's next victim. A fault is recovered by rebuilding the plan from the tree
            (derived state: every rank rebuilds the same) and asking again; a second one is
            unrecoverable (`faults.py`): None, and upstream's walk from then on."""
            for attempt in (1, 2):
                try:
                    if self.marconi_plan.root is None:
                        self._marconi_bind()
                    victim = self.marconi_plan.next_victim(self.marconi_swa_settings.alpha)
                    if victim is not None and unusable is not None and victim[1] == unusable:
                        raise RuntimeError(f"SWA plan repeats a victim it cannot evict: {victim}")
                    return victim
                except Exception as exc:
                    if attempt == 2:
                        self._marconi_unrecoverable("victim choice", exc)
                    elif self._marconi_fault(exc, "victim choice"):
                        continue
                    return None
            return None

        def _marconi_fault(self, exc: BaseException, where: str = "window plan") -> bool:
            """The plan (derived from the tree) failed: dropped, rebuilt from the tree at its next
            use. False past the recovery bound (a rank alone now serves upstream's eviction)."""
            if self.marconi_plan is not None:
                self.marconi_plan.detach()
            return self.marconi_swa_settings.faults.recovered(f"MarconiSWAComponent.{where}", exc)

        def _marconi_unrecoverable(self, where: str, exc: BaseException) -> None:
            """Raises on a rank of a group; a rank alone serves upstream's SWA eviction from here on."""
            self.marconi_swa_settings.faults.unrecoverable(f"MarconiSWAComponent.{where}", exc)
            if self.marconi_plan is not None:
                self.marconi_plan.detach()

        # Hooks run on every tree mutation: each records into the plan (a dict insert; no-ops
        # while the plan is unbound), under the fault guard.
        def _marconi_tell(self, event: str, *nodes) -> None:
            """`plan.<event>(*nodes)` when there is a plan, under the fault guard."""
            plan = self.marconi_plan
            if plan is not None:
                try:
                    getattr(plan, event)(*nodes)
                except Exception as exc:
                    self._marconi_fault(exc)

        def _marconi_leaf(self, node) -> None:
            self._marconi_tell("touched", node)

        def _marconi_touch_segment(self, node, lock_uuid, by_window: bool) -> None:
            # The nodes a lock's acquire (by_window: the window's worth) or release (up to the node
            # holding lock_uuid, or the root) walks: their SWA KV became locked or unlocked.
            plan = self.marconi_plan
            if plan is None or plan.root is None:
                return
            try:
                root, ct, covered, cur = self.tree_core.root_node, self.component_type, 0, node
                while cur is not root and cur is not None:
                    plan.touched(cur)
                    if by_window:
                        covered += len(cur.key)
                        if covered >= self.sliding_window_size:
                            break
                    elif lock_uuid and cur.component_data[ct].metadata.get("uuid") == lock_uuid:
                        break
                    cur = cur.parent
            except Exception as exc:
                self._marconi_fault(exc)

        # -- hooks -----------------------------------------------------------------------------
        def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
            if is_new_leaf:  # before SGLang may split the new leaf: its parent grew
                self._marconi_tell("added", node)
            super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)
            self._marconi_stamp_window(node)  # the window this insert keeps at its end

        def _marconi_stamp_window(self, node) -> None:
            """Stamp the nodes holding the window before `node`'s end (`window_time`): what a hit
            ending there reads, or what an insert ending there keeps. The stamps are primary data
            (the plan is derived from them), so they are all written first, outside the plan's
            guard: a fault there is unrecoverable. Only then is the plan told, under its guard: a
            fault there drops the plan, rebuilt from stamps every rank holds alike."""
            if self.marconi_swa_settings.faulted or node is None:
                return
            now = get_and_increase_time_counter()
            try:
                stamped = self._marconi_write_window_time(node, now)
            except Exception as exc:
                self._marconi_unrecoverable("window stamp (recency)", exc)
                return
            plan = self.marconi_plan
            if plan is None:
                return
            try:
                for cur in stamped:
                    plan.stamped(cur)
            except Exception as exc:
                self._marconi_fault(exc, "window stamp (plan)")

        def _marconi_write_window_time(self, node, now) -> list:
            """Write `now` as the window time of every node of the window before `node`'s end;
            returns them."""
            root, covered, cur, stamped = self.tree_core.root_node, 0, node, []
            while cur is not None and cur is not root and covered < self.sliding_window_size:
                cur._marconi_window_time = now
                stamped.append(cur)
                covered += len(cur.key)
                cur = cur.parent
            return stamped

        def redistribute_on_node_split(self, new_parent, child):
            super().redistribute_on_node_split(new_parent, child)
            try:  # primary data: unrecoverable
                if "_marconi_window_time" in child.__dict__:  # the prefix was read or kept with its suffix
                    new_parent._marconi_window_time = child._marconi_window_time
            except Exception as exc:
                self._marconi_unrecoverable("node split (recency)", exc)
            self._marconi_tell("split", new_parent, child)

        def discard_deleted_session_leaf(self, node) -> None:
            super().discard_deleted_session_leaf(node)
            self._marconi_tell("removed", node)

        def evict_component(self, node, *args, **kwargs):
            freed = super().evict_component(node, *args, **kwargs)
            self._marconi_leaf(node)
            return freed

        def apply_component_action(self, action) -> None:
            super().apply_component_action(action)
            node_id = getattr(action, "node_id", None)
            if node_id is not None and self.marconi_plan is not None:
                node = self.tree_core._node_arena.get(node_id)
                if node is not None:
                    self._marconi_leaf(node)

        def acquire_component_lock(self, node, result, lock_host: bool = False):
            result = super().acquire_component_lock(node, result, lock_host)
            if not lock_host:
                self._marconi_touch_segment(node, None, by_window=True)
            return result

        def release_component_lock(self, node, params, lock_host: bool = False) -> None:
            super().release_component_lock(node, params, lock_host)
            if not lock_host and node is not self.tree_core.root_node:
                self._marconi_touch_segment(node, params.get_lock_uuid(self.component_type), by_window=False)

        def release_window_lock(self, node, swa_uuid_for_lock, *args, **kwargs) -> None:
            super().release_window_lock(node, swa_uuid_for_lock, *args, **kwargs)
            self._marconi_touch_segment(node, swa_uuid_for_lock, by_window=False)

        def finalize_match_result_in_tree_core(self, result, *args, **kwargs):
            result = super().finalize_match_result_in_tree_core(result, *args, **kwargs)
            hit = getattr(result, "last_device_node", None)
            if isinstance(hit, int):
                hit = self.tree_core._node_arena.get(hit)
            self._marconi_stamp_window(hit)  # the window this hit reads
            return result

    MarconiSWAComponent.__qualname__ = MarconiSWAComponent.__name__
    return MarconiSWAComponent


@functools.lru_cache(maxsize=1)
def marconi_swa_cache_class():
    from sglang_marconi.serving.cache import marconi_cache_class

    class MarconiSWARadixCache(marconi_cache_class()):
        def swa_retain_floor(self, req):
            # Keep the window before a new branch point until the prefix up to it is inserted
            # (SGLang inserts it with live SWA: the branch window Marconi's admission keeps).
            base = super().swa_retain_floor(req)
            state = self.marconi
            if state is None or state.faults.fallen_back is not None:
                return base
            try:  # admission (what SWA KV a request keeps for the tree): a fault is unrecoverable
                branch = getattr(req, "swa_branching_seqlen", None)
                window = state.settings.window
                if branch is None or not window:
                    return base
                floor = max(0, branch - window) // self.page_size * self.page_size
                return floor if base is None else min(base, floor)
            except Exception as exc:
                state.faults.unrecoverable("MarconiSWARadixCache.swa_retain_floor", exc)
                component = self._marconi_swa_component()
                if component is not None and component.marconi_plan is not None:
                    component.marconi_plan.detach()  # upstream's eviction from here on: stop keeping it
                return base

        def on_release(self, req, *, checkpointed):
            super().on_release(req, checkpointed=checkpointed)
            # Bring the eviction plan up to date now, off the next allocation's path.
            component = self._marconi_swa_component()
            if component is not None:
                component.marconi_upkeep()

        def _marconi_swa_component(self):
            from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

            component = self.tree_core.components_by_type.get(ComponentType.SWA)
            return component if hasattr(component, "marconi_upkeep") else None

    MarconiSWARadixCache.__qualname__ = MarconiSWARadixCache.__name__
    return MarconiSWARadixCache


def marconi_swa_radix_cache_factory(ctx, config, fallback, group=None):
    """The `marconi` cache for an SWA hybrid without SSM layers; `fallback(ctx, why)` builds
    upstream's cache (one warning) where we cannot model the architecture. `group`: the ranks
    sharing this scheduling (`lockstep.RankGroup`), for the fault protocol."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    hf = ctx.model_config.hf_config
    data = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
    try:
        profile = profile_for_swa(data)
    except (Exception,) as exc:  # MarconiError, KeyError, ...: one line, upstream's cache
        arch = (data.get("architectures") or [data.get("model_type", "?")])[0]
        return fallback(ctx, f"cannot model {arch} ({exc})")
    if not profile.has_sliding_window:
        return fallback(ctx, f"{profile.name}: no sliding-window layers in its profile")
    window = int(ctx.params.swa_retain_window or profile.sliding_window)
    figures = SWAFigures()
    faults = MarconiFaults(group.size, group.rank) if group is not None else MarconiFaults()
    # `--marconi-alpha auto`: the runtime starts from the tuner's first choice and tunes it online
    if config.eviction != "marconi":
        return fallback(ctx, f"--marconi-eviction {config.eviction} thins Mamba states; {profile.name} has none")
    settings = SWASettings(profile=profile, alpha=config.alpha or 0.0, window=window, figures=figures, faults=faults)
    component = type("MarconiSWAComponent", (marconi_swa_component_class(),),
                     {"marconi_swa_settings": settings, "__module__": __name__})
    ctx.params.component_registry_override = {**(ctx.params.component_registry_override or {}),
                                              ComponentType.SWA: component}
    cache = create_unified_radix_cache(ctx, cache_class=marconi_swa_cache_class())
    cache.marconi = MarconiCacheState(settings, config=config)
    cache.marconi.runtime = runtime = SWARuntime(cache, settings, config, group=group)
    cache.tree_core.components_by_type[ComponentType.SWA].marconi_start()
    from sglang_marconi.serving.metrics import SWA_GAUGES, PrometheusGauges, publishes_scheduler_metrics, \
        scheduler_metric_labels

    if publishes_scheduler_metrics():  # where SGLang publishes its own scheduler gauges
        name = getattr(ctx.server_args, "served_model_name", None) or ctx.server_args.model_path
        runtime.exporter = PrometheusGauges(scheduler_metric_labels(served_model_name=str(name)), gauges=SWA_GAUGES)
    log.info("Marconi SWA cache for %s: window=%d, alpha=%s", profile.name, window,
             "auto" if config.alpha is None else config.alpha)
    return cache
