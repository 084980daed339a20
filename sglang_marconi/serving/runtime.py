"""Per-scheduler Marconi state: the figures the metrics report, and online tuning of the eviction
choice by shadow caches (`policy/tuning/shadow_tuner.py`).

The cache (`serving/cache.py`) reports matches, evictions and releases here. With `--marconi-alpha
auto` every finished request is fed to the shadow tuner, which runs in a background process
(`background_tuner.py`) on the group's leader; with `tune_workers=0` the shadows run inline on
the scheduler thread (tests, debugging).

Sync points: every `sync_every` releases. There the leader takes the tuner's choice *as of the
previous sync point* (waiting for the tuner at most `sync_wait_s`, counted in
`marconi_sync_waits_late`; a late verdict keeps the choice in force and is taken at a later sync
point) and, where it changes something, sends a `lockstep.Directive`: a rank alone applies it at
once; in a TP / PP group it travels with the next iteration's requests and every rank applies it at
the same point of its stream (`group_channel.py`). No rank ever waits on another. What the tuner is
fed (`tuner_session_key`, `shadow_tuner.tuner_reads`) and which record a sync point takes
(`shadow_tuner.sync_point_of`, `record_adopted_at`, `ServedTuning`) are the functions the
simulator's model of this runtime calls too.

What fails here never touches the tree (`faults.py`, rank-local): the tuner feed and the idle
flush stop tuning (the leader tells the group), the figures and the exporter stop the metrics.
Per-request figures live in `req.marconi`, so a request released by any path (abort, retraction,
PD transfer) leaves nothing behind here.

The shadows are the model of the served cache (`policy/tree/served_cache.py`) on what the live cache was
given (`served_pools`: the KV pool's tokens and the Mamba pool's slots, scaled by the sample rate,
the Mamba strategy, chunked prefill): at sample rate 1 the shadow of the choice in force predicts
the live cache's hits request by request (`scripts/check_sim_vs_served.py --shadows`). Their
choices include the depth-aware ones (`shadow_tuner.served_config`): each shadow, and the live cache
on every rank, records finished sequences from the first request (`live_record_for`). Under
`--enable-unified-memory` (or pages > 1, or upstream's admission), which the model does not cover,
they run the policy core's budgets instead (`shadow_budget`: the one byte budget both kinds share).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.tuning.shadow_tuner import Choice, live_record_for, record_adopted_at, sync_point_of
from sglang_marconi.policy.tuning.tuner_spec import TunerSpec
from sglang_marconi.serving.cache_state import request_state
from sglang_marconi.serving.lockstep import Directive, GroupChannel, LocalChannel, RankGroup

log = logging.getLogger("sglang_marconi")
TUNING, METRICS = "tuning", "metrics"  # the rank-local features a failure can stop


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
    # Speculative decoding: finished requests whose last verify accepted tokens past their stop, so
    # the state in their slot covers tokens nobody will send again: SGLang caches none of them.
    speculative_final_states_skipped: int = 0


class InlineShadowTuner:
    """The tuner on the caller's thread, with `BackgroundShadowTuner`'s interface."""

    failed = None
    dropped = 0
    late = 0

    def __init__(self, spec, *, sync_every: int = 32):
        from sglang_marconi.policy.tuning.shadow_tuner import ServedTuning

        self.tuner = spec.build()
        self.choices = spec.choices
        self.fed = 0
        self._tuning = ServedTuning(self.tuner, sync_every)

    def observe(self, session_key: str, input_ids, output_ids) -> None:
        self.fed += 1
        self._tuning.feed(session_key, np.asarray(input_ids, dtype=np.int64), np.asarray(output_ids, dtype=np.int64))

    def mark_sync(self) -> None:
        pass

    def flush_idle(self) -> None:
        pass

    def choice_at(self, k: int, wait_s: float | None = None) -> Choice | None:
        return self._tuning.take(k)

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
        self.settings = settings
        self.faults = settings.faults
        self.profile = settings.profile
        self.config = config
        self.checkpoint_grid = checkpoint_grid
        self.group = group if group is not None else RankGroup()
        self.sync_every = config.tune_sync_every
        self.sync_wait_s = config.tune_sync_wait_s
        self.figures = ServingFigures()
        self.cache = cache
        self.exporter = None  # PrometheusGauges when SGLang runs with --enable-metrics
        self.tuner = None
        self.tuner_log = None  # the tuner's log, once closed
        self.released = 0  # releases seen: the stream position sync points are counted in
        self.tuning_failed: str | None = None  # why the group stopped tuning
        self.sync_waits_late = 0  # sync points where the tuner's verdict was not ready in time
        self.sync_wait_s_total = 0.0  # time spent waiting for the tuner at sync points
        self.directives_applied = 0
        self._tuning = config.fixed_choice is None
        self._sent = 0  # directives sent (the leader)
        # What the leader's sent directives will have made of the group once they arrive: a sync
        # point compares the tuner's verdict with this, not with the choice in force, so a directive
        # still on its way is not sent again.
        self._sent_choice = None
        self._stop_sent = False
        self.adoptions: list[tuple[int, Choice]] = []  # (releases seen, choice adopted then)
        self.ranks = _parallel_ranks()  # which scheduler this is, for /server_info
        self.speculative = speculative_settings()  # (algorithm, draft tokens) or None
        self.channel = LocalChannel(self.apply) if self.group.single else GroupChannel(self.apply)
        self.faults.on_fall_back = self._on_fall_back
        self.faults.position = lambda: self.released  # the recovery bound counts in releases
        if self._tuning:
            self.choices = self.tuner_spec(cache).choices
            self.settings.choice = self.tuner_spec(cache).start
            # every rank's cache, which may adopt a depth choice, records the stream from its first request
            self.settings.continuation = live_record_for(self.choices)
            if self.group.is_leader:
                self.tuner = self._start_tuner(cache)

    def tuner_spec(self, cache) -> TunerSpec:
        """The shadow tuner over hybrid caches, modelling this cache's pools, grid and probation."""
        capacity, state_slots = shadow_budget(cache, self.profile)
        return TunerSpec("hybrid", self.profile, capacity, self.config.tuning(), dict(
            state_slots=state_slots, checkpoint_grid=self.checkpoint_grid, page_size=cache.page_size,
            probation=bool(self.settings.probation), served=served_pools(cache, self.config)))

    def _start_tuner(self, cache):
        spec = self.tuner_spec(cache)
        if self.config.tune_workers == 0:
            return InlineShadowTuner(spec, sync_every=self.sync_every)
        from sglang_marconi.serving.background_tuner import BackgroundShadowTuner

        return BackgroundShadowTuner(spec, stall_s=self.config.tune_timeout_s, sync_every=self.sync_every,
                                     put_wait_s=self.sync_wait_s)

    @property
    def choice(self) -> Choice:
        return self.settings.choice

    @property
    def alpha(self) -> float:
        return self.settings.alpha

    @property
    def faulted(self) -> str | None:
        return self.faults.fallen_back

    @property
    def tuning(self) -> bool:
        return self._tuning

    # -- the cache's reports (rank-local: figures only) ----------------------------------------
    def report(self, where: str, fn, *args) -> None:
        """Run one of the cache's reports; a failure stops the figures on this rank, never more."""
        if self.faults.stopped(METRICS):
            return
        try:
            fn(*args)
        except Exception as exc:
            self.faults.rank_local(METRICS, where, exc)

    def on_match(self, req, full_kv_hit: int) -> None:
        # A waiting request is matched again at each scheduling round; the last match is the
        # one its prefill used. Kept on the request: it goes when the request goes.
        request_state(req).full_kv_hit = full_kv_hit

    def on_evict(self, tokens: int, states: int) -> None:
        self.figures.evicted_tokens += tokens
        self.figures.evicted_states += states

    def on_release(self, req) -> None:
        """A request released into the tree (or, under speculative decoding, a finished request
        SGLang kept out of it: `speculative_skip`). Its prefix whose prefill was skipped is what
        SGLang reports (`req.cached_tokens`)."""
        self.report("on_release", self._account, req)
        self._feed_tuner(req)
        self.released += 1
        k = sync_point_of(self.released, self.sync_every)
        if k is not None:
            self._sync_point(k)
        self._publish()

    def _account(self, req) -> None:
        n = len(req.origin_input_ids)
        hit = req.cached_tokens
        state = req.__dict__.get("marconi")
        full_kv_hit = state.full_kv_hit if state is not None else 0
        f = self.figures
        f.requests += 1
        if self.speculative and speculative_skip(req):
            f.speculative_final_states_skipped += 1
        f.input_tokens += n
        f.hit_tokens += hit
        f.blocked_tokens += max(0, min(full_kv_hit, n - 1) - hit)
        f.flops_total += self.profile.prefill_flops(0, n)
        f.flops_saved += self.profile.prefill_flops(0, hit)

    def _feed_tuner(self, req) -> None:
        tuner = self.tuner
        if tuner is None or not self._tuning or tuner.failed is not None or self.faults.stopped(TUNING):
            return
        try:
            # SGLang caches input + output[:-1]: the last decoded token was never fed back (no KV).
            tuner.observe(tuner_session_key(req), req.origin_input_ids, req.output_ids[:-1])
        except Exception as exc:
            self._tuner_broke("the tuner feed", exc)

    def on_idle(self) -> None:
        """The scheduler has nothing to run: hand the tuner what is batched, publish the gauges."""
        tuner = self.tuner
        if tuner is not None and self._tuning and tuner.failed is None and not self.faults.stopped(TUNING):
            try:
                tuner.flush_idle()
            except Exception as exc:
                self._tuner_broke("the tuner's idle flush", exc)
        self._publish(idle=True)

    def _tuner_broke(self, where: str, exc: BaseException) -> None:
        """Rank-local: tuning stops (the leader's next sync point tells the group); the tree and
        the choice in force are untouched."""
        self.faults.rank_local(TUNING, where, exc)
        try:
            self.tuner.stop()
        except Exception:  # noqa: BLE001 - stopping is best effort: the feed is already off
            pass

    # -- sync points -----------------------------------------------------------------------------
    def _sync_point(self, k: int) -> None:
        """Sync point k (release k * sync_every), which adopts the tuner's record
        `record_adopted_at(k)`. Only the leader's tuner decides; the decision reaches every rank
        as a directive."""
        tuner = self.tuner
        if tuner is None or not self._tuning:
            return
        why = self.faults.rank_local_failures.get(TUNING)
        decided = None
        if why is None and tuner.failed is None:
            started = time.monotonic()
            try:
                tuner.mark_sync()
                decided = tuner.choice_at(record_adopted_at(k), wait_s=self.sync_wait_s)
            except Exception as exc:
                self._tuner_broke("the tuner at a sync point", exc)
                why = self.faults.rank_local_failures.get(TUNING)
            self.sync_wait_s_total += time.monotonic() - started
        if why is None and tuner.failed is not None:
            why = tuner.failed
        if why is not None:
            if not self._stop_sent:
                self._stop_sent = True
                self._send(Directive(self._sent, stop_tuning=why))
            return
        if decided is None:
            self.sync_waits_late += 1  # not ready in time: the choice in force stays for now
            return
        if decided != (self.choice if self._sent_choice is None else self._sent_choice) and not self._stop_sent:
            self._sent_choice = decided
            self._stop_sent = not self.config.retune
            self._send(Directive(self._sent, choice=tuner.choices.index(decided),
                                 stop_tuning="" if not self.config.retune else None))

    def _send(self, directive: Directive) -> None:
        self._sent += 1
        self.channel.send(directive)

    def apply(self, directive: Directive) -> None:
        """A directive from the leader, at the same point of the stream on every rank."""
        self.directives_applied += 1
        if not self._tuning:
            return
        if directive.choice is not None:
            chosen = self.choices[directive.choice]
            if chosen != self.choice:
                self.settings.choice = chosen
                self.adoptions.append((self.released, chosen))
        if directive.stop_tuning is not None:  # "" : retune off, the first decision is final
            self._stop_tuning(directive.stop_tuning or None)

    def _stop_tuning(self, why: str | None) -> None:
        if not self._tuning:
            return
        self._tuning = False
        if why is not None:
            self.tuning_failed = why
        if self.tuner is not None:
            try:
                self.tuner.stop()
            except Exception:  # noqa: BLE001 - the feed is off either way
                pass

    def _on_fall_back(self, why: str) -> None:
        """A rank alone fell back to upstream's rules after an unrecoverable fault: no more tuning."""
        self._stop_tuning(None)

    # -- metrics (rank-local) --------------------------------------------------------------------
    def _publish(self, idle: bool = False) -> None:
        exporter = self.exporter
        if exporter is None or self.faults.stopped(METRICS):
            return
        # At most once per metrics interval (the stats rank only builds an exporter); the idle
        # path publishes what a throttled call left unpublished.
        try:
            exporter.maybe_publish(lambda: self.metrics(self.cache), idle=idle)
        except Exception as exc:
            self.faults.rank_local(METRICS, "the metrics exporter", exc)

    def metrics(self, cache) -> dict:
        """The figures `/server_info` and the Prometheus gauges show."""
        f = self.figures
        state = cache.marconi
        admission, two_pass, counters = state.admission, state.two_pass, self.settings.counters
        tuner = self.tuner
        flop_rule = self.settings.kind == "flops"
        return {
            "marconi_token_hit_rate": f.hit_tokens / f.input_tokens if f.input_tokens else 0.0,
            "marconi_hit_tokens": f.hit_tokens,
            "marconi_input_tokens": f.input_tokens,
            "marconi_prefill_flops_saved": f.flops_saved,
            "marconi_prefill_flops_saved_fraction": f.flops_saved / f.flops_total if f.flops_total else 0.0,
            "marconi_alpha": self.settings.weight if flop_rule else None,
            "marconi_rule_weight": self.settings.weight,
            "marconi_eviction_policy": "upstream" if self.faulted is not None else
            ("marconi" if flop_rule else self.settings.kind),
            "marconi_choice": self.settings.label,
            "marconi_shadow_scores": tuner.scores() if tuner is not None else {},
            "marconi_ssm_states_cached": _states_in_tree(cache),
            "marconi_ssm_states_admitted": (admission.final_states_admitted + admission.branch_states_admitted
                                            + admission.input_end_states_kept),
            "marconi_input_end_states_kept": admission.input_end_states_kept,
            "marconi_checkpoint_grid": self.checkpoint_grid,
            "marconi_evictions_leaf": counters.evictions_leaf,
            "marconi_evictions_single_child": counters.evictions_single_child,
            "marconi_evictions_probationary": counters.evictions_probationary,
            "marconi_evictions_fallback": counters.evictions_fallback,
            "marconi_probationary_states_admitted": admission.probationary_admitted,
            "marconi_backtrack_states_admitted": admission.backtrack_admitted,
            "marconi_probationary_states_cached": len(state.probation),
            "marconi_admissions_skipped_no_slot": admission.skipped_no_slot,
            "marconi_branch_tokens_lost_to_grid": admission.grid_lost_tokens,
            "marconi_blocked_hit_tokens": f.blocked_tokens,
            "marconi_requests": f.requests,
            **self.tuning_figures(),
            "marconi_directives_sent": self._sent,  # the leader's; a directive is lost if they part
            "marconi_two_pass_splits": two_pass.splits + two_pass.continuation_splits,
            "marconi_two_pass_skipped": two_pass.skipped_other_chunked + two_pass.skipped_unaligned,
            "marconi_two_pass_deferred": two_pass.deferred_second_chunked,
            "marconi_speculative": self.speculative[0] if self.speculative else None,
            "marconi_speculative_num_draft_tokens": self.speculative[1] if self.speculative else 0,
            "marconi_speculative_final_states_skipped": f.speculative_final_states_skipped,
            "marconi_device_hit_tokens": counters.device_hit_tokens,
            "marconi_host_hit_tokens": counters.host_hit_tokens,
            "marconi_host_states_demoted": counters.states_demoted,
            "marconi_host_states_dropped": counters.states_dropped,
            "marconi_host_kv_tokens_demoted": counters.kv_tokens_demoted,
            "marconi_host_drops": counters.host_drops,
            "marconi_host_evictions": counters.host_evictions,
            "marconi_host_states_evicted": counters.states_evicted_host,
            "marconi_host_states_loaded_back": counters.states_loaded_back,
            "marconi_host_kv_tokens_loaded_back": counters.kv_tokens_loaded_back,
        }

    def tuning_figures(self) -> dict:
        """The tuner's, the sync points' and the fault figures: one set for SSM and SWA runtimes."""
        tuner = self.tuner
        return {
            "marconi_tuner_requests_fed": tuner.fed if tuner is not None else 0,
            "marconi_tuner_requests_dropped": tuner.dropped if tuner is not None else 0,
            "marconi_tuner_requests_observed": tuner.observed if tuner is not None else 0,
            "marconi_tuning_failures": int(self.tuning_failed is not None or self.faults.stopped(TUNING)
                                           or (tuner is not None and tuner.failed is not None)),
            "marconi_choice_switches": len(self.adoptions),
            **self.ranks,
            "marconi_sync_points": self.released // self.sync_every,
            "marconi_sync_waits_late": self.sync_waits_late,
            "marconi_sync_wait_seconds": self.sync_wait_s_total,
            "marconi_directives_applied": self.directives_applied,
            **self.faults.figures(),
        }

    def close(self) -> None:
        """Stop tuning once the tuner has observed what it was fed; its log is kept in `tuner_log`.
        A lone rank adopts the tuner's last decision (made after the last sync point); a group
        keeps the choice it agreed on."""
        if self.tuner is not None and self.tuner_log is None:
            tuning, self._tuning = self._tuning, False
            self.tuner_log = self.tuner.close()
            if (tuning and self.group.single and self.tuner_log is not None and self.faulted is None
                    and self.tuner_log.decisions):  # (the window tuner logs switches only: maybe none)
                self.settings.choice = self.tuner_log.decisions[-1][1]


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


SPEC_FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens")


def speculative_settings():
    """(algorithm, draft tokens per verify) of this server's speculative decoding (SGLang's
    runtime context), or None without it, or outside a server (no server args published: a cache
    built alone). Read strictly: whether a speculative request SGLang keeps out of the tree counts
    as a release (so where sync points fall) depends on it, so a name SGLang no longer publishes
    stops start-up with one line naming it instead of silently reading "off"."""
    from sglang_marconi.policy.errors import MarconiError

    try:
        from sglang.srt.runtime_context import get_context, get_spec
    except ImportError as exc:
        raise MarconiError(f"speculative settings: sglang.srt.runtime_context has no get_context/get_spec ({exc})") from None
    context = get_context()
    if not context.is_config_namespace_published("spec"):
        if not context.is_config_namespace_published("memory"):
            return None  # no server args published at all
        raise MarconiError("speculative settings: SGLang's runtime context publishes no 'spec' namespace")
    spec = get_spec()
    missing = [name for name in SPEC_FIELDS if not _has_leaf(spec, name)]
    if missing:
        raise MarconiError(f"speculative settings: SGLang's 'spec' namespace has no {', '.join(missing)}")
    algorithm = spec.speculative_algorithm
    if not algorithm:
        return None
    return str(algorithm).upper(), int(spec.speculative_num_draft_tokens or 0)


def _has_leaf(bag, name: str) -> bool:
    try:
        getattr(bag, name)
    except AttributeError:  # SGLang's config bags raise it for a name they do not hold
        return False
    return True


def speculative_skip(req) -> bool:
    """A finished request SGLang keeps out of the tree under speculative decoding: its last verify
    accepted a run of tokens past the stop (`owned_kv_len() < kv_committed_len`, SGLang's
    `_mamba_can_cache_finished_req`), so the state in its slot, which cannot be shortened, covers
    tokens the client never sees. Neither SGLang nor Marconi caches any of it."""
    return bool(getattr(req, "skip_radix_cache_insert", False)) and req.finished()


def tuner_session_key(req) -> str:
    """What the tuner samples and clusters a request by: the session the client named
    (`session_id` of SGLang's generate and OpenAI requests), else the request alone (its rid).
    The simulator keys by the trace's sessions: it models clients that name them."""
    return str(req.session_id or req.rid)


def _states_in_tree(cache) -> int:
    return int(cache.mamba_evictable_size() + cache.mamba_protected_size())


def served_pools(cache, config):
    """What the live cache was given, as the model of the served cache takes it
    (`policy.served_cache.ServedPools`): the whole KV pool and Mamba pool, the Mamba strategy, the
    chunked prefill size and snapshot grids. The shadows run that model, which holds what the running
    request holds as SGLang does, one request at a time: the pools are not reduced for it. None where
    the model does not apply (one byte budget, pages of more than one token, upstream's admission):
    the shadows then run `shadow_budget`'s budgets."""
    from sglang_marconi.policy.tree.served_cache import EXTRA_BUFFER, NO_BUFFER, ServedPools

    allocator = cache.token_to_kv_pool_allocator
    pool = cache.req_to_token_pool
    if (getattr(allocator, "unified_buffer", None) is not None or cache.page_size != 1 or not config.admission
            or getattr(pool, "mamba_pool", None) is None):
        return None
    from sglang.srt.runtime_context import get_schedule, mamba_track_grid

    mamba = next(c for c in cache.components.values() if getattr(c, "marconi_exact_branch", False))
    extra = bool(cache.enable_mamba_extra_buffer)
    chunk = get_schedule().chunked_prefill_size
    return ServedPools(
        int(allocator.size), int(pool.mamba_pool.size), EXTRA_BUFFER if extra else NO_BUFFER,
        chunk if chunk and chunk > 0 else None, int(mamba.mamba_cache_chunk_size), int(mamba_track_grid(cache.page_size)),
        int(pool.mamba_initial_tracking_slots) if extra else 2, config.backtrack_states)


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
