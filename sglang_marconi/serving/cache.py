"""SGLang's `UnifiedRadixCache`, reporting to the Marconi runtime: each request's latest match
(its full-KV hit), every eviction, and every release with the prefix SGLang reports as cached
(`req.cached_tokens`, what the response's `cached_tokens` says). After each checkpoint and release
it brings the eviction index up to date (`MarconiTreeIndex.flush`), while the nodes it changed are
warm, rather than at the next eviction, which sits on a new request's allocation.

An eviction call whose `EvictParams` carries a walk context (`cache_state.marconi_evict_params`)
exposes it to the components for that call only (`MarconiCacheState.walking`). A reset clears
what Marconi kept of the tree (probationary states, the index).

Faults: the runtime's reports are rank-local figures (a failure stops the figures, never the
tree); the index upkeep is recovered by a rebuild from the tree (`faults.py`). Upstream's `super()`
calls stay outside every guard: SGLang's own errors propagate as upstream's would.

Built lazily (`marconi_cache_class()`) so importing this module needs no SGLang.
"""

from __future__ import annotations

import functools

from sglang_marconi.serving.cache_state import walk_of
from sglang_marconi.serving.host_tier import served_tiers
from sglang_marconi.serving.runtime import speculative_skip


@functools.lru_cache(maxsize=1)
def marconi_cache_class():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    class MarconiUnifiedRadixCache(UnifiedRadixCache):
        marconi = None  # MarconiCacheState, made by the Marconi components as the cache is built

        @property
        def marconi_runtime(self):
            return None if self.marconi is None else self.marconi.runtime

        def match_prefix(self, params):
            for component in self.components.values():  # a component may bar states from this match
                if hasattr(component, "marconi_before_match"):
                    component.marconi_before_match(params)
            result = super().match_prefix(params)
            req = getattr(params, "req", None)
            runtime = self.marconi_runtime
            if runtime is not None and req is not None:
                runtime.report("on_match", runtime.on_match, req, result.full_kv_hit_length)
            return result

        def evict_for_alloc(self, params, *, allocation_reclaim_satisfied=None):
            walk = self._marconi_walk_for(params, allocation_reclaim_satisfied)
            if self.marconi is None or walk == self.marconi.walk:
                return super().evict_for_alloc(params, allocation_reclaim_satisfied=allocation_reclaim_satisfied)
            with self.marconi.walking(walk):
                return super().evict_for_alloc(params, allocation_reclaim_satisfied=allocation_reclaim_satisfied)

        def evict(self, params):
            walk = walk_of(params)
            if self.marconi is None or walk == self.marconi.walk:
                return super().evict(params)
            with self.marconi.walking(walk):
                return super().evict(params)

        def _marconi_walk_for(self, params, allocation_reclaim_satisfied):
            """What this eviction call may take (the one-budget cache adds its byte shortfall)."""
            return walk_of(params)

        def _evict(self, params, *args, **kwargs):
            result = super()._evict(params, *args, **kwargs)
            runtime = self.marconi_runtime
            if runtime is not None:
                runtime.report("on_evict", runtime.on_evict, result.num_tokens_evicted, result.mamba_num_evicted)
            return result

        # -- HiCache's host tier under Marconi's rule (`host_tier.py`) ----------------------------
        def _marconi_host_tier(self):
            state = self.marconi
            tier = None if state is None else state.host_tier
            return tier if tier is not None and served_tiers(self) else None

        def _evict_device_leaf(self, node_id, tracker):
            tier = self._marconi_host_tier()
            if tier is None:
                return super()._evict_device_leaf(node_id, tracker)
            return tier.evict_device_leaf(node_id, tracker, super()._evict_device_leaf)

        def evict_host(self, num_tokens, component_type=None):
            tier = self._marconi_host_tier()
            if component_type is None:
                from sglang.srt.mem_cache.unified_cache.components.base import BASE_COMPONENT_TYPE

                component_type = BASE_COMPONENT_TYPE
            if tier is None or not tier.ranks(component_type):
                return super().evict_host(num_tokens, component_type)
            return tier.evict_host(num_tokens, component_type)

        def init_load_back(self, params):
            loaded = super().init_load_back(params)
            req = getattr(params, "req", None)
            if loaded is not None and req is not None and self.marconi is not None:
                req.marconi_host_loaded = loaded[0]
            return loaded

        def load_back(self, node_id, mem_quota=None, req=None):
            tier = self._marconi_host_tier()
            facts = tier.load_back_facts(node_id) if tier is not None else None
            path = tier.load_back_path(node_id) if tier is not None else ()
            ok = super().load_back(node_id, mem_quota, req=req)
            if tier is not None:
                if ok:
                    tier.loaded_back(*facts)
                index = self.marconi.index
                for node in path:  # what came back to the device, and the device node above it
                    index.changed(node)
            return ok

        def checkpoint(self, req, *args, **kwargs):
            result = super().checkpoint(req, *args, **kwargs)
            self._update_marconi_index()
            return result

        def on_release(self, req, *, checkpointed):
            super().on_release(req, checkpointed=checkpointed)
            self._update_marconi_index()
            hints = getattr(self.marconi, "hints", None)  # client cache hints (`cache_hints.py`)
            if hints is not None and checkpointed and req.finished():
                hints.on_release(self, req)
            runtime = self.marconi_runtime
            if runtime is not None and (checkpointed or (runtime.speculative and speculative_skip(req))):
                # a request SGLang kept out of the tree under speculative decoding still counts
                runtime.on_release(req)
            if checkpointed and self.marconi is not None and self.marconi.host_tier is not None \
                    and not getattr(req, "marconi_hit_counted", False) and req.finished():
                req.marconi_hit_counted = True
                host = getattr(req, "marconi_host_loaded", 0) or 0
                counters = self.marconi.settings.counters
                counters.host_hit_tokens += host
                counters.device_hit_tokens += max(0, (getattr(req, "cached_tokens", 0) or 0) - host)

        def reset(self):
            super().reset()
            if self.marconi is not None:
                self.marconi.on_reset()

        def _update_marconi_index(self):
            state = self.marconi
            if state is None or not state.eager_index_upkeep or state.index is None or not state.index.bound:
                return
            if state.faults.fallen_back is not None:
                return
            try:
                state.index.flush()
            except Exception as exc:
                state.index.invalidate()
                state.faults.recovered("cache.index flush", exc)

    _install_kv_state_events()
    return MarconiUnifiedRadixCache


def _install_kv_state_events():
    # SSM-state events beside SGLang's KV events (kv_events.py): hooked where the cache class is
    # built, in each scheduler process, before its publisher first runs. A failure costs the
    # state events only.
    try:
        from sglang_marconi.serving.kv_events import install_hooks

        install_hooks()
    except Exception as exc:  # noqa: BLE001
        import logging

        logging.getLogger("sglang_marconi").warning("Marconi: no SSM-state KV events (%s: %s)",
                                                    type(exc).__name__, exc)
