"""CandidateIndex: its fast ranking equals the reference formula (`marconi_scores`), and slots
stay dense under adds and removals."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.candidate_index import CandidateIndex, marconi_scores

values = st.floats(min_value=0, max_value=1e9, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(values, values), min_size=1, max_size=60), st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_lowest_is_a_minimum_of_the_reference_scores(rows, alpha):
    index = CandidateIndex(initial_capacity=4)  # grows several times
    for i, (t, e) in enumerate(rows):
        index.add(i, t, e)
    t, e = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    scores = marconi_scores(t, e, alpha)
    assert scores[index.lowest(alpha)] <= scores.min() + 1e-9


def test_remove_moves_the_last_entry_into_the_hole():
    index = CandidateIndex(initial_capacity=2)
    for i, t in enumerate([5.0, 1.0, 3.0]):
        index.add(f"n{i}", t, 10.0 * i)
    assert index.lowest(0.0) == "n1"
    assert index.remove(1) == "n2"  # n2 now lives in slot 1
    assert index.items == ["n0", "n2"] and list(index.last_access[:2]) == [5.0, 3.0]
    assert list(index.efficiency[:2]) == [0.0, 20.0]
    assert index.remove(1) is None and index.items == ["n0"]
    index.update(0, 7.0, 1.0)
    assert index.lowest(2.0) == "n0" and index.last_access[0] == 7.0


def test_exact_ties_go_to_the_older_candidate():
    # alpha = 1: the oldest, most efficient and the newest, least efficient candidate both score 1
    for order in ([("old", 10.0, 5.0), ("new", 20.0, 1.0)], [("new", 20.0, 1.0), ("old", 10.0, 5.0)]):
        index = CandidateIndex()
        for name, t, e in order:
            index.add(name, t, e)
        assert index.lowest(1.0) == "old"
