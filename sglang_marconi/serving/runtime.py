"""Per-scheduler Marconi state: the figures the metrics report, and online tuning of the eviction
choice by shadow caches (`policy/shadow_tuner.py`).

The cache (`serving/cache.py`) reports matches, evictions and releases here. With `--marconi-alpha
auto` every finished request is fed to the shadow tuner, which runs in a background process
(`background_tuner.py`) on the group's first rank; with `tune_workers=0` the shadows run inline on
the scheduler thread (for tests and debugging).

Lockstep: every `sync_every` releases is a sync point. There the runtime adopts the tuner's choice
*as of the previous sync point* (so the choice in force at every request is a function of the
request stream alone, whatever the tuner's pace), and the ranks that share one scheduling agree
on it, on any rank's tuner failure and on any Marconi fault (`lockstep.RankGroup`): nothing that
changes the tree happens between sync points, and every rank changes it at the same one.

Per-request bookkeeping lives on SGLang's `Req` (`marconi_full_kv_hit`), so a request released
by any path (abort, retraction, PD transfer) leaves nothing behind here.

The shadows model SGLang's two pools: KV tokens (the KV pool's size) and SSM states (the Mamba
pool's slots), each scaled by the sample rate; under `--enable-unified-memory`, the one byte
budget both kinds share (`shadow_budget`).
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

    def __init__(self, profile, capacity_bytes, config, *, sync_every: int = 32, **kwargs):
        from sglang_marconi.serving.background_tuner import SyncRecorder

        kwargs.pop("stall_s", None)
        self.tuner = ShadowTuner(profile, capacity_bytes, config, **kwargs)
        self.choices = self.tuner.choices
        self.fed = 0
        self._table: dict[int, int] = {}
        self._recorder = SyncRecorder(self.tuner, sync_every, self._table.__setitem__)
        self._recorder.advance(0)

    def observe(self, session_key: str, input_ids, output_ids) -> None:
        self.fed += 1
        self.tuner.observe(session_key, np.asarray(input_ids, dtype=np.int64), np.asarray(output_ids, dtype=np.int64))
        self._recorder.advance(self.tuner.log.requests)

    def mark_sync(self) -> None:
        pass

    def flush_idle(self) -> None:
        pass

    def choice_at(self, k: int) -> Choice:
        choice = self.choices[self._table.pop(k)]
        for old in [j for j in self._table if j < k]:
            del self._table[old]
        return choice

    @property
    def observed(self) -> int:
        return self.tuner.log.requests

    @property
    def leading(self) -> Choice:
        return self.tuner.current

    def scores(self) -> dict[str, float]:
        return self.tuner.score_table()

    def stop(self) -> None:
        pass

    def close(self, timeout: float = 0.0):
        return self.tuner.log


class MarconiRuntime:
    def __init__(self, cache, settings, config, checkpoint_grid: int, group=None):
        from sglang_marconi.serving.lockstep import RankGroup

        self.settings = settings
        self.profile = settings.profile
        self.config = config
        self.checkpoint_grid = checkpoint_grid
        self.group = group if group is not None else RankGroup()
        self.sync_every = config.tune_sync_every
        self.figures = ServingFigures()
        self.cache = cache
        self.exporter = None  # PrometheusGauges when SGLang runs with --enable-metrics
        self.tuner = None
        self.tuner_log = None  # the tuner's log, once closed
        self.released = 0  # releases seen: the stream position sync points are counted in
        self.tuning_failed: str | None = None  # why the group stopped tuning (any rank's tuner failed)
        self._tuning = config.alpha is None
        self._syncing = self._tuning or not self.group.single  # a group agrees on faults even without tuning
        self.adoptions: list[tuple[int, Choice]] = []  # (requests released, choice adopted then)
        self.ranks = _parallel_ranks()  # which scheduler this is, for /server_info
        settings.on_fault = self._on_fault
        if self._tuning:
            self._adopt(config.tuning().start)
            if self.group.is_leader:
                self.tuner = self._start_tuner(cache)

    def _start_tuner(self, cache):
        capacity, state_slots = shadow_budget(cache, self.profile)
        kwargs = dict(state_slots=state_slots, checkpoint_grid=self.checkpoint_grid,
                      page_size=cache.page_size, sync_every=self.sync_every,
                      probation=bool(self.settings.probation))
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

    @property
    def faulted(self) -> str | None:
        return getattr(self.settings, "faulted", None)

    def _adopt(self, choice: Choice) -> None:
        s = self.settings
        if choice == LRU:
            s.use_upstream_lru = True
            return
        eviction = eviction_for(choice)  # the weight and the kind of value column it ranks by
        s.use_upstream_lru = False
        s.value_kind = "seglen" if isinstance(eviction, SegLenEviction) else "flops"
        s.alpha = eviction.alpha

    # -- the cache's reports -----------------------------------------------------------------
    def on_match(self, req, full_kv_hit: int) -> None:
        # A waiting request is matched again at each scheduling round; the last match is the
        # one its prefill used. Kept on the request: it goes when the request goes.
        req.marconi_full_kv_hit = full_kv_hit

    def on_evict(self, tokens: int, states: int) -> None:
        self.figures.evicted_tokens += tokens
        self.figures.evicted_states += states

    def on_release(self, req) -> None:
        """A request released into the tree. Its prefix whose prefill was skipped is what SGLang
        reports (`req.cached_tokens`)."""
        try:
            self._account(req)
            if self.tuner is not None and self._tuning and self.tuner.failed is None:
                # SGLang caches input + output[:-1]: the last decoded token was never fed back (no KV).
                self.tuner.observe(str(req.session_id or req.rid), req.origin_input_ids, req.output_ids[:-1])
        except Exception as exc:  # never the scheduler: fall back (the group follows at the sync point)
            self._fault("release", exc)
        self.released += 1
        if self._syncing and self.released % self.sync_every == 0:
            self._sync(self.released // self.sync_every)
        self._publish()

    def _account(self, req) -> None:
        n = len(req.origin_input_ids)
        hit = req.cached_tokens
        f = self.figures
        f.requests += 1
        f.input_tokens += n
        f.hit_tokens += hit
        f.blocked_tokens += max(0, min(getattr(req, "marconi_full_kv_hit", 0), n - 1) - hit)
        f.flops_total += self.profile.prefill_flops(0, n)
        f.flops_saved += self.profile.prefill_flops(0, hit)

    def on_idle(self) -> None:
        """The scheduler has nothing to run: hand the tuner what is batched, publish the gauges."""
        try:
            if self.tuner is not None and self._tuning and self.tuner.failed is None:
                self.tuner.flush_idle()
            self._publish(idle=True)
        except Exception as exc:
            self._fault("idle", exc)

    # -- sync points -------------------------------------------------------------------------
    def _sync(self, k: int) -> None:
        """Sync point k (release k * sync_every), at the same request on every rank."""
        choice, failed = -1, False
        tuner = self.tuner
        if tuner is not None and self._tuning:
            try:
                tuner.mark_sync()
                decided = tuner.choice_at(k - 1) if tuner.failed is None else None
                failed = tuner.failed is not None or decided is None
                if not failed:
                    choice = tuner.choices.index(decided)
            except Exception as exc:
                self._fault("tuner", exc)
                failed = True
        try:
            agreed = self.group.agree(choice, failed, self.faulted is not None)
        except Exception as exc:  # the group itself is broken: this rank can only fall back alone
            self._syncing = False
            return self._fault("rank group", exc)
        if agreed.faulted:
            if self.faulted is None:
                self._fault("another rank of the group", RuntimeError("Marconi faulted there"))
            self._stop_tuning("a Marconi fault")
            self._syncing = False  # nothing left to agree on: every rank stops here
            return
        if agreed.tuner_failed and self._tuning:
            why = tuner.failed if tuner is not None and tuner.failed else "the group's shadow tuner failed"
            return self._stop_tuning(why)
        if self._tuning and agreed.choice >= 0:
            chosen = self.config.tuning().choices[agreed.choice]
            if chosen != self.choice:
                self._adopt(chosen)
                self.adoptions.append((self.figures.requests, chosen))
                if not self.config.retune:  # the paper tunes once: stop here
                    self._stop_tuning(None)

    def _stop_tuning(self, why: str | None) -> None:
        if not self._tuning:
            return
        self._tuning = False
        if why is not None:
            self.tuning_failed = why
        if self.tuner is not None:
            self.tuner.stop()
        self._syncing = not self.group.single and self.faulted is None

    # -- faults --------------------------------------------------------------------------------
    def _fault(self, where: str, exc: BaseException) -> None:
        fault = getattr(self.settings, "fault", None)
        if fault is not None:
            fault(where, exc)
        else:  # settings without the fault protocol: warn once here
            if getattr(self.settings, "faulted", None) is None:
                self.settings.faulted = f"{where}: {type(exc).__name__}: {exc}"
                log.warning("Marconi fault in %s (%s: %s); falling back to upstream's eviction", where,
                            type(exc).__name__, exc)
            self._on_fault()

    def _on_fault(self, *args) -> None:
        """Called once by the settings on the first fault: no more tuning on this rank (the group
        stops at the next sync point)."""
        if self.tuner is not None and self._tuning:
            self.tuner.stop()

    def _publish(self, idle: bool = False) -> None:
        exporter = self.exporter
        if exporter is None:
            return
        # At most once per metrics interval (the stats rank only builds an exporter); the idle
        # path publishes what a throttled call left unpublished.
        exporter.maybe_publish(lambda: self.metrics(self.cache), idle=idle)

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
            "marconi_eviction_policy": "upstream" if self.faulted is not None else
            "lru" if self.settings.use_upstream_lru else ("seglen" if self.settings.value_kind == "seglen" else "marconi"),
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
            "marconi_evictions_probationary": counters.evictions_probationary,
            "marconi_probationary_states_admitted": admission.probationary_admitted if admission else 0,
            "marconi_admissions_skipped_no_slot": admission.skipped_no_slot if admission else 0,
            "marconi_branch_tokens_lost_to_grid": admission.grid_lost_tokens if admission else 0,
            "marconi_blocked_hit_tokens": f.blocked_tokens,
            "marconi_requests": f.requests,
            "marconi_tuning_failures": int(self.tuning_failed is not None or (tuner is not None and tuner.failed is not None)),
            "marconi_choice_switches": len(self.adoptions),
            **self.ranks,
            "marconi_sync_points": self.released // self.sync_every,
            "marconi_two_pass_splits": two_pass.splits + two_pass.continuation_splits if two_pass else 0,
            "marconi_two_pass_skipped": two_pass.skipped_other_chunked + two_pass.skipped_unaligned if two_pass else 0,
            "marconi_two_pass_deferred": two_pass.deferred_second_chunked if two_pass else 0,
        }

    def close(self) -> None:
        """Stop tuning once the tuner has observed what it was fed; its log is kept in `tuner_log`.
        A lone rank adopts the tuner's last decision (made after the last sync point); a group
        keeps the choice it agreed on."""
        if self.tuner is not None and self.tuner_log is None:
            tuning, self._tuning = self._tuning, False
            self.tuner_log = self.tuner.close()
            if tuning and self.group.single and self.tuner_log is not None and self.faulted is None:
                self._adopt(self.tuner_log.decisions[-1][1])


def _parallel_ranks() -> dict:
    """marconi_tp_rank / _pp_rank / _dp_rank of this scheduler (SGLang's runtime context), or {}
    outside a server (tests that build the cache alone)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        ranks = {"marconi_tp_rank": parallel.tp_rank, "marconi_pp_rank": parallel.pp_rank,
                 "marconi_dp_rank": parallel.dp_rank}
    except Exception:  # noqa: BLE001 - no server context: nothing to label
        return {}
    return {k: v for k, v in ranks.items() if isinstance(v, int)}


def _mamba_type():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.MAMBA


def _states_in_tree(cache) -> int:
    return int(cache.mamba_evictable_size() + cache.mamba_protected_size())


def shadow_budget(cache, profile) -> tuple[int, int | None]:
    """(capacity_bytes, state_slots) of the shadow caches, in the profile's bytes. Two pools: the
    KV pool's tokens and the Mamba pool's slots. One byte budget (`--enable-unified-memory`: full
    KV and Mamba states carved from one buffer, SGLang's `UnifiedMambaTokenToKVPoolAllocator`):
    the whole buffer, measured as the KV tokens it holds when it holds nothing else (`size_full`),
    and no slot count, so the shadows trade KV for states byte for byte as the server does."""
    allocator = cache.token_to_kv_pool_allocator
    if getattr(allocator, "unified_buffer", None) is not None:
        return max(1, int(allocator.size_full * profile.kv_bytes_per_token)), None
    return max(1, int(allocator.size * profile.kv_bytes_per_token)), cache.req_to_token_pool.mamba_pool.size
