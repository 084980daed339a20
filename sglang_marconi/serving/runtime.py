"""Per-scheduler Marconi state: the figures the metrics report, and online tuning of the eviction
choice by shadow caches (`policy/shadow_tuner.py`).

The cache (`serving/cache.py`) reports matches, evictions and releases here. With `--marconi-alpha
auto` every finished request is fed to the shadow tuner, which runs in a background process
(`background_tuner.py`): feeding and polling cost the scheduler thread a few microseconds, and a
dying or stalled tuner costs one warning and keeps the current choice. With `tune_workers=0` the
shadows run inline on the scheduler thread (deterministic; for tests and debugging).

The shadows model SGLang's two pools: KV tokens (the KV pool's size) and SSM states (the Mamba
pool's slots), each scaled by the sample rate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.eviction import SegLenEviction
from sglang_marconi.policy.shadow_tuner import LRU, Choice, ShadowTuner, choice_label, eviction_for, seglen_choice

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


class InlineShadowTuner:
    """The shadow tuner on the caller's thread, with `BackgroundShadowTuner`'s interface."""

    failed = None
    dropped = 0

    def __init__(self, profile, capacity_bytes, config, **kwargs):
        kwargs.pop("stall_s", None)
        self.tuner = ShadowTuner(profile, capacity_bytes, config, **kwargs)
        self.choices = self.tuner.choices
        self.fed = 0

    def observe(self, session_key: str, input_ids, output_ids) -> Choice | None:
        self.fed += 1
        return self.tuner.observe(session_key, np.asarray(input_ids, dtype=np.int64),
                                  np.asarray(output_ids, dtype=np.int64))

    @property
    def observed(self) -> int:
        return self.tuner.log.requests

    def scores(self) -> dict[str, float]:
        return self.tuner.score_table()

    def stop(self) -> None:
        pass

    def close(self, timeout: float = 0.0):
        return self.tuner.log


class MarconiRuntime:
    def __init__(self, cache, settings, config, checkpoint_grid: int):
        self.settings = settings
        self.profile = settings.profile
        self.config = config
        self.checkpoint_grid = checkpoint_grid
        self.figures = ServingFigures()
        self._full_kv_hits: dict[str, int] = {}  # rid -> full-KV hit of its latest match
        self.cache = cache
        self.exporter = None  # PrometheusGauges when SGLang runs with --enable-metrics
        self.tuner = None
        self.tuner_log = None  # the tuner's log, once closed
        self._tuning = config.alpha is None
        self.adoptions: list[tuple[int, Choice]] = []  # (requests released, choice adopted then)
        if self._tuning:
            self.tuner = self._start_tuner(cache)
            self._adopt(config.tuning().start)

    def _start_tuner(self, cache):
        kv_tokens = cache.token_to_kv_pool_allocator.size
        kwargs = dict(state_slots=cache.req_to_token_pool.mamba_pool.size, checkpoint_grid=self.checkpoint_grid,
                      page_size=cache.page_size)
        capacity = max(1, int(kv_tokens * self.profile.kv_bytes_per_token))
        if self.config.tune_workers == 0:
            return InlineShadowTuner(self.profile, capacity, self.config.tuning(), **kwargs)
        from sglang_marconi.serving.background_tuner import BackgroundShadowTuner

        return BackgroundShadowTuner(self.profile, capacity, self.config.tuning(),
                                     stall_s=self.config.tune_timeout_s, **kwargs)

    @property
    def alpha(self) -> float:
        return 0.0 if self.settings.use_upstream_lru else self.settings.alpha

    @property
    def choice(self) -> Choice:
        s = self.settings
        if s.use_upstream_lru:
            return LRU
        return seglen_choice(s.alpha) if s.value_kind == "seglen" else s.alpha

    def _adopt(self, choice: Choice) -> None:
        s = self.settings
        if choice == LRU:
            s.use_upstream_lru = True
            return
        eviction = eviction_for(choice)  # the weight and the kind of value column it ranks by
        s.use_upstream_lru = False
        s.value_kind = "seglen" if isinstance(eviction, SegLenEviction) else "flops"
        s.alpha = eviction.alpha

    def on_match(self, rid: str, full_kv_hit: int) -> None:
        # A waiting request is matched again at each scheduling round; the last match is the
        # one its prefill used.
        self._full_kv_hits[rid] = full_kv_hit

    def on_evict(self, tokens: int, states: int) -> None:
        self.figures.evicted_tokens += tokens
        self.figures.evicted_states += states

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
        if self._tuning and self.tuner.failed is None:
            self._tune(session_key, input_ids, output_ids)
        if self.exporter is not None:
            self.exporter.publish(self.metrics(self.cache))

    def _tune(self, session_key: str, input_ids, output_ids) -> None:
        try:
            # SGLang caches input + output[:-1]: the last decoded token was never fed back (no KV).
            choice = self.tuner.observe(session_key, input_ids, output_ids[:-1])
        except Exception as exc:  # tuning must never take the scheduler down
            log.warning("Marconi tuning stopped after an error (%s: %s); keeping eviction choice %s",
                        type(exc).__name__, exc, choice_label(self.choice))
            self.tuner.failed = f"{type(exc).__name__}: {exc}"
            return
        if choice is not None:
            self._adopt(choice)
            self.adoptions.append((self.figures.requests, choice))
            if not self.config.retune:  # the paper tunes once: stop here, without waiting
                self._tuning = False
                self.tuner.stop()

    def metrics(self, cache) -> dict:
        """The figures `/server_info` and the Prometheus gauges show."""
        f = self.figures
        admission = getattr(cache.components.get(_mamba_type()), "marconi_admission_counters", None)
        counters = self.settings.counters
        two_pass = cache.__dict__.get("marconi_two_pass_counters")  # set by two_pass_prefill.py
        tuner = self.tuner
        return {
            "marconi_token_hit_rate": f.hit_tokens / f.input_tokens if f.input_tokens else 0.0,
            "marconi_hit_tokens": f.hit_tokens,
            "marconi_input_tokens": f.input_tokens,
            "marconi_prefill_flops_saved": f.flops_saved,
            "marconi_prefill_flops_saved_fraction": f.flops_saved / f.flops_total if f.flops_total else 0.0,
            "marconi_alpha": self.alpha,
            "marconi_eviction_policy": "lru" if self.settings.use_upstream_lru else (
                "seglen" if self.settings.value_kind == "seglen" else "marconi"),
            "marconi_choice": choice_label(self.choice),
            "marconi_shadow_scores": tuner.scores() if tuner is not None else {},
            "marconi_tuner_requests_fed": tuner.fed if tuner is not None else 0,
            "marconi_tuner_requests_dropped": tuner.dropped if tuner is not None else 0,
            "marconi_tuner_requests_observed": tuner.observed if tuner is not None else 0,
            "marconi_ssm_states_cached": _states_in_tree(cache),
            "marconi_ssm_states_admitted": admission.final_states_admitted + admission.branch_states_admitted
            if admission else 0,
            "marconi_checkpoint_grid": self.checkpoint_grid,
            "marconi_evictions_leaf": counters.evictions_leaf,
            "marconi_evictions_single_child": counters.evictions_single_child,
            "marconi_admissions_skipped_no_slot": admission.skipped_no_slot if admission else 0,
            "marconi_blocked_hit_tokens": f.blocked_tokens,
            "marconi_requests": f.requests,
            "marconi_tuning_failures": int(tuner is not None and tuner.failed is not None),
            "marconi_two_pass_splits": two_pass.splits + two_pass.continuation_splits if two_pass else 0,
            "marconi_two_pass_skipped": two_pass.skipped_other_chunked + two_pass.skipped_unaligned if two_pass else 0,
            "marconi_two_pass_deferred": two_pass.deferred_second_chunked if two_pass else 0,
        }

    def close(self) -> None:
        """Stop tuning once the tuner has observed what it was fed (the choice in force stays); its
        log is kept in `tuner_log`."""
        if self.tuner is not None and self.tuner_log is None:
            tuning, self._tuning = self._tuning, False
            self.tuner_log = self.tuner.close()
            if tuning and self.tuner_log is not None:  # a decision made after the last poll
                self._adopt(self.tuner_log.decisions[-1][1])


def _mamba_type():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.MAMBA


def _states_in_tree(cache) -> int:
    return int(cache.mamba_evictable_size() + cache.mamba_protected_size())
