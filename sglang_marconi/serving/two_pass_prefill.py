"""Two-pass prefill inside SGLang's scheduler: end a prefill chunk where the branch's state can be
kept exactly.

Marconi admits a request's branch state from the checkpoint at `req.mamba_branching_seqlen`
(the exact branch, set at match time; see `admission.py`). Where the chunk ends depends on
SGLang's Mamba radix-cache strategy (`admission.chunk_end_for_branch`):
- no_buffer (the default without overlap scheduling): a Mamba state exists only at the end of an
  extend, so when the branch lies strictly inside the extend that `PrefillAdder` picks, the extend
  is ended at the branch and the request continues as SGLang's (single) chunked request in the
  next round; `Scheduler.stash_chunked_request` -> `checkpoint_kv_cache` then runs at exactly the
  branch length.
- extra_buffer (the GPU default): the forward pass snapshots states only a whole number of grid
  steps (64) into each extend. The chunk is ended where the next extend starts a whole number of
  steps before the branch, so its snapshot lands exactly on the branch (an extend that started at
  the hit would snapshot up to 63 tokens short of it, and that loss is most of what Marconi lost
  to upstream in this mode: docs/benchmarks.md). Where no extend can start there (the branch
  less than one step past the hit), a third hook steers the snapshot to the last grid position
  before the branch.
Nothing changes when the tree cache is not Marconi's (or runs upstream's admission).

Done with AROUND hooks from SGLang's `HookRegistry` (no source patch):

- `PrefillAdder._select_prefill_admission` (a new request, called from `add_one_req`): its result
  (`_PrefillAdmission`: prefix, extend, max-new reservation, is_chunked) is what
  `_commit_prefill_admission` turns into `req.extend_end`, `new_chunked_req` and the budget
  charges, so shortening it there keeps every budget in step. The max-new-token reservation of
  a request that would otherwise have finished its prefill is kept (over-reserving within this
  round, never under-reserving).
  SGLang tracks one chunked request: if one already exists (a continuing chunked request, or one
  admitted earlier in this round) the request is not split (its branch state is lost; counted),
  and a new admission that would itself be chunked is refused for this round (`OTHER`; it stays
  queued) instead of overwriting the existing chunked request - upstream relies on the chunk
  budget being spent by then, which a split at the branch no longer guarantees.
- `PrefillAdder.add_chunked_req` (the continuing chunked request): its chunk limit
  (`chunked_req_limit`, read only there) is capped at the branch for the call, so upstream's own
  arithmetic computes the shorter chunk and charges exactly it.

- `ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend` (extra_buffer mode, Marconi's
  admission on): SGLang snapshots `req.mamba_branching_seqlen` when it lies a whole number of
  chunks (`mamba_cache_chunk_size`) into the extend, else the extend's last such position. For
  the extend that contains the branch, the branch is replaced for the call by the last such
  position at or before it (`admission.tracked_position_for_branch`), so the state kept for the
  branch is the closest one the mode can snapshot, the branch itself when it is on that grid.

Split positions come from `admission.chunk_end_for_branch`. In no_buffer mode, where a cut at the
branch is not page aligned (or not on `truncation_align_size`), the chunk is ended at the last
aligned position before the branch instead, if there is one after the prefix
(`req.marconi.branch_cut`, which admission then takes for the branch state), else not split
(counted `skipped_unaligned`); in extra_buffer mode a cut off those grids is not made (counted).
Counters live in the cache's Marconi state (`cache.marconi.two_pass`).

Faults: the chunking decision changes what the scheduler runs, and has nothing derived to rebuild,
so an exception in Marconi's part of a hook is unrecoverable (`faults.py`): a rank alone goes on
with upstream's chunking, a rank of a group stops the group.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pkgutil

from sglang_marconi.serving.admission import chunk_end_for_branch, tracked_position_for_branch
from sglang_marconi.serving.cache_state import TwoPassCounters, request_state

_POLICY = "sglang.srt.managers.schedule_policy.PrefillAdder"
SELECT_TARGET = f"{_POLICY}._select_prefill_admission"
CHUNKED_TARGET = f"{_POLICY}.add_chunked_req"
TRACK_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend"


def two_pass_active(tree_cache) -> bool:
    """Marconi's tree cache with Marconi's admission (which reports exact branches), either mode."""
    state = getattr(tree_cache, "marconi", None)
    return (
        state is not None and state.index is not None and state.faults.fallen_back is None
        and _mamba_component(tree_cache) is not None
    )


def snapshot_step(tree_cache) -> int | None:
    """extra_buffer mode: the grid SGLang's forward pass snapshots states on (relative to each
    extend's start); no_buffer mode: None (a state exists at an extend's end only)."""
    if not getattr(tree_cache, "enable_mamba_extra_buffer", False):
        return None
    return _mamba_component(tree_cache).mamba_checkpoint_grid


def _mamba_component(tree_cache):
    components = getattr(tree_cache, "components", None) or {}
    return next((c for c in components.values() if getattr(c, "marconi_exact_branch", False)), None)


def branch_tracking_active(tree_cache) -> bool:
    """Marconi's admission (which reports exact branches), in extra_buffer mode."""
    return getattr(tree_cache, "enable_mamba_extra_buffer", False) is True and two_pass_active(tree_cache)


def counters(tree_cache) -> TwoPassCounters:
    return tree_cache.marconi.two_pass


def _aligned(adder, prefix_len: int, end: int, truncation_align_size=None) -> bool:
    if end % adder.page_size:
        return False
    return truncation_align_size is None or (end - prefix_len) % truncation_align_size == 0


def _cut(adder, req, prefix_len: int, branch: int, truncation_align_size=None) -> int | None:
    """Where to end the chunk for the branch: at it, else at the last aligned position before it
    (after the prefix; recorded on the request for admission, which then takes that state for
    the branch), else None."""
    if _aligned(adder, prefix_len, branch, truncation_align_size):
        return branch
    step = math.lcm(adder.page_size, truncation_align_size or 1)
    cut = branch - (branch - prefix_len) % step  # prefix_len is page aligned (the prefix is pages)
    while cut > prefix_len and not _aligned(adder, prefix_len, cut, truncation_align_size):
        cut -= step
    if cut <= prefix_len:
        return None
    request_state(req).branch_cut = cut
    return cut


def _select_around(original, adder, req, *args, **kwargs):
    admission = original(adder, req, *args, **kwargs)
    cache = adder.tree_cache
    if not two_pass_active(cache) or adder.dllm_config is not None:
        return admission
    from sglang.srt.managers.schedule_policy import AddReqResult

    if isinstance(admission, AddReqResult):
        return admission
    request_state(req).branch_cut = None  # admitted from a new match: no cut made for its branch yet
    another_chunked = kwargs.get("has_chunked_req", False) or adder.new_chunked_req is not None
    if admission.is_chunked and another_chunked:
        counters(cache).deferred_second_chunked += 1
        return AddReqResult.OTHER
    prefix = admission.prefix_len
    end = prefix + admission.extend_len
    if prefix != req.prefix_len:  # a host hit would be loaded first: leave the shape alone
        return admission
    step = snapshot_step(cache)
    cut = chunk_end_for_branch(req, end, step)
    if not prefix < cut < end:
        return admission
    if another_chunked:
        counters(cache).skipped_other_chunked += 1
        return admission
    if step is None:  # no_buffer: at the branch, else at the last aligned position before it
        branch = cut
        cut = _cut(adder, req, prefix, branch, kwargs.get("truncation_align_size"))
        if cut is None:
            counters(cache).skipped_unaligned += 1
            return admission
        if cut != branch:
            counters(cache).aligned_below += 1
    elif not _aligned(adder, prefix, cut, kwargs.get("truncation_align_size")):
        counters(cache).skipped_unaligned += 1
        return admission
    counters(cache).splits += 1
    # Keep max_new_tokens: the request is charged as if it finished its prefill (over-reserving).
    return dataclasses.replace(admission, extend_len=cut - prefix, is_chunked=True)


def _add_chunked_around(original, adder, req, *args, **kwargs):
    cache = adder.tree_cache
    if not two_pass_active(cache) or adder.dllm_config is not None:
        return original(adder, req, *args, **kwargs)
    n = len(req.full_untruncated_fill_ids)
    step = snapshot_step(cache)
    cut = chunk_end_for_branch(req, n, step)
    if not req.prefix_len < cut < n or request_state(req).branch_cut is not None:
        # (a cut below the branch already gave the request its branch state)
        return original(adder, req, *args, **kwargs)
    if step is None:
        branch = cut
        cut = _cut(adder, req, req.prefix_len, branch)
        if cut is None:
            counters(cache).skipped_unaligned += 1
            return original(adder, req, *args, **kwargs)
        if cut != branch:
            counters(cache).aligned_below += 1
    elif not _aligned(adder, req.prefix_len, cut):
        counters(cache).skipped_unaligned += 1
        return original(adder, req, *args, **kwargs)
    saved = adder.chunked_req_limit
    limit = cut - req.prefix_len
    adder.chunked_req_limit = limit if saved is None else min(saved, limit)
    try:
        result = original(adder, req, *args, **kwargs)
    finally:
        adder.chunked_req_limit = saved
    if adder.can_run_list and adder.can_run_list[-1] is req and req.extend_end == cut:
        counters(cache).continuation_splits += 1
    else:
        request_state(req).branch_cut = None  # the budget ended the chunk elsewhere: cut again next round
    return result


def _track_around(original, batch, req, *args, **kwargs):
    cache = batch.tree_cache
    if not branch_tracking_active(cache):
        return original(batch, req, *args, **kwargs)
    branch = req.mamba_branching_seqlen
    target = tracked_position_for_branch(req, _mamba_component(cache).mamba_cache_chunk_size)
    if target is None or target == branch:
        return original(batch, req, *args, **kwargs)
    req.mamba_branching_seqlen = target  # what upstream snapshots when it is on the chunk grid
    try:
        return original(batch, req, *args, **kwargs)
    finally:
        req.mamba_branching_seqlen = branch


def _guarded(hook, where: str):
    """`hook` with the fault guard: an exception in Marconi's part of it is unrecoverable
    (`faults.py`: a rank alone goes on with upstream's chunking, the call included; a rank of a
    group raises); upstream's own exceptions propagate."""

    @functools.wraps(hook)
    def run(original, owner, req, *args, **kwargs):
        state = getattr(owner.tree_cache, "marconi", None)
        if state is None or state.faults.fallen_back is not None:
            return original(owner, req, *args, **kwargs)
        upstream = {}

        def call_original(*a, **k):
            upstream["called"] = True
            result = original(*a, **k)  # an exception here is upstream's: it propagates
            upstream["result"] = result
            return result

        try:
            return hook(call_original, owner, req, *args, **kwargs)
        except Exception as exc:
            if upstream.get("called") and "result" not in upstream:
                raise  # upstream's own exception
            state.faults.unrecoverable(where, exc)
            return upstream["result"] if "result" in upstream else original(owner, req, *args, **kwargs)

    return run


_HOOKS = ((SELECT_TARGET, _guarded(_select_around, "two-pass prefill (new request)")),
          (CHUNKED_TARGET, _guarded(_add_chunked_around, "two-pass prefill (chunked request)")),
          (TRACK_TARGET, _guarded(_track_around, "branch snapshot tracking")))
_originals: dict[str, object] = {}


def install_two_pass_prefill_hook(apply_now: bool = False) -> None:
    """Register the hooks with SGLang's HookRegistry (idempotent). `load_plugins()` applies them
    after every plugin's register() ran; `apply_now=True` applies them at once (tests, or a
    process that already loaded its plugins)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in _HOOKS:
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            if target not in HookRegistry._patched:
                owner, attr = target.rsplit(".", 1)
                _originals[target] = pkgutil.resolve_name(owner).__dict__[attr]
            HookRegistry.register(target, hook, HookType.AROUND)
    if apply_now:
        HookRegistry.apply_hooks()


def uninstall_two_pass_prefill_hook() -> None:
    """Undo install_two_pass_prefill_hook (for tests): unregister, restore the original methods
    and re-apply whatever other hooks those targets had."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target, hook in _HOOKS:
        entries = HookRegistry._hooks.get(target)
        if entries is None:
            continue
        entries[:] = [e for e in entries if e[1] is not hook]
        if target in HookRegistry._patched and target in _originals:
            owner, attr = target.rsplit(".", 1)
            setattr(pkgutil.resolve_name(owner), attr, _originals.pop(target))
            HookRegistry._patched.discard(target)
            if entries:
                HookRegistry._apply_target(target, entries)
                HookRegistry._patched.add(target)
        if not entries:
            HookRegistry._hooks.pop(target, None)
