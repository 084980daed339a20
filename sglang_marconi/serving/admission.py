"""Marconi's admission inside SGLang's MAMBA component (paper §4.1).

A request may leave at most two SSM states in the tree:
- the state after its last decoded token (the finished request's own slot, donated as upstream does;
  in extra_buffer mode the request's last tracked state, as upstream picks it);
- the state at its branch point: the position where speculative insertion of its input leaves
  the cached tree. Marconi's match reports it exactly (`req.mamba_branching_seqlen` = the full-KV
  match, on the page grid), where upstream floors it to the Mamba checkpoint grid (64 tokens).
Every other checkpoint (per prefill chunk, after the first token, every N decoded tokens in
extra_buffer mode) keeps its KV with the request and admits no state. When no Mamba slot can be
had for the branch state, the state is skipped and counted, never a failure.

Where the branch state comes from depends on SGLang's Mamba radix-cache strategy:
- no_buffer: a state exists only at the end of an extend, so two-pass prefill
  (`two_pass_prefill.py`) ends a chunk at the branch and the state there is admitted: exact,
  whatever the grid. Only where the scheduler cannot end a chunk there (a page / truncation
  alignment) is the chunk ended at the last aligned position before it and that state admitted.
- extra_buffer: the forward pass snapshots one state per extend, `prefix + k * chunk` tokens in
  (k >= 1; SGLang's `mamba_cache_chunk_size`, 64), into a ping-pong track slot. The extend that
  contains the branch is steered (`two_pass_prefill`'s tracking hook) to snapshot the last such
  position at or before the branch, which is the branch itself when it sits on that grid. A
  checkpoint admits its tracked state when it is at or before the branch and no later extend can
  snapshot one closer (they start at the checkpoint's end and snapshot a chunk or more in): the
  latest tracked state before the branch, never fewer than upstream keeps there. Where the input
  goes on `branch_grid.INPUT_END_STEPS` steps or more past the branch, two-pass prefill ends the
  extend that snapshots the branch at it, so the input's last extend has a snapshot of its own.
The tokens between the branch and the admitted state are counted (`grid_lost_tokens`).

Probation (`--marconi-probation on`, the default): a prefix that recurs exactly twice in a row (a
request, then one that extends its input) has no branch state at its second use, so Marconi alone
would first hit it at the third, where upstream (a state at every extend's end) hits at the second.
So the checkpoint at the end of a request's input (its last prefill extend) also admits the state
it offers, as a *probationary* state: only into a free Mamba slot or one freed from another
probationary state, evicted before any other state under Mamba pressure (oldest first), and
confirmed (a regular state from then on) by a match that reuses it or a regular state committed
on its node (`policy/rules/probation.ProbationRegistry`). In extra_buffer mode a last extend shorter
than a snapshot step snapshots nothing, so the checkpoint before it offers the input's end state
(`branch_grid.snapshot_carries_to_input_end`): its snapshot is not taken as a backtrack state.
Its room is reserved by an eviction call that may take probationary states only
(`EvictionWalk.probation_only`, carried by the `EvictParams` it passes): under one byte budget too,
where it must not take KV bytes, it never displaces a regular state or a KV leaf. In extra_buffer
mode the state offered there is the extend's last snapshot; a request that tracks none after it (a
decode shorter than the snapshot grid) has no other final state, so at finish that one is confirmed
as its final state. The policy core's `HybridPrefixCache(probation=True)` models the same, and the
runtime's shadow caches run with it.

Turns that resume at an input-end state (`policy/rules/input_end_resume.py`, extra_buffer, with
probation): a reasoning model whose template drops the reasoning leaves each next turn where the
previous input ended. The match marks a request whose reused state was inserted at an input's end
(`node._marconi_input_end`, set when the state is committed); such a request keeps its own
input-end state as a regular state and inserts its final state on probation.

Backtrack states (`policy/rules/backtrack_states.py`, with probation): a request that replays a long
stretch also keeps, on probation, up to B states at the chunk ends its prefill checkpoints anyway,
spaced to cut the stretch into near-equal FLOP parts, never more states than upstream keeps for it;
B from the serving config's `extra["backtrack_states"]` (0: off), by default the rule's default for
the strategy (3 in extra_buffer, off in no_buffer), as the served-pools model's
(`ServedPools.backtrack_states`) is. In extra_buffer a match does not resume at a backtrack state on
probation less than a snapshot step before where its input leaves the tree
(`backtrack_states.bars_resume`: from there the branch state could never be snapshotted): the cache
calls `marconi_before_match` with the match's key, which finds those states on its path, and this
component's match validator refuses them for that match.

Faults: admission has no state derived from the tree to rebuild, so an exception in its code is
unrecoverable (`faults.py`): a rank alone takes upstream's admission from then on, a rank of a group
stops the group. Per-request data lives in `req.marconi` (`cache_state.MarconiRequestState`).

The class is built lazily (`admission_mixin()`) so importing this module needs no SGLang.
"""

from __future__ import annotations

from sglang_marconi.policy.rules import branch_grid, input_end_resume
from sglang_marconi.policy.rules.backtrack_states import BacktrackMarks, backtrack_rule_of, default_setting
from sglang_marconi.serving.cache_state import EvictionWalk, marconi_evict_params, request_state


def branch_position(req) -> int | None:
    """The branch checkpoint this request should leave, if any (set at match time)."""
    return getattr(req, "mamba_branching_seqlen", None)


def ends_input(req, checkpoint_end: int) -> bool:
    """Is this checkpoint the request's last prefill extend (the one that ends at its input)?"""
    return checkpoint_end == len(req.origin_input_ids)


def chunk_end_for_branch(req, proposed_end: int, snapshot_step: int | None = None) -> int:
    """Two-pass prefill: where to end the prefill chunk [req.prefix_len, proposed_end) so that the
    branch's state is checkpointed exactly (`policy.branch_grid.chunk_end`, the rule the simulator's
    model of this cache calls too).

    no_buffer (`snapshot_step` None): a state exists only at an extend's end, so the chunk that
    would run past the branch ends at it.

    extra_buffer (`snapshot_step`: SGLang's snapshot grid, 64): the forward pass snapshots states
    only a whole number of steps into an extend (`start + k * step`, k >= 1), so an extend that
    starts at the hit rarely has one at the branch. The chunk is ended where the next extend starts
    a whole number of steps before the branch: at `branch - step` when that extend would reach the
    branch, else `step`-aligned with it, below the proposed end; where the input goes on
    `INPUT_END_STEPS` steps or more past the branch, the extend that then snapshots the branch ends
    at it, so that the last one snapshots near the input's end. The chunk count grows by at most two
    (less where the prompt is chunked anyway). Impossible when the branch is less than one step past
    the hit (no extend can start between them): the end stays, and the latest snapshot before the
    branch is taken instead (`tracked_position_for_branch`)."""
    return branch_grid.chunk_end(branch_position(req), req.prefix_len, proposed_end, snapshot_step,
                                 len(req.origin_input_ids))


def tracked_position_for_branch(req, step: int) -> int | None:
    """extra_buffer mode: the position the extend [req.prefix_len, req.extend_end) should snapshot
    for the branch: the last `prefix + k * step` (k >= 1) at or before it, or None when the branch
    is not inside this extend or no such position is (the snapshot then stays upstream's)."""
    return branch_grid.tracked_position(branch_position(req), req.prefix_len, req.extend_end, step)


def free_mamba_slots(allocator) -> int:
    """Slots a new state can take now: a free slot id and, under one byte budget, its bytes
    (`schedulable_available_size`; the same count for a pool of fixed slots)."""
    schedulable = getattr(allocator, "schedulable_available_size", allocator.available_size)
    return min(allocator.available_size(), schedulable())


_PROBATION_ONLY = EvictionWalk(probation_only=True)


class BacktrackRecord:
    """One request's states offered to the tree, for the backtrack rule (`req.marconi_backtrack`)."""

    __slots__ = ("resumed_at", "taken", "offered", "inserting", "probation_before")

    def __init__(self, resumed_at: int):
        self.resumed_at = resumed_at  # the state its match reused (what the tree owned before any insert)
        self.taken = 0  # backtrack states offered
        self.offered = 0  # states of any kind its checkpoints offered
        self.inserting = None  # the insert in progress carries a probationary state: a backtrack one?
        self.probation_before = None  # the request's probationary node before that insert


def backtrack_record(req) -> BacktrackRecord:
    """The request's record, made at its first checkpoint (before it inserted anything)."""
    record = req.__dict__.get("marconi_backtrack")
    if record is None:
        record = req.marconi_backtrack = BacktrackRecord(req.kv.cache_protected_len)
    return record


def backtrack_setting(config, extra_buffer: bool):
    """The backtrack-states setting a serving config carries (`extra["backtrack_states"]`), else
    the rule's default for the strategy."""
    setting = (getattr(config, "extra", None) or {}).get("backtrack_states")
    return default_setting(extra_buffer) if setting is None else setting


def prefill_chunk() -> int | None:
    """The scheduler's chunked prefill size (None: one extend per prompt)."""
    from sglang.srt.runtime_context import get_schedule

    chunk = get_schedule().chunked_prefill_size
    return chunk if chunk and chunk > 0 else None


def admission_mixin():
    """A mixin for (a subclass of) SGLang's MambaComponent implementing Marconi's admission."""

    class MarconiAdmission:
        marconi_exact_branch = True  # match reports the exact branch (the tracking hook looks for it)

        def __init__(self, cache, params):
            super().__init__(cache, params)
            self._marconi_marks = BacktrackMarks()  # which probationary states are backtrack states
            self._marconi_barred = None  # ids of the states the match in progress may not reuse
            if not params.enable_mamba_extra_buffer:
                # Two-pass prefill ends a chunk at the branch: the branch state sits exactly there,
                # on the page grid only. (The runtime's shadow caches read this grid too.)
                self.mamba_checkpoint_grid = params.page_size

        @property
        def marconi_admission_counters(self):
            return self.marconi.admission

        def marconi_before_match(self, params) -> None:
            """The cache is about to match `params.key`: find the backtrack states on its path that
            the match may not resume at (`BacktrackMarks.bars`), for this component's validator."""
            self._marconi_barred = None
            if not self._marconi_marks or not self._marconi_active() or not self.cache.enable_mamba_extra_buffer:
                return
            try:
                self._marconi_barred = self._marconi_barred_states(params.key)
            except Exception as exc:
                self._unrecoverable("admission (states a match may reuse)", exc)

        def _marconi_barred_states(self, key) -> set:
            core, marks, probation = self.tree_core, self._marconi_marks, self.marconi.probation
            step = self.mamba_cache_chunk_size
            kv_match, node_id, end = core.match_full_device_prefix(key)  # end: the deepest node's
            node, barred = core.node_by_id(node_id), set()
            while node.parent is not None and end > kv_match - step:
                if marks.bars(node, end, kv_match, step, probation):
                    barred.add(node.id)
                end -= len(node.key)
                node = node.parent
            return barred

        def create_match_validator(self, match_device_only: bool = False):
            valid = super().create_match_validator(match_device_only=match_device_only)
            barred = self._marconi_barred
            if not barred:
                return valid
            return lambda node: node.id not in barred and valid(node)

        def finalize_match_result_in_tree_core(self, result, params, value_chunks, best_value_len):
            self._marconi_barred = None  # this match's walk is done
            result = super().finalize_match_result_in_tree_core(result, params, value_chunks, best_value_len)
            if not self._marconi_active():
                return result  # upstream's branch (floored to its checkpoint grid)
            try:
                branch = branch_grid.branch_position(result.full_kv_hit_length,
                                                     result.device_prefix_len + result.host_hit_length,
                                                     self.cache.page_size)
                if params.req is not None:  # the state it resumes at: one kept where an input ended?
                    request_state(params.req).resumed_input_end = self._marconi_input_end_rule() and getattr(
                        result.best_match_node, "_marconi_input_end", False)
                return result._replace(mamba_branching_seqlen=branch)
            except Exception as exc:
                self._unrecoverable("admission (branch position at match)", exc)
                return result

        def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
            counters = self.marconi.admission
            if not self._marconi_active():
                return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
            state = request_state(req)
            insert_params.marconi = state  # the insert's commit hook reads the request's intent
            state.probationary_insert = state.input_end_insert = False
            if is_finished:
                try:
                    self._marconi_final_on_probation(req, state)
                except Exception as exc:
                    self._unrecoverable("admission (final state)", exc)
                cache_len = super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
                # what the insert keeps is the finished sequence the depth rule's record holds
                self._primary("admission (finished sequence recorded)", self.marconi.settings.finished,
                              req.full_untruncated_fill_ids[:token_ids_len], min(token_ids_len, cache_len or 0))
                if cache_len:
                    counters.final_states_admitted += 1
                else:
                    try:  # the probation registry is primary data: a fault is unrecoverable
                        if self._marconi_confirm_own_probationary(state):
                            counters.final_states_admitted += 1
                    except Exception as exc:
                        self._unrecoverable("admission (final state confirmed)", exc)
                return cache_len
            extra_buffer = self.cache.enable_mamba_extra_buffer
            try:
                record = backtrack_record(req)
                position = req.kv.mamba_last_track_seqlen if extra_buffer else token_ids_len
                admits = self._marconi_admits(req, state, position, token_ids_len)
                input_end_kept = not admits and input_end_resume.keeps_input_end_regular(
                    state.resumed_input_end, token_ids_len, len(req.origin_input_ids), position)
                admits = admits or input_end_kept
                state.input_end_insert = input_end_resume.marks_input_end(False, token_ids_len,
                                                                          len(req.origin_input_ids))
                probationary = not admits and self._marconi_probation_admits(req, position, token_ids_len)
                backtrack = (not admits and not probationary
                             and self._marconi_backtrack_admits(req, record, position, token_ids_len))
                reserved = admits and (extra_buffer or self._marconi_reserve_slot())
            except Exception as exc:
                self._unrecoverable("admission (checkpoint)", exc)
                return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
            if probationary or backtrack:
                cache_len = super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
                if cache_len:
                    state.probationary_insert = True
                    record.inserting, record.probation_before = backtrack, state.probation_node
                    record.offered += 1
                    record.taken += backtrack
                    counters.backtrack_admitted += backtrack
                    counters.probationary_admitted += 1  # backtrack states included
                return cache_len
            if not admits:
                counters.checkpoints_declined += 1
                state.declined = True
                return 0
            if not reserved:
                counters.skipped_no_slot += 1
                return 0
            cache_len = super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
            if cache_len:
                record.offered += 1
                if input_end_kept:
                    counters.input_end_states_kept += 1
                else:
                    counters.branch_states_admitted += 1
                    counters.grid_lost_tokens += branch_position(req) - cache_len
            return cache_len

        def _marconi_snapshot_step(self) -> int | None:
            """extra_buffer: the grid the forward pass snapshots states on; no_buffer: None."""
            return self.mamba_cache_chunk_size if self.cache.enable_mamba_extra_buffer else None

        def _marconi_admits(self, req, state, position, checkpoint_end) -> bool:
            """Is the state at `position` (this checkpoint's, ending at `checkpoint_end`) the
            request's branch state? (`policy.branch_grid.admits_branch_state`: in extra_buffer mode
            later extends start at checkpoint_end and snapshot a chunk or more in, so none can land
            in (position, branch] once the branch is less than a chunk beyond it; in no_buffer mode,
            where two-pass prefill ended the chunk for the branch.)"""
            return branch_grid.admits_branch_state(branch_position(req), position, checkpoint_end,
                                                   self._marconi_snapshot_step(), state.branch_cut)

        def _marconi_probation_admits(self, req, position, checkpoint_end) -> bool:
            """Keep the state at the end of the input on probation, if a Mamba slot can be had
            without evicting anything but other probationary states."""
            if not self.marconi.settings.probation or position is None or position <= 0:
                return False
            if not ends_input(req, checkpoint_end):
                return False
            return self._marconi_reserve_slot(probation_only=True)

        def _marconi_backtrack_admits(self, req, record, position, checkpoint_end) -> bool:
            """Keep the state at this chunk end on probation as a backtrack state
            (`policy.rules.backtrack_states`), if a Mamba slot can be had without evicting anything
            but probationary states."""
            rule = self._marconi_backtrack_rule()
            n_in = len(req.origin_input_ids)
            step = self._marconi_snapshot_step()
            if rule is None or checkpoint_end >= n_in \
                    or branch_grid.snapshot_carries_to_input_end(checkpoint_end, n_in, step):
                return False
            if not rule.admits(position, req.kv.cache_protected_len, record.resumed_at, n_in, record.taken,
                               record.offered, prefill_chunk(), self.marconi.settings.profile.prefill_flops):
                return False
            return self._marconi_reserve_slot(probation_only=True)

        def _marconi_input_end_rule(self) -> bool:
            """Does this cache run `policy.rules.input_end_resume` (extra_buffer, with probation)?"""
            return input_end_resume.applies(self.cache.enable_mamba_extra_buffer, self.marconi.settings.probation)

        def _marconi_final_on_probation(self, req, state) -> None:
            """A request that resumed at an input-end state inserts its final state on probation;
            the backtrack marks then learn that state is not a backtrack one (cleanup)."""
            if not input_end_resume.final_on_probation(state.resumed_input_end):
                return
            state.probationary_insert = True
            record = backtrack_record(req)
            record.inserting, record.probation_before = False, state.probation_node

        def _marconi_backtrack_rule(self):
            """The backtrack rule in force: the config's setting, with probation (its states are
            probationary); None when off."""
            rule = self.__dict__.get("_marconi_backtrack")
            if rule is None:
                extra_buffer = self.cache.enable_mamba_extra_buffer
                rule = backtrack_rule_of(backtrack_setting(self.marconi.config, extra_buffer)) \
                    if self.marconi.settings.probation else None
                pool = self.cache.req_to_token_pool
                request_slots = 1 + (int(pool.mamba_initial_tracking_slots) if extra_buffer else 0)
                if rule is not None and not rule.applies(int(pool.mamba_pool.size), request_slots):
                    rule = None
                self._marconi_backtrack = rule or False
            return rule or None

        def _marconi_confirm_own_probationary(self, state) -> bool:
            """extra_buffer mode: a request whose input-end state went to the tree on probation and
            that tracked none since (a decode shorter than the snapshot grid) has no final state to
            donate; its last state *is* that one, so it becomes its final state: confirmed."""
            node, state.probation_node = state.probation_node, None
            if node is None or node.component_data[self.component_type].value is None:
                return False
            return self.marconi.probation.confirm(node)

        def cleanup_after_caching_req(self, req, is_finished, insert_result=None, insert_params=None):
            state = req.__dict__.get("marconi")
            record = req.__dict__.get("marconi_backtrack")
            if record is not None and record.inserting is not None:
                backtrack, record.inserting = record.inserting, None
                node = state.probation_node  # set by the insert's commit when its state was new
                if node is not None and node is not record.probation_before and self._marconi_backtrack_rule():
                    self._primary("admission (backtrack mark)", self._marconi_marks.mark, node, backtrack,
                                  self.marconi.probation)
            if state is not None:
                state.probationary_insert = False
                if not is_finished and state.declined:
                    # Nothing was donated: keep the request's tracked state (extra-buffer mode), which
                    # upstream's cleanup would forget, so its final state can still be admitted (and a
                    # state tracked before the branch is still there when the branch is decided).
                    state.declined = False
                    return
            super().cleanup_after_caching_req(req, is_finished, insert_result=insert_result, insert_params=insert_params)

        def _marconi_reserve_slot(self, probation_only: bool = False) -> bool:
            """Make sure one Mamba slot is free for a new state, evicting if we can (`probation_only`:
            only probationary states may go, through an eviction call that carries that limit)."""
            allocator = self.cache.req_to_token_pool.mamba_allocator
            if free_mamba_slots(allocator) >= 1:
                return True
            if probation_only and not len(self.marconi.probation):
                return False
            walk = _PROBATION_ONLY if probation_only else EvictionWalk()
            self.cache.evict_for_alloc(marconi_evict_params(mamba_num=1, walk=walk))
            return free_mamba_slots(allocator) >= 1

    return MarconiAdmission
