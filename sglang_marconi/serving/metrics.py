"""Marconi's figures where operators look: Prometheus gauges beside SGLang's own (with
`--enable-metrics`) and a `marconi` entry in each scheduler's `/server_info` internal state.

The gauges follow SGLang's scheduler gauges (`observability/metrics_collector.py`,
`SchedulerMetricsCollector.init_new`):
- the same labels (`scheduler_metric_labels`): model_name, engine_type, tp_rank, pp_rank,
  moe_ep_rank, priority (empty) with priority scheduling, dp_rank with a DP controller, and
  `--extra-metric-labels`; so DP replicas and PP stages each have their own series;
- published only where SGLang publishes its scheduler gauges (`publishes_scheduler_metrics`): the
  stats rank (attention-TP rank 0 and attention-CP rank 0), or every rank with
  `--enable-metrics-for-all-schedulers`;
- at most once per `PUBLISH_INTERVAL_S` (`PrometheusGauges.maybe_publish`), not per request.
  SGLang's own cadence is counted in decode iterations (`--decode-log-interval`, 40) which the
  cache never sees, and SGLang has no wall-clock metrics interval, so ours is 1 s of wall clock
  (publishing only observes: the clock decides nothing in the tree); the idle path publishes what
  a throttled call left unpublished.

A cache on which the `marconi` backend stepped aside for upstream's (`serving/plugin.py`) shows
`{"marconi_eviction_policy": "upstream", "marconi_fallback": why}` in `/server_info` and no gauges.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional

from sglang_marconi.serving.hook_registration import register_once

log = logging.getLogger("sglang_marconi")
PUBLISH_INTERVAL_S = 1.0

GAUGES = {
    "marconi_token_hit_rate": "Share of input tokens whose prefill the Marconi cache skipped.",
    "marconi_hit_tokens": "Input tokens whose prefill was skipped (the sum of the responses' cached_tokens).",
    "marconi_input_tokens": "Input tokens of the requests released through the Marconi cache.",
    "marconi_prefill_flops_saved": "Prefill FLOPs saved by cache hits (model profile estimate).",
    "marconi_alpha": "Weight of FLOP efficiency in Marconi's eviction score (NaN while another rule is in force: LRU, SegLen).",
    "marconi_rule_weight": "Weight of the value column of the eviction rule in force (alpha, or SegLen's weight; 0 for LRU).",
    "marconi_ssm_states_cached": "SSM states held by the radix tree.",
    "marconi_ssm_states_admitted": "Regular SSM states admitted into the tree (per request its branch and final states, and the input-end state of a turn that resumed at one).",
    "marconi_evictions_leaf": "Evictions of leaves (KV and SSM state freed).",
    "marconi_evictions_single_child": "Evictions of a single-child node's SSM state (KV kept).",
    "marconi_evictions_probationary": "Probationary SSM states (kept at the end of an input) evicted, first under Mamba pressure.",
    "marconi_evictions_fallback": "SSM states evicted in upstream's LRU order because no state sat on a node with at most one child.",
    "marconi_probationary_states_cached": "SSM states on probation in the tree now.",
    "marconi_probationary_states_admitted": "SSM states kept on probation at the end of an input, backtrack states included.",
    "marconi_input_end_states_kept": "Input-end SSM states kept as regular ones by turns that resumed at an input end (extra_buffer; their final states go on probation).",
    "marconi_backtrack_states_admitted": "SSM states kept on probation at chunk ends of a long replay, where a request that comes back to an earlier point lands (--marconi-backtrack-states).",
    "marconi_admissions_skipped_no_slot": "Branch SSM states not admitted for lack of a Mamba slot.",
    "marconi_branch_tokens_lost_to_grid": "Tokens between branch positions and the admitted branch states before them (extra_buffer snapshot grid, chunk alignment).",
    "marconi_blocked_hit_tokens": "Tokens with a full-KV hit that could not be reused for lack of an SSM state.",
    "marconi_requests": "Requests released through the Marconi cache.",
    "marconi_two_pass_splits": "Prefill chunks ended at a branch position so its SSM state is admitted (two-pass prefill).",
    "marconi_two_pass_skipped": "Branch positions inside a prefill chunk not split at (another request chunked, or off the page grid).",
    "marconi_two_pass_deferred": "New chunked admissions deferred one round because a branch split left a chunked request.",
    "marconi_tuner_requests_fed": "Requests sent to the shadow tuner (sampled sessions).",
    "marconi_tuner_requests_dropped": "Sampled requests not sent to the shadow tuner because they exceed its channel (a full channel waits).",
    "marconi_tuner_requests_observed": "Requests the shadow tuner has accounted for (its heartbeat).",
    "marconi_tuning_failures": "1 once tuning stopped: the leader's shadow tuner died, stalled or failed (the current choice is kept).",
    "marconi_choice_switches": "Eviction choices adopted since start-up (the same on every rank of a TP/PP group, at the same point of the stream).",
    "marconi_sync_points": "Sync points passed: every --marconi-tune-sync-every releases, where the leader's tuner decides.",
    "marconi_sync_waits_late": "Sync points where the tuner's verdict was not ready within --marconi-tune-sync-wait-ms (taken later).",
    "marconi_sync_wait_seconds": "Time the scheduler spent waiting for the tuner at sync points.",
    "marconi_directives_applied": "Directives of the group's leader (choice switches, stop tuning) applied on this rank.",
    "marconi_faults_recovered": "Faults in Marconi's eviction index recovered by rebuilding it from the tree.",
    "marconi_rank_local_failures": "Rank-local Marconi features (tuning, metrics) stopped by a failure on this rank.",
    "marconi_speculative_num_draft_tokens": "Draft tokens per verify of speculative decoding (0: off); /server_info names the algorithm (marconi_speculative).",
    "marconi_speculative_final_states_skipped": "Finished requests SGLang left out of the tree (KV and state): their last verify accepted tokens past the stop, so their state covers tokens no request sends again (speculative decoding).",
    "marconi_device_hit_tokens": "Hit tokens of released requests found on the device (HiCache write_back).",
    "marconi_host_hit_tokens": "Hit tokens of released requests loaded back from the host tier (HiCache write_back).",
    "marconi_host_states_demoted": "SSM states demoted to the host tier as they left the device.",
    "marconi_host_states_dropped": "SSM states that left the device with no host copy (ranked below the host's candidates, or stateless leaves' none).",
    "marconi_host_kv_tokens_demoted": "KV tokens copied to the host tier as they left the device.",
    "marconi_host_drops": "Device leaves dropped on both tiers by Marconi's tier rule.",
    "marconi_host_evictions": "Host-tier candidates evicted (lowest recency + alpha x FLOPs saved per byte first) to make room on the host.",
    "marconi_host_states_evicted": "SSM states among the host-tier evictions.",
    "marconi_host_states_loaded_back": "SSM states loaded back from the host tier on a hit.",
    "marconi_host_kv_tokens_loaded_back": "KV tokens loaded back from the host tier on a hit.",
}
# The gauges of a sliding-window (SWA) cache (`swa_runtime.SWARuntime.metrics`): the SSM ones that
# apply, and what its window eviction does.
SWA_GAUGES = {
    **{key: GAUGES[key] for key in (
        "marconi_token_hit_rate", "marconi_hit_tokens", "marconi_input_tokens", "marconi_alpha", "marconi_rule_weight",
        "marconi_evictions_leaf", "marconi_evictions_fallback", "marconi_requests", "marconi_tuner_requests_fed",
        "marconi_tuner_requests_dropped", "marconi_tuner_requests_observed", "marconi_tuning_failures",
        "marconi_choice_switches", "marconi_sync_points", "marconi_sync_waits_late", "marconi_sync_wait_seconds",
        "marconi_directives_applied", "marconi_faults_recovered", "marconi_rank_local_failures")},
    "marconi_evictions_window": "A branch point's SWA window tombstoned (its full KV kept) by Marconi's window eviction.",
    "marconi_evictions_stale": "SWA KV in no reuse point's window (no hit can read it) tombstoned, first under SWA pressure.",
    "marconi_sliding_window": "The sliding window (tokens) Marconi's window eviction keeps before each reuse point.",
}
# One sample per eviction choice (label `choice`: "lru", an alpha such as "20", or "seglen:W").
LABELED_GAUGES = {
    "marconi_choice": "1 for the eviction choice in force, 0 for the other candidates.",
    "marconi_shadow_score": "Each candidate's decayed shadow score (prefill FLOPs saved, or hit tokens).",
}
INTERNAL_STATE_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
)


def scheduler_metric_labels(served_model_name: Optional[str] = None) -> dict:
    """The labels SGLang puts on its scheduler gauges, for this process
    (`SchedulerMetricsCollector.init_new`)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_disagg, get_observability, get_parallel, get_schedule, get_serving

    parallel = get_parallel()
    engine_type = ("dynamic" if get_disagg().enable_pd_role_switch
                   else DisaggregationMode.to_engine_type(get_disagg().disaggregation_mode))
    labels = {
        "model_name": get_serving().served_model_name or served_model_name,
        "engine_type": engine_type,
        "tp_rank": parallel.tp_rank,
        "pp_rank": parallel.pp_rank,
        "moe_ep_rank": parallel.moe_ep_rank,
    }
    if get_schedule().enable_priority_scheduling:
        labels["priority"] = ""
    if parallel.dp_rank is not None:
        labels["dp_rank"] = parallel.dp_rank
    if get_observability().extra_metric_labels:
        labels.update(get_observability().extra_metric_labels)
    return labels


def publishes_scheduler_metrics() -> bool:
    """Whether SGLang publishes its scheduler gauges from this process: `--enable-metrics` on the
    stats rank (attention-TP and attention-CP rank 0), or on every rank with
    `--enable-metrics-for-all-schedulers` (as `SchedulerMetricsCollector` decides it)."""
    from sglang.srt.runtime_context import get_observability, get_parallel

    observability, parallel = get_observability(), get_parallel()
    if not observability.enable_metrics:
        return False
    stats_rank = parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0
    return stats_rank or bool(observability.enable_metrics_for_all_schedulers)


_GAUGES: dict = {}  # name -> (labelnames, Gauge): prometheus_client's registry is per process


def _gauge(key: str, doc: str, labelnames: tuple):
    from prometheus_client import Gauge  # after SGLang has set PROMETHEUS_MULTIPROC_DIR

    name = f"sglang:{key}"
    known = _GAUGES.get(name)
    if known is not None:
        if known[0] != labelnames:
            raise ValueError(f"{name} already exists with labels {known[0]}, not {labelnames}")
        return known[1]
    gauge = Gauge(name=name, documentation=doc, labelnames=list(labelnames), multiprocess_mode="mostrecent")
    _GAUGES[name] = (labelnames, gauge)
    return gauge


class PrometheusGauges:
    """Marconi's gauges under `labels` (SGLang's scheduler labels). `maybe_publish` is the
    throttled entry point; `publish` sets every gauge now."""

    def __init__(self, labels: dict, interval_s: float = PUBLISH_INTERVAL_S, gauges: dict = GAUGES):
        self.labels = {k: str(v) for k, v in labels.items()}
        self.interval_s = interval_s
        self.last_publish: Optional[float] = None  # time.monotonic() of the last publish
        self.pending = False  # a throttled call left figures unpublished
        self.publishes = 0
        self.gauges = {key: _gauge(key, doc, tuple(labels)) for key, doc in gauges.items()}
        self.by_choice = {key: _gauge(key, doc, (*labels, "choice")) for key, doc in LABELED_GAUGES.items()}

    def maybe_publish(self, figures_fn: Callable[[], dict], now: Optional[float] = None, *,
                      idle: bool = False) -> bool:
        """Publish `figures_fn()` if `interval_s` has passed since the last publish (or nothing
        was ever published); with `idle` (the scheduler's idle path), also whatever an earlier
        throttled call left unpublished. Returns whether it published. `figures_fn` is only
        called when publishing."""
        now = time.monotonic() if now is None else now
        last = self.last_publish
        if last is not None and now - last < self.interval_s and not (idle and self.pending):
            if not idle:
                self.pending = True
            return False
        self.publish(figures_fn())
        self.last_publish = now
        self.pending = False
        return True

    def publish(self, figures: dict) -> None:
        self.publishes += 1
        for key, gauge in self.gauges.items():
            value = figures[key]
            gauge.labels(**self.labels).set(math.nan if value is None else float(value))
        scores, current = figures["marconi_shadow_scores"], figures["marconi_choice"]
        for choice in {**scores, current: 0.0}:
            self.by_choice["marconi_choice"].labels(**self.labels, choice=choice).set(float(choice == current))
        for choice, score in scores.items():
            self.by_choice["marconi_shadow_score"].labels(**self.labels, choice=choice).set(score)


SERVER_INFO = "server_info"  # the rank-local feature a failing readback reports (faults.py)


def add_marconi_state(result, controller, *args, **kwargs):
    """HookRegistry AFTER hook on the scheduler's internal-state readback (`/server_info`).
    Rank-local (`faults.py`): a failure in Marconi's figures costs them in this readback (one
    warning; the entry says why); SGLang's own readback and the tree are untouched."""
    cache = getattr(controller.scheduler, "tree_cache", None)
    runtime = getattr(cache, "marconi_runtime", None)
    if runtime is not None:
        result.internal_state["marconi"] = _marconi_figures(runtime, cache)
    elif getattr(cache, "marconi_fallback", None):  # the backend stepped aside (plugin.py)
        result.internal_state["marconi"] = {"marconi_eviction_policy": "upstream",
                                            "marconi_fallback": cache.marconi_fallback}
    return result


def hint_figures(cache) -> dict:
    """Client cache hints (`cache_hints.py`) in `/server_info`: credits granted, refused (no room
    in the share), lapsed (aged out), moved (the key's next turn), in force, and what those in force
    are charged (KV tokens, states). Empty where hints are off (`--marconi-hinted-share 0`)."""
    hints = getattr(getattr(cache, "marconi", None), "hints", None)
    if hints is None:
        return {}
    ledger, counters = hints.ledger, hints.ledger.counters
    return {"marconi_hint_credits_granted": counters.granted, "marconi_hint_credits_refused": counters.refused,
            "marconi_hint_credits_lapsed": counters.expired, "marconi_hint_credits_moved": counters.replaced,
            "marconi_hint_credits_in_force": len(ledger), "marconi_hinted_kv_tokens": ledger.kv_charged,
            "marconi_hinted_states": ledger.states_charged, "marconi_hints_stopped": hints.broken}


def _marconi_figures(runtime, cache) -> dict:
    try:
        return {**runtime.metrics(cache), **hint_figures(cache)}
    except Exception as exc:  # tried again at the next readback (on demand: its cost is the caller's)
        faults = runtime.faults
        faults.rank_local(SERVER_INFO, "the /server_info readback", exc, stops=False)
        in_force = "marconi-swa" if hasattr(runtime, "swa_figures") else "marconi"  # (SWARuntime's name)
        return {"marconi_eviction_policy": "upstream" if faults.fallen_back is not None else in_force,
                **({"marconi_fault": faults.fallen_back} if faults.fallen_back is not None else {}),
                "marconi_figures_error": f"{type(exc).__name__}: {exc}"}


def register_hooks() -> None:
    """The `/server_info` readback, and the idle path (`idle_hook.py`: the tuner's partial batch,
    gauges published while idle)."""
    from sglang_marconi.serving.idle_hook import ON_IDLE_TARGET, before_on_idle

    register_once(__name__, ((INTERNAL_STATE_TARGET, add_marconi_state, "after"),
                             (ON_IDLE_TARGET, before_on_idle, "before")))
