"""SGLang's `UnifiedRadixCache`, reporting to the Marconi runtime: each request's latest match
(its full-KV hit), every eviction, and every release with the prefix SGLang reports as cached
(`req.cached_tokens`, what the response's `cached_tokens` says); after each checkpoint and release it brings the eviction index up to date (`MarconiTreeIndex.flush`).

Built lazily (`marconi_cache_class()`) so importing this module needs no SGLang.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def marconi_cache_class():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    class MarconiUnifiedRadixCache(UnifiedRadixCache):
        marconi_runtime = None  # attached by the factory after construction
        # Index upkeep right after each checkpoint and release (see _update_marconi_index); off
        # with upstream's admission (`--marconi-admission off`), whose per-chunk states change
        # the same nodes many times between evictions: upkeep at eviction time does each once.
        marconi_eager_index_upkeep = True

        def match_prefix(self, params):
            result = super().match_prefix(params)
            req = getattr(params, "req", None)
            if self.marconi_runtime is not None and req is not None:
                self.marconi_runtime.on_match(req, result.full_kv_hit_length)
            return result

        def _evict(self, params, *args, **kwargs):
            result = super()._evict(params, *args, **kwargs)
            if self.marconi_runtime is not None:
                self.marconi_runtime.on_evict(result.num_tokens_evicted, result.mamba_num_evicted)
            return result

        def checkpoint(self, req, *args, **kwargs):
            result = super().checkpoint(req, *args, **kwargs)
            self._update_marconi_index()
            return result

        def on_release(self, req, *, checkpointed):
            super().on_release(req, checkpointed=checkpointed)
            self._update_marconi_index()
            if self.marconi_runtime is not None and checkpointed:
                self.marconi_runtime.on_release(req)

        def _update_marconi_index(self):
            # Re-evaluate the nodes this insert or release changed now, while their data is
            # warm, rather than at the next eviction, which sits on a new request's allocation.
            index = getattr(self, "marconi_index", None)
            if self.marconi_eager_index_upkeep and index is not None and index.root is not None:
                index.flush()

    return MarconiUnifiedRadixCache
