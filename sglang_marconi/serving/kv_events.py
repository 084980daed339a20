"""Where a prefix is really reusable, on SGLang's KV-event stream (`--kv-events-config`).

SGLang publishes full-KV blocks only (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`). For a
hybrid model a cached prefix is reusable only up to the deepest point of it that also holds an
SSM state, and Marconi keeps few states on purpose, so a router that believes the block events
expects hits that are not there. With the `marconi` backend every publishing scheduler (one per
DP rank: SGLang's own per-rank publishers, `is_kv_publisher_rank`) adds, on the same publisher:

- `MarconiStateStored{schema_version, block_hash, num_tokens, medium}`: the prefix ending at the
  block `block_hash` (the hash SGLang's `BlockStored` published for the last block of that
  prefix; same namespacing) is reusable: full KV *and* an SSM state, `num_tokens` tokens long;
- `MarconiStateRemoved{...}` (same fields): it is not any more (state evicted, tombstoned, or its
  node deleted; `AllBlocksCleared` clears every state too).

Encoding: msgspec tagged maps, exactly as SGLang's `KVCacheEvent` (`type` = class name, `None`
fields omitted), inside SGLang's `KVEventBatch` (`[ts, events, attn_dp_rank]`). Marconi's events
travel in batches of their own, never mixed with SGLang's: a subscriber that decodes with
SGLang's typed `KVEventBatch` (SGLang, smg's servicers) rejects a batch holding an unknown tag
*whole*, so a mixed batch would cost it block events; separate batches cost it only the Marconi
batch, which those decoders log and skip. `SGLANG_MARCONI_KV_STATE_EVENTS=off` publishes SGLang's
events alone. Each publish step sends SGLang's block batch first, then Marconi's batch
(removals before stores), both describing the tree at the same moment.

`schema_version` (`SCHEMA_VERSION`) changes only when a field's meaning changes; added optional
fields keep it. A subscriber rebuilds the view with `serving/kv_event_view.py`.

How: after SGLang's `SchedulerKvEventsPublisher.publish_kv_events` (a hook), the nodes holding a
device Mamba state (SGLang's Mamba LRU list, so O(states), not O(tree)) are diffed by node id
(ids are never reused) against what was published. A fault here costs one warning and stops
state events on that scheduler (`/server_info`: `marconi_kv_events.fault`), never the server.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import msgspec

from sglang_marconi.serving.hook_registration import register_once

log = logging.getLogger("sglang_marconi")

SCHEMA_VERSION = 1
GPU = "GPU"  # SGLang's StorageMedium.GPU value: only device states are reusable without a load
SWITCH_ENV = "SGLANG_MARCONI_KV_STATE_EVENTS"  # on (default) | off
DEBUG_ENV = "SGLANG_MARCONI_KV_EVENTS_DEBUG"  # 1: /server_info lists the tree's reusable points
PUBLISH_TARGET = (
    "sglang.srt.managers.scheduler_components.kv_events_publisher.SchedulerKvEventsPublisher.publish_kv_events"
)
STATE_TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_env_vars"
)


class MarconiStateEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of Marconi's events: SGLang's `KVCacheEvent` encoding (tagged map, class name as `type`)."""

    schema_version: int
    block_hash: int
    num_tokens: int
    medium: Optional[str] = GPU


class MarconiStateStored(MarconiStateEvent):
    pass


class MarconiStateRemoved(MarconiStateEvent):
    pass


EVENT_TAGS = ("MarconiStateStored", "MarconiStateRemoved")


def state_events_enabled(env=None) -> bool:
    value = (env if env is not None else os.environ).get(SWITCH_ENV, "on").strip().lower()
    if value not in ("on", "off", "1", "0", "true", "false"):
        raise ValueError(f"{SWITCH_ENV}={value!r}: expected on or off")
    return value in ("on", "1", "true")


def _mamba():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.MAMBA


def reusable_point(cache, node) -> tuple[int, int]:
    """(block_hash, num_tokens) of the prefix ending at `node`: the hash SGLang's recorder
    published for the node's last block (`KVCacheEventRecorder.record_store`), and its depth."""
    from sglang.srt.disaggregation.kv_events import namespaced_block_hash
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    recorder = cache.tree_core.kv_events
    hashes = recorder._node_event_hash_values(node)
    block_hash = namespaced_block_hash(hash_str_to_int64(hashes[-1]), namespace_seed=recorder._namespace_seed(node))
    depth, walk = 0, node
    while walk.parent is not None:
        depth += len(walk.key)
        walk = walk.parent
    return block_hash, depth


def state_nodes(cache) -> dict:
    """node id -> node, for every node holding a device Mamba state (SGLang's Mamba LRU list)."""
    return cache.tree_core.lru_lists[_mamba()].cache


def tree_reusable_points(cache) -> dict[int, int]:
    """block_hash -> num_tokens of every reusable point, by a walk of the whole tree (device full
    KV and a Mamba state on the node): the reference the events are checked against."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    points, stack = {}, list(cache.tree_core.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        data = node.component_data
        if data[ComponentType.FULL].value is not None and data[ComponentType.MAMBA].value is not None:
            block_hash, depth = reusable_point(cache, node)
            points[block_hash] = depth
    return points


class ReusablePointTracker:
    """What was published for one cache: node id -> (block_hash, num_tokens)."""

    def __init__(self):
        self.published: dict[int, tuple[int, int]] = {}
        self.fault: Optional[str] = None
        self.batches = 0

    def take(self, cache) -> list[MarconiStateEvent]:
        """The events that bring a subscriber from the last call's tree to this one: removals
        first (a state re-created on another node at the same prefix is removed, then stored)."""
        current = state_nodes(cache)
        gone = sorted(self.published.keys() - current.keys())
        new = sorted(current.keys() - self.published.keys())
        events: list[MarconiStateEvent] = []
        for node_id in gone:
            block_hash, depth = self.published.pop(node_id)
            events.append(MarconiStateRemoved(SCHEMA_VERSION, block_hash, depth))
        for node_id in new:
            block_hash, depth = reusable_point(cache, current[node_id])
            self.published[node_id] = (block_hash, depth)
            events.append(MarconiStateStored(SCHEMA_VERSION, block_hash, depth))
        return events

    def figures(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "states_published": len(self.published),
                "batches": self.batches, "fault": self.fault}


def tracker_of(cache) -> Optional[ReusablePointTracker]:
    """The cache's tracker (made on first use), or None where Marconi is not the cache's backend
    (no runtime: upstream's cache or a fallback) or state events are switched off."""
    state = getattr(cache, "marconi", None)
    if state is None or state.runtime is None:
        return None
    tracker = state.kv_state_events
    if tracker is None:
        if not state_events_enabled():
            return None
        tracker = state.kv_state_events = ReusablePointTracker()
    return tracker


def publish_state_events(result, publisher, *args, **kwargs):
    """AFTER hook on `SchedulerKvEventsPublisher.publish_kv_events`: SGLang's block batch has
    just been published; publish the state changes since the last step as a batch of their own."""
    if not publisher.enable_kv_cache_events:
        return result
    cache = publisher.tree_cache
    try:
        tracker = tracker_of(cache)
        if tracker is None or tracker.fault is not None:
            return result
        events = tracker.take(cache)
        if events:
            from sglang.srt.disaggregation.kv_events import KVEventBatch

            publisher.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))
            tracker.batches += 1
    except Exception as exc:  # an event fault must never reach the scheduler
        why = f"{type(exc).__name__}: {exc}"
        log.warning("Marconi: SSM-state KV events stopped on this scheduler (%s); block events go on", why)
        state = getattr(cache, "marconi", None)
        if state is not None:
            if state.kv_state_events is None:
                state.kv_state_events = ReusablePointTracker()
            state.kv_state_events.fault = why
    return result


def add_kv_events_state(result, controller, state, *args, **kwargs):
    """AFTER hook on the internal-state readback (`/server_info`): `marconi_kv_events` figures,
    and with SGLANG_MARCONI_KV_EVENTS_DEBUG=1 the tree's reusable points (a whole-tree walk)."""
    cache = getattr(controller.scheduler, "tree_cache", None)
    marconi = getattr(cache, "marconi", None)
    if marconi is None or marconi.runtime is None:
        return result
    try:  # rank-local (faults.py): a readback must not fail the scheduler
        tracker = marconi.kv_state_events
        entry = tracker.figures() if tracker is not None else {"schema_version": SCHEMA_VERSION, "states_published": 0}
        if os.environ.get(DEBUG_ENV) == "1":
            try:
                entry["reusable_points"] = sorted([h, n] for h, n in tree_reusable_points(cache).items())
            except Exception as exc:
                entry["reusable_points_error"] = f"{type(exc).__name__}: {exc}"
        entry["dp_rank"] = _dp_rank()
    except Exception as exc:
        marconi.faults.rank_local("kv_events readback", "the /server_info marconi_kv_events readback", exc,
                                  stops=False)
        entry = {"schema_version": SCHEMA_VERSION, "readback_error": f"{type(exc).__name__}: {exc}"}
    state["marconi_kv_events"] = entry
    return result


def _dp_rank() -> int:
    # The rank SGLang offsets this scheduler's publisher port by (`select_kv_publisher_dp_rank`).
    from sglang.srt.disaggregation.kv_events import select_kv_publisher_dp_rank
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return select_kv_publisher_dp_rank(parallel.attn_dp_size, parallel.attn_dp_rank, parallel.dp_rank)


def install_hooks() -> None:
    """Register and apply both hooks (idempotent; in the scheduler process that builds a Marconi
    cache, before its publisher runs)."""
    register_once(__name__, ((PUBLISH_TARGET, publish_state_events, "after"),
                             (STATE_TARGET, add_kv_events_state, "after")), apply=True)
