"""SGLang's `UnifiedRadixCache`, reporting to the Marconi runtime: each request's latest match
(its full-KV hit), every eviction, and every release with the prefix SGLang reports as cached
(`req.cached_tokens`, what the response's `cached_tokens` says); after each checkpoint and release it brings the eviction index up to date (`MarconiTreeIndex.flush`).

Fault guard: the Marconi calls (the runtime's `on_match`, `on_evict`, `on_release`, the index
flush) run after upstream's own method, under a guard: an exception there goes to
`MarconiEvictionSettings.fault` (one warning; upstream's eviction from then on) and never reaches
the scheduler. Upstream's `super()` calls stay outside it: SGLang's own errors propagate as
upstream. After a fault the index is no longer kept; the runtime still counts what it is told.

Built lazily (`marconi_cache_class()`) so importing this module needs no SGLang.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def marconi_cache_class():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    class MarconiUnifiedRadixCache(UnifiedRadixCache):
        marconi_runtime = None  # attached by the factory after construction
        marconi_settings = None  # MarconiEvictionSettings, attached with the runtime
        # Index upkeep right after each checkpoint and release (see _update_marconi_index); off
        # with upstream's admission (`--marconi-admission off`), whose per-chunk states change
        # the same nodes many times between evictions: upkeep at eviction time does each once.
        marconi_eager_index_upkeep = True

        def match_prefix(self, params):
            result = super().match_prefix(params)
            req = getattr(params, "req", None)
            if self.marconi_runtime is not None and req is not None:
                try:
                    self.marconi_runtime.on_match(req, result.full_kv_hit_length)
                except Exception as exc:
                    self._marconi_fault("on_match", exc)
            return result

        def _evict(self, params, *args, **kwargs):
            result = super()._evict(params, *args, **kwargs)
            if self.marconi_runtime is not None:
                try:
                    self.marconi_runtime.on_evict(result.num_tokens_evicted, result.mamba_num_evicted)
                except Exception as exc:
                    self._marconi_fault("on_evict", exc)
            return result

        def checkpoint(self, req, *args, **kwargs):
            result = super().checkpoint(req, *args, **kwargs)
            self._update_marconi_index()
            return result

        def on_release(self, req, *, checkpointed):
            super().on_release(req, checkpointed=checkpointed)
            self._update_marconi_index()
            if self.marconi_runtime is not None and checkpointed:
                try:
                    self.marconi_runtime.on_release(req)
                except Exception as exc:
                    self._marconi_fault("on_release", exc)

        def _update_marconi_index(self):
            # Re-evaluate the nodes this insert or release changed now, while their data is
            # warm, rather than at the next eviction, which sits on a new request's allocation.
            index = getattr(self, "marconi_index", None)
            if not self.marconi_eager_index_upkeep or index is None or index.root is None:
                return
            if index.settings.faulted is not None:
                return
            try:
                index.flush()
            except Exception as exc:
                self._marconi_fault("index flush", exc)

        def _marconi_fault(self, where: str, exc: BaseException) -> None:
            settings = self.marconi_settings or getattr(getattr(self, "marconi_index", None), "settings", None)
            if settings is None or not hasattr(settings, "fault"):
                raise exc  # no Marconi settings to fall back with: nothing was built by Marconi
            settings.fault(f"cache.{where}", exc)
            index = getattr(self, "marconi_index", None)
            if index is not None:
                index.detach()

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
