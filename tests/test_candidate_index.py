"""CandidateIndex: its ranking is the score rule's (`policy/rules/score.py`, checked here against
the rule written out by hand), slots stay dense under adds and removals, and exact ties go to the
smallest tie key whatever the slots."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.rules import score
from sglang_marconi.policy.tree.candidate_index import CandidateIndex, lowest_across
from sglang_marconi.policy.rules.eviction.coverage import lowest_coverage
from sglang_marconi.policy.tree.host_candidates import HostCandidateIndex
from sglang_marconi.policy.tree.small_candidates import SmallCandidateIndex

values = st.floats(min_value=0, max_value=1e9, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(values, values), min_size=1, max_size=60), st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_lowest_is_a_minimum_of_the_reference_scores(rows, alpha):
    index = CandidateIndex(initial_capacity=4)  # grows several times
    for i, (t, e) in enumerate(rows):
        index.add(i, t, e)
    t, e = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    scores = score.scores(t, e, alpha)
    assert scores[index.lowest(alpha)] == scores.min()
    assert np.array_equal(index.scores(alpha), scores)


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


# -- exact ties: the smallest tie key, whatever the slots -------------------------------------------
# The ranks of a group hold the same candidates in different slots (a rank that rebuilt its index
# filled them in another order), so every choice below is checked against the same candidates
# added in another order and thinned by swap-removes.

class Node:
    def __init__(self, node_id):
        self.id = node_id

    def __repr__(self):
        return f"Node({self.id})"


few = st.sampled_from([0.0, 1.0, 2.0, 5.0])  # few values: exact ties everywhere
tied_rows = st.lists(st.tuples(few, few), min_size=1, max_size=50)


def index_of(rows, order, decoys=(), cls=CandidateIndex, **kwargs):
    """Candidates `Node(i)` with rows[i], added in `order`, with a decoy added after each of
    `decoys` and all removed at the end (swap-removes move later entries into their holes)."""
    index = cls(4, **kwargs)
    for i in order:
        index.add(Node(i), *rows[i])
        if i in decoys:
            index.add(Node(-1 - i), 0.0, 0.0)
    while any(n.id < 0 for n in index.items):
        index.remove(next(slot for slot, n in enumerate(index.items) if n.id < 0))
    return index


def scores_by_hand(rows, alpha):
    """Each score computed on its own, as the rule states it (`policy/rules/score.py`'s docstring;
    alpha 0: the recency)."""
    t, e = [r[0] for r in rows], [r[1] for r in rows]
    if not alpha:
        return t
    w_t = (1.0 + 1e-12) / (max(t) - min(t)) if max(t) > min(t) else 0.0
    w_e = alpha / (max(e) - min(e)) if max(e) > min(e) else 0.0
    return [w_t * (x - min(t)) + w_e * (y - min(e)) for x, y in zip(t, e)]


def expected_lowest(rows, alpha):
    """Brute force: the smallest id among the candidates with exactly the lowest score."""
    scores = scores_by_hand(rows, alpha)
    return min(i for i, s in enumerate(scores) if s == min(scores))


@settings(max_examples=300, deadline=None)
@given(tied_rows, st.sampled_from([0.0, 1.0, 3.0]), st.randoms(use_true_random=False))
def test_exact_ties_go_to_the_smallest_tie_key_in_any_slot_order(rows, alpha, rng):
    order = list(range(len(rows)))
    shuffled = order[:]
    rng.shuffle(shuffled)
    decoys = set(rng.sample(order, len(order) // 2))
    expected = expected_lowest(rows, alpha)
    for cls in (CandidateIndex, SmallCandidateIndex):
        for index in (index_of(rows, order, cls=cls), index_of(rows, shuffled, decoys, cls=cls)):
            assert index.lowest(alpha).id == expected


@settings(max_examples=200, deadline=None)
@given(tied_rows, tied_rows, st.sampled_from([0.0, 1.0, 3.0]), st.randoms(use_true_random=False))
def test_ties_across_indexes_go_to_the_smallest_tie_key(kv_rows, state_rows, alpha, rng):
    """`lowest_across`: the lowest score over the union; exact ties to the smallest key, then (one
    node in both indexes, as a leaf holding a state is) to the earlier index. Ids: KV candidates
    0.., states 100.., and node 0 in both with the same values."""
    entries = [(0, i, row) for i, row in enumerate(kv_rows)] + [(1, 0, kv_rows[0])]
    entries += [(1, 100 + i, row) for i, row in enumerate(state_rows)]
    scores = scores_by_hand([row for _, _, row in entries], alpha)
    expected = min(zip(scores, (i for _, i, _ in entries), (p for p, _, _ in entries)))
    for shuffle in (False, True):
        indexes = (CandidateIndex(4), CandidateIndex(4))
        for position, i, row in (rng.sample(entries, len(entries)) if shuffle else entries):
            indexes[position].add(Node(i), *row)
        position, node = lowest_across(indexes, alpha)
        assert (node.id, position) == expected[1:]


@settings(max_examples=200, deadline=None)
@given(tied_rows, st.randoms(use_true_random=False))
def test_coverage_ties_go_to_the_least_recent_then_the_smallest_key(rows, rng):
    order = list(range(len(rows)))
    shuffled = order[:]
    rng.shuffle(shuffled)
    decoys = set(rng.sample(order, len(order) // 2))
    expected = min(range(len(rows)), key=lambda i: (rows[i][1], rows[i][0], i))  # (coverage, recency, id)
    for cls in (CandidateIndex, SmallCandidateIndex):
        for index in (index_of(rows, order, cls=cls), index_of(rows, shuffled, decoys, cls=cls)):
            assert lowest_coverage(index).id == expected


def test_two_equal_candidates_added_in_either_order_give_one_victim():
    """Two candidates with the same values, added in either order: the old rule (the first slot
    among equals) picked whichever came first."""
    picks = set()
    for order in ([0, 1], [1, 0]):
        index = index_of([(1.0, 2.0), (1.0, 2.0)], order)
        assert index.lowest(1.0).id == 0 and lowest_coverage(index).id == 0
        picks.add(index.items[0].id)  # what the old rule returned: the first slot
    assert picks == {0, 1}


def test_tie_keys_a_function_a_tuple_an_id_or_the_order_of_adds():
    index = CandidateIndex(tie_key=lambda name: (len(name), -ord(name[0])))
    for name in ("bb", "a", "c"):
        index.add(name, 1.0, 1.0)
    assert index.lowest(0.0) == "c" and index.lowest(2.0) == "c"  # (1, -99) < (1, -97)
    by_id = CandidateIndex()
    for i in (7, 3, 5):
        by_id.add(Node(i), 0.0, 0.0)
    assert by_id.lowest(1.0).id == 3
    by_order = CandidateIndex()  # no key, no id: the first added wins
    for name in ("z", "y"):
        by_order.add(name, 0.0, 0.0)
    assert by_order.lowest(0.0) == "z"
    host = HostCandidateIndex(4)  # a subclass given no key: the nodes' ids
    for i in (9, 2, 4):
        host.add(Node(i), 5.0, 1.0, freed_bytes=10)
    assert host.lowest(1.0).id == 2


def test_bad_tie_keys_are_refused_in_one_line():
    index = CandidateIndex(tie_key=lambda item: item)
    with pytest.raises(ValueError, match=r"tie key 'x' of 'x': expected an int"):
        index.add("x", 0.0, 0.0)
    index.add((1, 2), 0.0, 0.0)
    with pytest.raises(ValueError, match=r"tie key \(1, 2, 3\) .*expected 2 element"):
        index.add((1, 2, 3), 0.0, 0.0)
    with pytest.raises(TypeError, match="tie_key 5"):
        CandidateIndex(tie_key=5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(values, values), min_size=2, max_size=40), st.sampled_from([0.5, 1.0, 3.0]),
       st.randoms(use_true_random=False))
def test_a_score_does_not_depend_on_its_slot(rows, alpha, rng):
    """The same candidate scores bit for bit the same in any slot (so a near-tie cannot be
    decided by where the candidates sit)."""
    order = list(range(len(rows)))
    shuffled = order[:]
    rng.shuffle(shuffled)
    a, b = index_of(rows, order), index_of(rows, shuffled)
    score_a = dict(zip((n.id for n in a.items), a.scores(alpha).tolist()))
    score_b = dict(zip((n.id for n in b.items), b.scores(alpha).tolist()))
    assert score_a == score_b


def test_a_key_beyond_64_bits_is_refused_and_changes_nothing():
    index = CandidateIndex(tie_key=lambda item: item)
    index.add(1, 0.0, 0.0)
    with pytest.raises(ValueError, match="beyond 64-bit"):
        index.add(1 << 70, 0.0, 0.0)
    assert index.items == [1] and index.lowest(1.0) == 1


def test_a_subnormal_span_divides_and_still_ties_by_key():
    rows = [(5e-324, 1.0), (0.0, 2.0), (0.0, 2.0), (5e-324, 1.0)]  # a recency span whose weight overflows
    for cls in (CandidateIndex, SmallCandidateIndex):
        for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
            index = index_of(rows, order, cls=cls)
            # (1 + 1e-12) + 0 > 0 + 1: the older (ids 1 and 2), then the smaller id
            assert index.lowest(1.0).id == 1
