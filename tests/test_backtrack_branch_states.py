"""Backtrack states never take a branch state's place (`policy/rules/backtrack_states.py`,
`bars_resume` / `BacktrackMarks`), in the served-pools model (`ServedCache`, which
`tests/serving/test_backtrack_served.py` shows equal to SGLang's real cache request by request).

In extra_buffer an extend snapshots a state only a whole snapshot step (64) or more past where it
starts. A backtrack state at a cold prefill's chunk end that lies less than a step before where a
later input leaves the tree would, if reused, keep the branch state from ever being written: every
request through that branch would resume there again. So a match does not resume at one (while it
is on probation), and resumes at the deepest other state, as it would without the rule."""

import numpy as np
import pytest

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.rules.backtrack_states import BacktrackMarks, bars_resume
from sglang_marconi.policy.rules.probation import ProbationRegistry
from sglang_marconi.policy.tree.served_cache import ServedCache, ServedPools

PROFILE = load_profile("nemotron-h-8b")
STEP = 64
OUT = list(range(50000, 50008))


def served_model(backtrack: int, chunk: int = 128) -> ServedCache:
    """Ample pools (nothing is evicted): what differs is only where states are kept and reused."""
    return ServedCache(PROFILE, ServedPools(20000, 40, "extra_buffer", chunk, backtrack_states=backtrack), 0.0)


def serve(cache: ServedCache, tokens, out=OUT) -> int:
    return cache.serve(np.asarray(tokens), np.asarray(out)).hit_tokens


def hits_of(cache: ServedCache):
    return lambda tokens, out: serve(cache, tokens, out)


def question(user: int) -> list[int]:
    return list(range(1000 + 100 * user, 1012 + 100 * user))


def users_behind_one_prompt(serve_one, shared: int, users: int = 5, branches: int = 2) -> list[list]:
    """SGLang's frontend program (`examples/system_prompt_users.py`), in its shape: each user asks
    under one system prompt of `shared` tokens, then forks `branches` continuations of its answer.
    Returns what `serve_one(tokens, out)` returns, per user: [its question, each fork]."""
    system = list(range(1, shared + 1))
    hits = []
    for user in range(users):
        prompt, answer = system + question(user), list(range(50000 + 10 * user, 50008 + 10 * user))
        row = [serve_one(prompt, answer)]
        for k in range(branches):
            fork = prompt + answer + list(range(7000 + 10 * k, 7006 + 10 * k))
            row.append(serve_one(fork, list(range(60000 + 10 * k, 60008 + 10 * k))))
        hits.append(row)
    return hits


def test_the_bar_is_the_window_of_one_snapshot_step_before_the_match_end():
    assert not bars_resume(128, 192, STEP)  # a whole step before: an extend from it snapshots the branch
    assert bars_resume(129, 192, STEP) and bars_resume(191, 192, STEP)
    assert not bars_resume(192, 192, STEP)  # at the match's end: it is the branch state
    assert not bars_resume(150, 182, None)  # no_buffer: two-pass prefill ends a chunk at the branch


@pytest.mark.parametrize("chunk", [128, 256, 512])
def test_every_shared_prompt_length_hits_as_much_with_the_rule_as_without(chunk):
    """Every length of the shared prompt, so its end falls at every offset from each chunk end
    where the first user leaves a backtrack state, the window of one step after it included."""
    barred_somewhere = False
    for shared in range(60, 3 * chunk + 40):
        off = users_behind_one_prompt(hits_of(served_model(0, chunk)), shared)
        cache = served_model(3, chunk)
        on = users_behind_one_prompt(hits_of(cache), shared)
        assert all(a >= b for row_on, row_off in zip(on, off) for a, b in zip(row_on, row_off)), (shared, on, off)
        # from the third user on, the whole shared prompt wherever Marconi alone hits it
        assert [row[0] for row in on[2:]] == [row[0] for row in off[2:]], (shared, on, off)
        barred_somewhere |= cache.counters.backtrack_admitted > 0 and off[2][0] == shared
    assert barred_somewhere


FIRST = list(range(1, 401))  # a cold 400-token prefill: backtrack states at its chunk ends 128, 256, 384


@pytest.mark.parametrize("shared,hits", [
    (128, [128, 128, 128]),  # the state sits at the match's end: reused, it is the branch state
    (191, [0, 191, 191]),  # 63 past the state at 128: resumed from before it, the branch state written
    (192, [128, 192, 192]),  # a whole step past it: reused, and the extend from it snapshots the branch
    (200, [128, 200, 200]),
])
def test_a_backtrack_state_less_than_a_step_before_the_branch_is_passed_over(shared, hits):
    cache = served_model(3)
    serve(cache, FIRST)
    assert cache.states_on_path(FIRST) == [128, 256, 384]
    assert [serve(cache, FIRST[:shared] + question(user)) for user in range(3)] == hits
    cache.check_invariants()


def test_an_input_end_state_on_probation_is_reused_as_without_the_rule():
    """Only backtrack states are passed over: the first request's input-end state (192, on
    probation: its final state is a later decode snapshot) 8 tokens before the branch is reused,
    with the rule as without it."""
    first, decoded = list(range(1, 211)), list(range(50000, 50070))
    rows = []
    for backtrack in (0, 3):
        cache = served_model(backtrack)
        serve(cache, first, decoded)
        assert 192 in cache.states_on_path(first) and len(cache._probation) >= 1
        rows.append([serve(cache, first[:200] + question(user)) for user in range(3)])
    assert rows == [[192, 192, 192]] * 2


def test_marks_count_only_on_probation_and_for_the_node_they_name():
    class N:
        def __init__(self, i):
            self.id = i

    probation, marks = ProbationRegistry(), BacktrackMarks()
    a, b = N(1), N(2)
    probation.add(a)
    probation.add(b)
    marks.mark(a, True, probation)
    marks.mark(b, False, probation)
    assert marks.bars(a, 150, 182, STEP, probation) and not marks.bars(b, 150, 182, STEP, probation)
    assert not marks.bars(N(1), 150, 182, STEP, probation)  # another node under the same id
    probation.confirm(a)
    assert not marks.bars(a, 150, 182, STEP, probation)  # confirmed: a regular state now
    probation.add(a)
    marks.mark(a, False, probation)  # back on probation as an input-end state
    assert not marks.bars(a, 150, 182, STEP, probation)
    for i in range(3, 200):  # marks of nodes off probation are dropped as marks pile up
        marks.mark(N(i), True, probation)
    assert len(marks) <= 2 * len(probation) + 65
