"""The scheduler's idle path, for the Marconi runtime: a HookRegistry BEFORE hook on
`Scheduler.on_idle` (called by every event loop, normal, overlap and PP, when there is no batch to
run) hands the shadow tuner its partial batch and publishes the gauges, so an idle server neither
holds requests back from the tuner nor shows stale figures. BEFORE, not AFTER: `on_idle` ends in
`maybe_sleep_on_idle`, which may sleep until the next request. It changes nothing in the tree."""

from __future__ import annotations

ON_IDLE_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"  # registered by metrics.register_hooks


def before_on_idle(scheduler, *args, **kwargs):
    runtime = getattr(getattr(scheduler, "tree_cache", None), "marconi_runtime", None)
    if runtime is not None:
        runtime.on_idle()  # guarded inside: a fault there costs a warning, never the scheduler
    return None  # the arguments unchanged
