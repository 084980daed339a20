"""Marconi's figures where operators look: Prometheus gauges beside SGLang's own (with
`--enable-metrics`) and a `marconi` entry in each scheduler's `/server_info` internal state."""

from __future__ import annotations

import logging

log = logging.getLogger("sglang_marconi")

GAUGES = {
    "marconi_token_hit_rate": "Share of input tokens whose prefill the Marconi cache skipped.",
    "marconi_hit_tokens": "Input tokens whose prefill was skipped (the sum of the responses' cached_tokens).",
    "marconi_input_tokens": "Input tokens of the requests released through the Marconi cache.",
    "marconi_prefill_flops_saved": "Prefill FLOPs saved by cache hits (model profile estimate).",
    "marconi_alpha": "Current weight of FLOP efficiency in Marconi's eviction score (0 with SGLang's LRU).",
    "marconi_ssm_states_cached": "SSM states held by the radix tree.",
    "marconi_ssm_states_admitted": "SSM states admitted into the tree (at most two per request: branch and final).",
    "marconi_evictions_leaf": "Evictions of leaves (KV and SSM state freed).",
    "marconi_evictions_single_child": "Evictions of a single-child node's SSM state (KV kept).",
    "marconi_admissions_skipped_no_slot": "Branch SSM states not admitted for lack of a Mamba slot.",
    "marconi_blocked_hit_tokens": "Tokens with a full-KV hit that could not be reused for lack of an SSM state.",
    "marconi_requests": "Requests released through the Marconi cache.",
    "marconi_two_pass_splits": "Prefill chunks ended at a branch position so its SSM state is admitted (two-pass prefill).",
    "marconi_two_pass_skipped": "Branch positions inside a prefill chunk not split at (another request chunked, or off the page grid).",
    "marconi_two_pass_deferred": "New chunked admissions deferred one round because a branch split left a chunked request.",
    "marconi_tuner_requests_fed": "Requests sent to the shadow tuner (sampled sessions).",
    "marconi_tuner_requests_dropped": "Sampled requests dropped because the shadow tuner's channel was full.",
    "marconi_tuner_requests_observed": "Requests the shadow tuner has accounted for (its heartbeat).",
    "marconi_tuning_failures": "1 once the shadow tuner died, stalled or failed (the current choice is kept).",
}
# One sample per eviction choice (label `choice`: "lru", an alpha such as "20", or "seglen:W").
LABELED_GAUGES = {
    "marconi_choice": "1 for the eviction choice in force, 0 for the other candidates.",
    "marconi_shadow_score": "Each candidate's decayed shadow score (prefill FLOPs saved, or hit tokens).",
}
INTERNAL_STATE_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
)


class PrometheusGauges:
    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Gauge  # after SGLang has set PROMETHEUS_MULTIPROC_DIR

        self.labels = labels
        self.gauges = {
            key: Gauge(name=f"sglang:{key}", documentation=doc, labelnames=list(labels), multiprocess_mode="mostrecent")
            for key, doc in GAUGES.items()
        }
        self.by_choice = {
            key: Gauge(name=f"sglang:{key}", documentation=doc, labelnames=[*labels, "choice"],
                       multiprocess_mode="mostrecent")
            for key, doc in LABELED_GAUGES.items()
        }

    def publish(self, figures: dict) -> None:
        for key, gauge in self.gauges.items():
            gauge.labels(**self.labels).set(float(figures[key]))
        scores, current = figures["marconi_shadow_scores"], figures["marconi_choice"]
        for choice in {**scores, current: 0.0}:
            self.by_choice["marconi_choice"].labels(**self.labels, choice=choice).set(float(choice == current))
        for choice, score in scores.items():
            self.by_choice["marconi_shadow_score"].labels(**self.labels, choice=choice).set(score)


def add_marconi_state(result, controller, *args, **kwargs):
    """HookRegistry AFTER hook on the scheduler's internal-state readback (`/server_info`)."""
    cache = getattr(controller.scheduler, "tree_cache", None)
    runtime = getattr(cache, "marconi_runtime", None)
    if runtime is not None:
        result.internal_state["marconi"] = runtime.metrics(cache)
    return result


_hooks_registered = False


def register_hooks() -> None:
    global _hooks_registered
    if _hooks_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(INTERNAL_STATE_TARGET, add_marconi_state, HookType.AFTER)
    _hooks_registered = True
