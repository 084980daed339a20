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

Eviction under SWA pressure (`MarconiSWAComponent`), one plan per step over the tree:
- reuse points are leaves (the last decoded token of a branch) and nodes with several children
  (branch points); a node's window is the nodes up from it covering `window` tokens;
- SWA KV in no reuse point's window is stale (no hit can read it): freed first, oldest first;
- a node inside a leaf's last window is never tombstoned: the candidate is the leaf itself,
  deleted whole (full KV and SWA), and its ancestors' window becomes stale only then;
- the other candidates are a branch point's window (its nodes in no other live window) and a
  leaf; each scores `norm(recency) + alpha * norm(FLOPs saved / bytes freed)` (the policy core's
  `marconi_scores`), FLOPs saved = prefill FLOPs from the nearest reuse point above to this one;
  the lowest goes first;
- with nothing of ours left (everything locked, or held only by locked windows) the step is
  upstream's LRU walk, so an allocation never fails where upstream's would succeed; an exception
  in the plan costs one warning and hands every later walk to upstream (`marconi_fault`).
The plan is rebuilt at every step (O(nodes)): fine for the trees of a CPU test server, a
candidate index like `eviction_components.MarconiTreeIndex` is the step for large trees.
Full-KV pressure keeps SGLang's leaf LRU.

Imports SGLang lazily (classes built on first use).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.candidate_index import marconi_scores

log = logging.getLogger("sglang_marconi")
DEFAULT_SWA_ALPHA = 1.0  # no online tuning for windows in the server yet: a fixed FLOP weight


def profile_for_swa(config: dict):
    """The policy core's profile of an SWA hybrid config. Mellum (Qwen3-MoE with interleaved
    SWA, served by SGLang's `MellumForCausalLM`) is read through the MiMo-V2-Flash parser, which
    has the same per-layer SWA / dense-or-MoE layout keys under other names."""
    from sglang_marconi.policy.model_profile import profile_from_config

    arch = (config.get("architectures") or [""])[0]
    if arch == "MellumForCausalLM":
        config = dict(
            config, architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash",
            hybrid_layer_pattern=[int(t == "sliding_attention") for t in config["layer_types"]],
            moe_layer_freq=[int(t == "sparse") for t in config["mlp_layer_types"]],
            n_routed_experts=config.get("num_experts", config.get("num_local_experts")), n_shared_experts=0)
    return profile_from_config(config, name=config.get("_name_or_path") or arch or None)


@dataclass
class SWAFigures:
    """What `/server_info` shows under `marconi` for an SWA model."""
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    evictions_stale: int = 0  # SWA segments in no reuse point's window, tombstoned
    evictions_window: int = 0  # a branch point's window tombstoned
    evictions_leaf: int = 0  # a branch deleted whole
    evictions_fallback: int = 0  # upstream's LRU step (nothing of ours left)

    def as_dict(self, alpha: float, window: int) -> dict:
        rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"marconi_eviction_policy": "marconi-swa", "marconi_alpha": alpha,
                "marconi_sliding_window": window, "marconi_token_hit_rate": rate,
                **{f"marconi_{k}": v for k, v in vars(self).items()}}


class SWARuntime:
    """The cache's reporting side (the `marconi_runtime` the cache class and hooks call)."""

    def __init__(self, settings):
        self.settings = settings
        self.figures = SWAFigures()

    def on_match(self, req, full_kv_hit_length) -> None:
        pass

    def on_evict(self, num_tokens, mamba_num) -> None:
        pass

    def on_release(self, req) -> None:
        self.figures.requests += 1
        self.figures.prompt_tokens += len(req.origin_input_ids)
        self.figures.hit_tokens += int(getattr(req, "cached_tokens", 0) or 0)

    def on_idle(self) -> None:
        pass

    def metrics(self, cache) -> dict:
        figures = self.figures.as_dict(self.settings.alpha, self.settings.window)
        if self.settings.faulted:
            figures.update(marconi_eviction_policy="upstream", marconi_fault=self.settings.faulted)
        return figures


@dataclass
class SWASettings:
    profile: object
    alpha: float
    window: int
    figures: SWAFigures
    faulted: str | None = None  # set by the first exception in Marconi's plan: upstream's walk after

    def fault(self, exc: BaseException) -> None:
        if self.faulted is None:
            log.warning("Marconi SWA eviction failed (%r); SGLang's own SWA eviction from now on", exc)
            self.faulted = repr(exc)


def _window_nodes(node, root, window: int) -> list:
    """`node` and its ancestors covering the `window` tokens before its end."""
    out, covered = [], 0
    while node is not root and covered < window:
        out.append(node)
        covered += len(node.key)
        node = node.parent
    return out


def plan_victims(tree_core, ct, full_ct, settings: SWASettings, evictable_leaves) -> list[tuple[str, list]]:
    """Victims in eviction order: ("stale" | "window", nodes to tombstone) or ("leaf", [leaf])."""
    root, window, profile = tree_core.root_node, settings.window, settings.profile
    ends, nodes, stack = {root.id: 0}, [], [root]
    while stack:  # every node with its end position (tokens from the root)
        node = stack.pop()
        for child in node.children.values():
            ends[child.id] = ends[node.id] + len(child.key)
            nodes.append(child)
            stack.append(child)

    def live(n):
        cd = n.component_data[ct]
        return cd.value is not None and cd.lock_ref == 0

    leaves = [n for n in nodes if not n.children]
    branches = [n for n in nodes if len(n.children) > 1]
    in_leaf_window = {w.id for leaf in leaves for w in _window_nodes(leaf, root, window)}
    branch_windows = {b.id: _window_nodes(b, root, window) for b in branches}
    owners: dict[int, int] = {}
    for nodes_of_b in branch_windows.values():
        for w in nodes_of_b:
            owners[w.id] = owners.get(w.id, 0) + 1

    stale = [n for n in nodes if n.children and live(n) and n.id not in in_leaf_window and n.id not in owners]
    stale.sort(key=lambda n: (n.last_access_time, n.id))
    plan = [("stale", [n]) for n in stale]

    def anchor_end(n):  # the nearest reuse point above n (a branch point), or the root
        p = n.parent
        while p is not root and len(p.children) < 2:
            p = p.parent
        return ends[p.id]

    candidates, recency, efficiency = [], [], []
    for b in branches:
        freeable = [w for w in branch_windows[b.id] if live(w) and owners[w.id] == 1 and w.id not in in_leaf_window]
        if not freeable:
            continue
        freed = profile.swa_kv_bytes_per_token * sum(len(w.key) for w in freeable)
        candidates.append(("window", freeable))
        recency.append(b.last_access_time)
        efficiency.append(profile.prefill_flops(anchor_end(b), ends[b.id]) / max(freed, 1))
    for leaf in leaves:
        if leaf not in evictable_leaves or not live(leaf):
            continue
        freed = (profile.kv_bytes_per_token + profile.swa_kv_bytes_per_token) * len(leaf.key)
        candidates.append(("leaf", [leaf]))
        recency.append(leaf.last_access_time)
        efficiency.append(profile.prefill_flops(anchor_end(leaf), ends[leaf.id]) / max(freed, 1))
    if candidates:
        scores = marconi_scores(np.asarray(recency, float), np.asarray(efficiency, float), settings.alpha)
        order = sorted(range(len(candidates)), key=lambda i: (scores[i], candidates[i][1][0].id))
        plan += [candidates[i] for i in order]
    return plan


@functools.lru_cache(maxsize=1)
def marconi_swa_component_class():
    from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    class MarconiSWAComponent(SWAComponent):
        marconi_swa_settings: SWASettings = None  # set on the subclass the factory builds

        def _evict_device_start(self, request_cnt: int) -> None:
            self._marconi_pending: list = []
            self._marconi_upstream = bool(self.tree_core.enable_session_radix_cache or self.tree_core.enable_hicache)
            if self._marconi_upstream or self.marconi_swa_settings.faulted:
                self._marconi_upstream = True
                return super()._evict_device_start(request_cnt)
            self._evict_device_request_cnt = request_cnt
            self._evict_device_cursor = None

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
            while True:
                while self._marconi_pending:
                    node = self._marconi_pending.pop(0)
                    cd = node.component_data[ct]
                    if cd.value is None or cd.lock_ref > 0 or node.parent is None:
                        continue
                    self._tombstone(node, tracker, device_frees, host_frees, cache_actions)
                    return None
                try:
                    plan = plan_victims(self.tree_core, ct, ComponentType.FULL, settings,
                                        self.tree_core.evictable_device_leaves)
                except Exception as exc:  # Marconi's own fault: upstream's eviction from now on
                    settings.fault(exc)
                    plan = []
                if not plan:
                    break
                kind, nodes = plan[0]
                if kind == "leaf":
                    settings.figures.evictions_leaf += 1
                    return nodes[0].id
                setattr(settings.figures, f"evictions_{kind}", getattr(settings.figures, f"evictions_{kind}") + 1)
                self._marconi_pending = list(nodes)
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

    MarconiSWAComponent.__qualname__ = MarconiSWAComponent.__name__
    return MarconiSWAComponent


@functools.lru_cache(maxsize=1)
def marconi_swa_cache_class():
    from sglang_marconi.serving.cache import marconi_cache_class

    class MarconiSWARadixCache(marconi_cache_class()):
        marconi_swa_window = 0

        def swa_retain_floor(self, req):
            # Keep the window before a new branch point until the prefix up to it is inserted
            # (SGLang inserts it with live SWA: the branch window Marconi's admission keeps).
            base = super().swa_retain_floor(req)
            branch = getattr(req, "swa_branching_seqlen", None)
            if branch is None or not self.marconi_swa_window:
                return base
            floor = max(0, branch - self.marconi_swa_window) // self.page_size * self.page_size
            return floor if base is None else min(base, floor)

    MarconiSWARadixCache.__qualname__ = MarconiSWARadixCache.__name__
    return MarconiSWARadixCache


def marconi_swa_radix_cache_factory(ctx, config, fallback):
    """The `marconi` cache for an SWA hybrid without SSM layers; `fallback(ctx, why)` builds
    upstream's cache (one warning) where we cannot model the architecture."""
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
    alpha = DEFAULT_SWA_ALPHA if config.alpha is None else config.alpha
    figures = SWAFigures()
    settings = SWASettings(profile=profile, alpha=alpha, window=window, figures=figures)
    component = type("MarconiSWAComponent", (marconi_swa_component_class(),),
                     {"marconi_swa_settings": settings, "__module__": __name__})
    ctx.params.component_registry_override = {**(ctx.params.component_registry_override or {}),
                                              ComponentType.SWA: component}
    cache = create_unified_radix_cache(ctx, cache_class=marconi_swa_cache_class())
    cache.marconi_swa_window = window
    runtime = SWARuntime(settings)
    runtime.figures = figures
    cache.marconi_runtime = runtime
    log.info("Marconi SWA cache for %s: window=%d, alpha=%s", profile.name, window, alpha)
    return cache
