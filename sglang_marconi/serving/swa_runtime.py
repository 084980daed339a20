"""The runtime of a sliding-window (SWA) cache: its figures, and alpha tuned online by window
shadows (`policy/tuning/window_tuner.py`, the simulator's tuner), with the same sync points, directives,
bounded waits and fault protocol as the SSM runtime it extends (`runtime.MarconiRuntime`).

The shadows model SGLang's two pools in bytes: the full-KV pool's tokens and the SWA pool's
tokens, with the SWA pool's share of the bytes (`swa_share`), as the served cache holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_marconi.policy.tuning.shadow_tuner import choice_label
from sglang_marconi.policy.tuning.tuner_spec import TunerSpec
from sglang_marconi.policy.tree.window_cache import pool_split
from sglang_marconi.serving.runtime import METRICS, MarconiRuntime


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


class SWARuntime(MarconiRuntime):
    def __init__(self, cache, settings, config, group=None):
        self.swa_figures = settings.figures
        super().__init__(cache, settings, config, checkpoint_grid=1, group=group)

    def tuner_spec(self, cache) -> TunerSpec:
        profile = self.profile
        allocator = cache.token_to_kv_pool_allocator
        kv_tokens = int(allocator.size_full if hasattr(allocator, "size_full") else allocator.size)
        swa_tokens = int(getattr(allocator, "size_swa", 0))
        if kv_tokens and swa_tokens:  # the two pools: the shadows model the served cache on them
            capacity, share = pool_split(profile, kv_tokens, swa_tokens)
            return TunerSpec("window", profile, capacity, self.config.tuning(),
                             dict(swa_share=share, pools=(kv_tokens, swa_tokens)))
        capacity = max(1, kv_tokens * profile.kv_bytes_per_token)
        return TunerSpec("window", profile, capacity, self.config.tuning(), dict(swa_share=None))

    def _account(self, req) -> None:
        f = self.swa_figures
        f.requests += 1
        f.prompt_tokens += len(req.origin_input_ids)
        f.hit_tokens += int(getattr(req, "cached_tokens", 0) or 0)

    def metrics(self, cache) -> dict:
        f, settings, tuner = self.swa_figures, self.settings, self.tuner
        return {
            "marconi_eviction_policy": "upstream" if self.faulted is not None else "marconi-swa",
            **({"marconi_fault": self.faulted} if self.faulted is not None else {}),
            "marconi_sliding_window": settings.window,
            "marconi_alpha": settings.alpha,
            "marconi_rule_weight": settings.alpha,
            "marconi_choice": choice_label(settings.alpha),
            "marconi_shadow_scores": tuner.scores() if tuner is not None else {},
            "marconi_token_hit_rate": f.hit_tokens / f.prompt_tokens if f.prompt_tokens else 0.0,
            "marconi_requests": f.requests,
            "marconi_input_tokens": f.prompt_tokens,
            "marconi_prompt_tokens": f.prompt_tokens,
            "marconi_hit_tokens": f.hit_tokens,
            "marconi_evictions_stale": f.evictions_stale,
            "marconi_evictions_window": f.evictions_window,
            "marconi_evictions_leaf": f.evictions_leaf,
            "marconi_evictions_fallback": f.evictions_fallback,
            **self.tuning_figures(),
        }


__all__ = ["METRICS", "SWAFigures", "SWARuntime"]
