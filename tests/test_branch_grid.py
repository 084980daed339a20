"""`policy/rules/branch_grid.py`: where extra_buffer prefill is cut for the branch's state, and
which snapshot is the input's end state."""

from __future__ import annotations

import pytest

from sglang_marconi.policy.rules.branch_grid import INPUT_END_STEPS, chunk_end, snapshot_carries_to_input_end

STEP = 64


def test_the_chunk_is_cut_a_step_before_the_branch():
    assert chunk_end(1000, 0, 1300, STEP, 1300) == 1000 - STEP


@pytest.mark.parametrize("tail, cut_at_branch", [(INPUT_END_STEPS * STEP, True), (INPUT_END_STEPS * STEP - 1, False)])
def test_the_extend_that_snapshots_the_branch_ends_there_when_the_input_goes_on(tail, cut_at_branch):
    branch, start = 1000, 1000 - STEP
    end = branch + tail
    assert chunk_end(branch, start, end, STEP, end) == (branch if cut_at_branch else end)
    assert chunk_end(branch, start, end, STEP) == end  # the input's length unknown: never


def test_no_buffer_ends_the_chunk_at_the_branch_whatever_follows():
    assert chunk_end(1000, 0, 1010, None, 1010) == 1000
    assert chunk_end(1000, 0, 1010, None) == 1000


@pytest.mark.parametrize("checkpoint_end, input_len, carries", [
    (2064, 2095, True),  # a last extend of 31 tokens snapshots nothing
    (2064, 2064 + STEP - 1, True),
    (2064, 2064 + STEP, False),  # a step: it snapshots the input's end itself
    (2064, 2064, False),  # the input's end checkpoint itself
])
def test_a_snapshot_carries_to_the_input_end_when_the_last_extend_is_shorter_than_a_step(
        checkpoint_end, input_len, carries):
    assert snapshot_carries_to_input_end(checkpoint_end, input_len, STEP) is carries
    assert snapshot_carries_to_input_end(checkpoint_end, input_len, None) is False
