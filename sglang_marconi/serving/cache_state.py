"""Marconi's state kept beside SGLang's objects: one `MarconiCacheState` per cache
(`cache.marconi`) and one `MarconiRequestState` per request (`req.marconi`, created on first use;
it goes when the request goes, whatever path releases it). SGLang's nodes carry two recorded
facts (`tree_index.py`); nothing else of ours lives on SGLang's objects.

The walk context (`EvictionWalk`): SGLang's eviction walks take no parameters of ours, so what a
walk may take is carried by the `EvictParams` the caller passes (`marconi_evict_params`), and the
cache exposes it to its components for that call only (`MarconiCacheState.walk`): a walk that may
take probationary states only, or one that funds a Mamba byte shortfall under one byte budget.
Engine-free but for `marconi_evict_params`, which builds SGLang's `EvictParams` subclass lazily.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_marconi.policy.rules.probation import ProbationRegistry


@dataclass
class MarconiRequestState:
    full_kv_hit: int = 0  # the latest match's full-KV hit (a waiting request is matched again each round)
    branch_cut: Optional[int] = None  # two-pass prefill: chunk cut below an unaligned branch here
    probation_node: Any = None  # the node its input-end state went to on probation
    declined: bool = False  # its last checkpoint admitted no state (keep its tracked state)
    probationary_insert: bool = False  # the insert in progress carries a probationary state
    input_end_insert: bool = False  # the insert in progress is its input-end checkpoint's
    resumed_input_end: bool = False  # its match reused an input-end state (`rules/input_end_resume.py`)


def request_state(req) -> MarconiRequestState:
    state = req.__dict__.get("marconi")
    if state is None:
        state = req.marconi = MarconiRequestState()
    return state


@dataclass(frozen=True)
class EvictionWalk:
    """What one eviction call may take."""
    probation_only: bool = False  # probationary states only (a probationary state's own room)
    byte_budget: bool = False  # one byte budget short of Mamba bytes: victims of either kind


ANY_WALK = EvictionWalk()


@dataclass
class AdmissionCounters:
    branch_states_admitted: int = 0
    final_states_admitted: int = 0
    checkpoints_declined: int = 0  # per-chunk / decode checkpoints that Marconi keeps out
    skipped_no_slot: int = 0  # branch states dropped because no Mamba slot could be had
    grid_lost_tokens: int = 0  # sum over admitted branch states of branch position - admitted position
    probationary_admitted: int = 0  # states kept on probation at the end of an input, backtrack states included
    backtrack_admitted: int = 0  # backtrack states kept on probation at chunk ends (`rules/backtrack_states.py`)
    input_end_states_kept: int = 0  # input-end states kept as regular ones (`rules/input_end_resume.py`)


@dataclass
class TwoPassCounters:
    splits: int = 0  # new requests whose extend was ended at their branch
    continuation_splits: int = 0  # continuing chunked requests ended at their branch
    skipped_other_chunked: int = 0  # branch inside the extend, but another request is chunked
    skipped_unaligned: int = 0  # branch not on the page / truncation grid, and no aligned cut before it
    aligned_below: int = 0  # branch not on the page / truncation grid: cut at the last aligned position
    deferred_second_chunked: int = 0  # a new chunked admission refused: one is chunked already


@dataclass
class MarconiCacheState:
    """Everything Marconi keeps for one SGLang cache."""

    settings: Any  # MarconiEvictionSettings: the rule in force, counters, faults
    index: Any = None  # MarconiTreeIndex (SSM hybrids)
    probation: ProbationRegistry = field(default_factory=ProbationRegistry)
    admission: AdmissionCounters = field(default_factory=AdmissionCounters)
    two_pass: TwoPassCounters = field(default_factory=TwoPassCounters)
    runtime: Any = None  # MarconiRuntime / SWARuntime: figures, tuning, lockstep
    config: Any = None  # MarconiServingConfig
    eager_index_upkeep: bool = True  # re-evaluate after each checkpoint and release (admission on)
    walk: EvictionWalk = ANY_WALK  # the eviction call in progress (see the module docstring)
    kv_state_events: Any = None  # kv_events.ReusablePointTracker, made on first publish
    host_tier: Any = None  # host_tier.ServedHostTier, with HiCache write_back (`attach_host_tier`)

    @property
    def faults(self):
        return self.settings.faults

    @contextlib.contextmanager
    def walking(self, walk: EvictionWalk):
        outer, self.walk = self.walk, walk
        try:
            yield
        finally:
            self.walk = outer

    def on_reset(self) -> None:
        """The tree was cleared: nothing of it is probationary or indexed any more."""
        self.probation.clear()
        if self.index is not None:
            self.index.invalidate()


def cache_state(cache) -> Optional[MarconiCacheState]:
    return getattr(cache, "marconi", None)


@functools.cache
def _evict_params_class():
    import dataclasses

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    @dataclasses.dataclass
    class MarconiEvictParams(EvictParams):
        """SGLang's EvictParams with what the walk may take (`EvictionWalk`)."""
        marconi_walk: EvictionWalk = ANY_WALK

    return MarconiEvictParams


def marconi_evict_params(*, num_tokens: int = 0, mamba_num: int = 0, walk: EvictionWalk = ANY_WALK):
    return _evict_params_class()(num_tokens=num_tokens, mamba_num=mamba_num, marconi_walk=walk)


def walk_of(params) -> EvictionWalk:
    return getattr(params, "marconi_walk", ANY_WALK)
