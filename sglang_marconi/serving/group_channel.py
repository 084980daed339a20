"""Directives travel with the requests (`lockstep.Directive`): two HookRegistry hooks on SGLang's
scheduler, no collective of our own.

- AFTER `Scheduler._poll_timeout_aborts`: SGLang calls it once per iteration on the rank that
  reads the tokenizer (PP stage 0, attention-TP rank 0, attention-CP rank 0: our group's leader),
  and its result, `local_reqs`, rides the same broadcast as the requests: across the TP group, or
  with DP attention across the attention TP x CP group that shares one waiting queue (the
  channel scoped to one tree). Stage 0 relays the whole list to the next PP stage. Copies of
  the leader's pending directives are appended there, at every poll until they come back: when
  SGLang skips a receive (`--scheduler-recv-interval` > 1, `SchedulerRequestReceiver.
  recv_requests` returns before the broadcast) the poll's list is dropped, and the next poll
  hands the same directives out again.
- BEFORE `Scheduler.process_input_requests`: on every rank, directives are taken out of the list
  (SGLang's dispatcher does not know them) and applied in order, each once (a copy already
  applied is ignored). The leader processes the list the broadcast hands back to it too: that is
  where a directive leaves its outbox (`lockstep.GroupChannel`). The caller keeps its own list,
  directives included, which is what a PP stage relays onward.

Every rank therefore applies a directive at the same iteration, before that iteration's requests
and batch, whatever each rank's pace. A scheduler whose cache is not Marconi's never sees one.
"""

from __future__ import annotations

import logging

from sglang_marconi.serving.hook_registration import register_once
from sglang_marconi.serving.lockstep import Directive

log = logging.getLogger("sglang_marconi")

POLL_TARGET = "sglang.srt.managers.scheduler.Scheduler._poll_timeout_aborts"
PROCESS_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_input_requests"


def _runtime(scheduler):
    return getattr(getattr(scheduler, "tree_cache", None), "marconi_runtime", None)


def after_poll_timeout_aborts(result, scheduler, *args, **kwargs):
    runtime = _runtime(scheduler)
    channel = getattr(runtime, "channel", None)
    if channel is None:
        return result
    directives = channel.drain()
    return [*(result or []), *directives] if directives else result


def before_process_input_requests(scheduler, recv_reqs, *args, **kwargs):
    if not recv_reqs or not any(isinstance(r, Directive) for r in recv_reqs):
        return None
    runtime = _runtime(scheduler)
    channel = getattr(runtime, "channel", None)
    kept = []
    for req in recv_reqs:
        if not isinstance(req, Directive):
            kept.append(req)
        elif channel is not None and hasattr(channel, "receive"):
            before = channel.applied
            channel.receive(req)
            if channel.applied != before:
                # One line per directive and rank (SGLang prefixes the rank): where the group
                # applied it can be compared rank by rank.
                log.info("Marconi directive %d applied at iteration %s after %s releases", req.seq,
                         getattr(scheduler, "forward_ct", None), getattr(runtime, "released", None))
    return (scheduler, kept, *args), kwargs


def register_hooks() -> None:
    register_once(__name__, ((POLL_TARGET, after_poll_timeout_aborts, "after"),
                             (PROCESS_TARGET, before_process_input_requests, "before")))
