"""Where a hybrid model's prefill can keep the state at a request's branch point: the arithmetic of
Marconi's two-pass prefill and of extra_buffer snapshot steering, on plain integers.

The served cache (`serving/admission.py`, `serving/two_pass_prefill.py`) calls these with a
request's fields; the simulator's model of the served cache (`policy/tree/served_cache.py`) calls them
with its own. One rule, written once. Engine-free.

- no_buffer (`step` None): a state exists only at the end of an extend, so the chunk that would run
  past the branch ends at it.
- extra_buffer (`step`: SGLang's snapshot grid, `mamba_cache_chunk_size`, 64): the forward pass
  snapshots one state per extend, a whole number of steps into it (`start + k * step`, k >= 1). The
  chunk is ended where the next extend starts a whole number of steps before the branch (at
  `branch - step` when that extend would reach the branch). Where the input runs on at least
  `INPUT_END_STEPS` steps past the branch, that extend ends at the branch, so that the one after it
  snapshots its own last step, near the input's end (where a reasoning model's next turn, its
  history without the decoded reasoning, leaves the tree). Impossible when the branch is less than
  one step past the extend's start: then the extend containing the branch snapshots the last
  `start + k * step` at or before it (`tracked_position`).
- The input's end state in extra_buffer: a last extend shorter than a step snapshots nothing, so
  the state the checkpoint before it offers is carried to the input's end
  (`snapshot_carries_to_input_end`).
"""

from __future__ import annotations


# extra_buffer: the extend that snapshots the branch ends at it only when the input runs on at least
# this many snapshot steps past the branch: the input's end state then saves that much replay per
# return to it, for the Mamba slot it takes (a request keeps two states instead of one).
INPUT_END_STEPS = 4


def chunk_end(branch: int | None, start: int, proposed_end: int, step: int | None = None,
              input_end: int | None = None) -> int:
    """Where to end the prefill chunk [start, proposed_end) so that the branch's state is kept
    exactly (see the module docstring); `proposed_end` when nothing is to be cut. `input_end`: the
    input's length, which decides whether the extend that snapshots the branch ends at it."""
    if branch is None or branch <= start:
        return proposed_end
    if step is None:
        return branch if branch < proposed_end else proposed_end
    if branch - start < step:
        return proposed_end  # impossible
    if (branch - start) % step == 0:
        # tracked as it is; ended there when the input goes on long enough, so that the next
        # extend can snapshot its own last step, near the input's end (one snapshot per extend)
        split = input_end is not None and input_end - branch >= INPUT_END_STEPS * step
        return branch if split and branch < proposed_end else proposed_end
    if branch - step < proposed_end:
        cut = branch - step  # the next extend snapshots the branch one step in
    else:
        cut = proposed_end - (proposed_end - branch) % step
    return cut if start < cut < proposed_end else proposed_end


def tracked_position(branch: int | None, start: int, end: int, step: int) -> int | None:
    """extra_buffer: the position the extend [start, end) should snapshot for the branch: the last
    `start + k * step` (k >= 1) at or before it, or None when the branch is not inside this extend
    or no such position is."""
    if branch is None or not start < branch < end:
        return None
    k = (branch - start) // step
    return start + k * step if k >= 1 else None


def admits_branch_state(branch: int | None, position: int | None, checkpoint_end: int, step: int | None,
                        cut: int | None = None) -> bool:
    """Is the state at `position`, offered by the checkpoint that ends at `checkpoint_end`, the
    request's branch state? no_buffer (`step` None): where two-pass prefill ended the chunk for the
    branch (at it, or at `cut`, the last aligned position before it, when it could not end there).
    extra_buffer: at or before the branch, and no later extend (they start at `checkpoint_end` and
    snapshot a step or more in) can land closer."""
    if branch is None or position is None or position > branch:
        return False
    if step is not None:
        return position == branch or branch - checkpoint_end < step
    return position == (branch if cut is None else cut)


def snapshot_carries_to_input_end(checkpoint_end: int, input_len: int, step: int | None) -> bool:
    """extra_buffer: does the state a checkpoint before the input's end offers carry over to the
    input's end? The rest of the prefill (`checkpoint_end` to `input_len`) is one extend shorter
    than a step, which snapshots nothing, so the checkpoint at the input's end offers this same
    state: it is the input's end state, not a chunk-end one. no_buffer (`step` None): never."""
    return step is not None and checkpoint_end < input_len < checkpoint_end + step


def branch_position(full_kv_match: int, resumed_at: int, page: int = 1) -> int | None:
    """A request's branch point, set at match time: where its input leaves the cached tree (the
    full-KV match, floored to the page grid), if that lies past the position the request resumes
    from (`resumed_at`: the state it hit, plus what a host load back brings); else None (no state
    to keep there)."""
    exact = full_kv_match // page * page
    return exact if exact > resumed_at else None
