"""Per-scheduler Marconi state: the figures the metrics report, and online alpha tuning.

The cache (`serving/cache.py`) reports matches, evictions and releases here. Tuning replays
each window with the engine-free simulator in worker processes (`blocking=False`): the
scheduler never waits, and a dead or stuck worker costs one warning and keeps the current alpha.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from sglang_marconi.policy.alpha_tuner import LRU, AlphaTuner
from sglang_marconi.policy.eviction import FlopAwareEviction, LruLeafEviction
from sglang_marconi.serving.tree_snapshot import snapshot_unified_tree, tree_capacity_bytes

log = logging.getLogger("sglang_marconi")


@dataclass
class ServingFigures:
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    flops_total: float = 0.0
    flops_saved: float = 0.0
    blocked_tokens: int = 0  # full-KV hit beyond the reusable prefix: no SSM state there
    evicted_tokens: int = 0
    evicted_states: int = 0


class SGLangTuningTarget:
    """The parts of a cache `AlphaTuner` uses, over SGLang's live tree and our settings."""

    def __init__(self, cache, settings, checkpoint_grid: int):
        self.sglang_cache = cache
        self.settings = settings
        self.profile = settings.profile
        self.capacity_bytes = tree_capacity_bytes(cache, self.profile)
        self.ssm_state_bytes = int(self.profile.ssm_state_bytes)
        self.checkpoint_grid = checkpoint_grid
        self.tree = SimpleNamespace(page_size=cache.page_size)
        self.eviction = LruLeafEviction() if settings.use_upstream_lru else FlopAwareEviction(settings.alpha)
        self.evictions = 0  # counted by the runtime from SGLang's eviction results

    @property
    def counters(self):
        return SimpleNamespace(evictions_leaf=self.evictions, evictions_single_child=0)

    def snapshot(self):
        return snapshot_unified_tree(self.sglang_cache, self.profile, checkpoint_grid=self.checkpoint_grid)

    def apply_choice(self, choice) -> None:
        if choice == LRU:
            self.settings.use_upstream_lru = True
            self.eviction = LruLeafEviction()
        else:
            self.settings.use_upstream_lru = False
            self.settings.alpha = float(choice)
            self.eviction = FlopAwareEviction(float(choice))


class MarconiRuntime:
    def __init__(self, cache, settings, config, checkpoint_grid: int):
        self.settings = settings
        self.profile = settings.profile
        self.config = config
        self.figures = ServingFigures()
        self._full_kv_hits: dict[str, int] = {}  # rid -> full-KV hit of its latest match
        self.target = SGLangTuningTarget(cache, settings, checkpoint_grid)
        self.tuner = AlphaTuner(self.target, config.tuning(), blocking=False) if config.alpha is None else None
        self.cache = cache
        self.exporter = None  # PrometheusGauges when SGLang runs with --enable-metrics

    @property
    def alpha(self) -> float:
        return 0.0 if self.settings.use_upstream_lru else self.settings.alpha

    def on_match(self, rid: str, full_kv_hit: int) -> None:
        # A waiting request is matched again at each scheduling round; the last match is the
        # one its prefill used.
        self._full_kv_hits[rid] = full_kv_hit

    def on_evict(self, tokens: int, states: int) -> None:
        self.figures.evicted_tokens += tokens
        self.figures.evicted_states += states
        if tokens or states:
            self.target.evictions += 1

    def on_release(self, rid: str, session_key: str, input_ids, output_ids, hit: int) -> None:
        """`hit`: the prefix whose prefill was skipped, as SGLang reports it (`cached_tokens`)."""
        full_kv_hit = self._full_kv_hits.pop(rid, 0)
        n = len(input_ids)
        f = self.figures
        f.requests += 1
        f.input_tokens += n
        f.hit_tokens += hit
        f.blocked_tokens += max(0, min(full_kv_hit, n - 1) - hit)
        f.flops_total += self.profile.prefill_flops(0, n)
        f.flops_saved += self.profile.prefill_flops(0, hit)
        if self.exporter is not None:
            self.exporter.publish(self.metrics(self.cache))
        if self.tuner is not None:
            try:
                self.tuner.after_request(session_key, np.asarray(input_ids, dtype=np.int64),
                                         np.asarray(output_ids, dtype=np.int64))
            except Exception as exc:  # tuning must never take the scheduler down
                log.warning("Marconi alpha tuning disabled after an error: %s: %s", type(exc).__name__, exc)
                self.tuner = None

    def metrics(self, cache) -> dict:
        """The figures `/server_info` and the Prometheus gauges show."""
        f = self.figures
        admission = getattr(cache.components.get(_mamba_type()), "marconi_admission_counters", None)
        counters = self.settings.counters
        two_pass = cache.__dict__.get("marconi_two_pass_counters")  # set by two_pass_prefill.py
        return {
            "marconi_token_hit_rate": f.hit_tokens / f.input_tokens if f.input_tokens else 0.0,
            "marconi_hit_tokens": f.hit_tokens,
            "marconi_input_tokens": f.input_tokens,
            "marconi_prefill_flops_saved": f.flops_saved,
            "marconi_prefill_flops_saved_fraction": f.flops_saved / f.flops_total if f.flops_total else 0.0,
            "marconi_alpha": self.alpha,
            "marconi_eviction_policy": "lru" if self.settings.use_upstream_lru else "marconi",
            "marconi_ssm_states_cached": _states_in_tree(cache),
            "marconi_ssm_states_admitted": admission.final_states_admitted + admission.branch_states_admitted
            if admission else 0,
            "marconi_checkpoint_grid": self.target.checkpoint_grid,
            "marconi_evictions_leaf": counters.evictions_leaf,
            "marconi_evictions_single_child": counters.evictions_single_child,
            "marconi_admissions_skipped_no_slot": admission.skipped_no_slot if admission else 0,
            "marconi_blocked_hit_tokens": f.blocked_tokens,
            "marconi_requests": f.requests,
            "marconi_tuning_failures": self.tuner.log.failures if self.tuner else 0,
            "marconi_two_pass_splits": two_pass.splits + two_pass.continuation_splits if two_pass else 0,
            "marconi_two_pass_skipped": two_pass.skipped_other_chunked + two_pass.skipped_unaligned if two_pass else 0,
            "marconi_two_pass_deferred": two_pass.deferred_second_chunked if two_pass else 0,
        }

    def close(self) -> None:
        if self.tuner is not None:
            self.tuner.close()


def _mamba_type():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.MAMBA


def _states_in_tree(cache) -> int:
    return int(cache.mamba_evictable_size() + cache.mamba_protected_size())
