"""Marconi's admission inside SGLang's MAMBA component (paper §4.1).

A request may leave at most two SSM states in the tree:
- the state after its last decoded token (the finished request's own slot, donated as upstream does);
- the state at its branch point: the position where speculative insertion of its input leaves
  the cached tree (SGLang computes it at match time as `req.mamba_branching_seqlen`, on the
  Mamba checkpoint grid) — admitted only from the checkpoint whose length is exactly that.
Every other checkpoint (per prefill chunk, after the first token, every N decoded tokens in
extra-buffer mode) keeps its KV with the request and admits no state. When no Mamba slot can be
had for the branch state, the state is skipped and counted, never a failure.

The class is built lazily (`admission_mixin()`) so importing this module needs no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdmissionCounters:
    branch_states_admitted: int = 0
    final_states_admitted: int = 0
    checkpoints_declined: int = 0  # per-chunk / decode checkpoints that Marconi keeps out
    skipped_no_slot: int = 0  # branch states dropped because no Mamba slot could be had


def branch_position(req) -> int | None:
    """The branch checkpoint this request should leave, if any (set at match time)."""
    return getattr(req, "mamba_branching_seqlen", None)


def chunk_end_for_branch(req, proposed_end: int) -> int:
    """Two-pass prefill: end the prefill chunk that would run past the branch position exactly
    at it, so the state there can be checkpointed whatever the chunk grid."""
    branch = branch_position(req)
    if branch is not None and req.prefix_len < branch < proposed_end:
        return branch
    return proposed_end


def admission_mixin():
    """A mixin for (a subclass of) SGLang's MambaComponent implementing Marconi's admission."""

    class MarconiAdmission:
        marconi_admission_counters: AdmissionCounters

        def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
            counters = self.__dict__.setdefault("marconi_admission_counters", AdmissionCounters())
            if is_finished:
                cache_len = super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
                if cache_len:
                    counters.final_states_admitted += 1
                return cache_len
            position = req.kv.mamba_last_track_seqlen if self.cache.enable_mamba_extra_buffer else token_ids_len
            if position is None or position != branch_position(req):
                counters.checkpoints_declined += 1
                self.__dict__.setdefault("_marconi_declined", set()).add(req.rid)
                return 0
            if not self.cache.enable_mamba_extra_buffer and not self._marconi_reserve_slot():
                counters.skipped_no_slot += 1
                return 0
            cache_len = super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
            if cache_len:
                counters.branch_states_admitted += 1
            return cache_len

        def cleanup_after_caching_req(self, req, is_finished, insert_result=None, insert_params=None):
            declined = self.__dict__.get("_marconi_declined")
            if not is_finished and declined and req.rid in declined:
                # Nothing was donated: keep the request's tracked state (extra-buffer mode), which
                # upstream's cleanup would forget, so its final state can still be admitted.
                declined.discard(req.rid)
                return
            super().cleanup_after_caching_req(req, is_finished, insert_result=insert_result, insert_params=insert_params)

        def _marconi_reserve_slot(self) -> bool:
            """Make sure one Mamba slot is free for the branch state, evicting if we can."""
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            allocator = self.cache.req_to_token_pool.mamba_allocator
            if allocator.available_size() >= 1:
                return True
            self.cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1))
            return allocator.available_size() >= 1

    return MarconiAdmission
