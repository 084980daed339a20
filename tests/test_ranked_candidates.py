"""`RankedCandidates` (policy/tree/ranked_candidates.py) names the candidate a from-scratch
`score.scores` (policy/rules/score.py) over the whole set puts first, exact ties to the lowest tie id, after any
sequence of additions, removals, recency moves and in-place changes, at any block size."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.rules import score
from sglang_marconi.policy.tree.ranked_candidates import RankedCandidates


def reference_lowest(entries: dict, alpha: float):
    keys = list(entries)
    scores = score.scores(np.array([entries[k][0] for k in keys], float),
                          np.array([entries[k][1] for k in keys], float), alpha)
    return keys[min(range(len(keys)), key=lambda i: (scores[i], entries[keys[i]][2]))]


# Few distinct values, so that exact ties (in either column and in the score) are common.
recencies = st.integers(0, 40).map(float)
efficiencies = st.sampled_from([1.0, 2.0, 3.0, 0.5, 7.25])
operations = st.lists(st.tuples(st.sampled_from(["put", "remove", "stamp", "change", "compact"]),
                                st.integers(0, 30), recencies, efficiencies, st.integers(0, 5)),
                      min_size=1, max_size=120)


@settings(max_examples=300, deadline=None)
@given(operations, st.sampled_from([1, 2, 4, 256]), st.sampled_from([0.0, 1.0, 0.5, 3.0]))
def test_lowest_is_the_reference_choice(ops, block, alpha):
    ranked, entries = RankedCandidates(block=block), {}
    for op, key, recency, efficiency, tie in ops:
        if op == "put" or (key not in entries and op != "compact"):
            entries[key] = (recency, efficiency, key * 10 + tie)
            ranked.put(key, *entries[key], payload=("p", key))
        elif op == "remove":
            del entries[key]
            ranked.remove(key)
        elif op == "stamp":  # SGLang's stamps only grow
            entries[key] = (max(entries[key][0], recency), *entries[key][1:])
            ranked.set_recency(key, entries[key][0])
        elif op == "change":  # same recency, new efficiency and tie id
            entries[key] = (entries[key][0], efficiency, key * 10 + tie)
            ranked.put(key, *entries[key], payload=("p", key))
        else:
            ranked.compact()
        assert len(ranked) == len(entries)
        if entries:
            key = ranked.lowest(alpha)
            assert key == reference_lowest(entries, alpha)
            assert ranked.payload(key) == ("p", key)
            assert ranked.entry(key) == entries[key]
        else:
            assert ranked.lowest(alpha) is None


def test_a_choice_scores_one_block_while_the_scale_stands():
    # 20,000 candidates in recency order: removing the lowest (not an extreme of either column)
    # rescores the block it sat in, not the set.
    rng = np.random.default_rng(0)
    ranked = RankedCandidates(block=256)
    for i in range(20_000):
        ranked.put(i, float(i), 1.0 + rng.random(), i)
    ranked.put("old", -1.0, 100.0, -1)  # the extremes stay put: oldest and most efficient
    ranked.put("new", 1e9, 0.0, -2)
    scored = []
    original = ranked._score_block
    ranked._score_block = lambda b: (scored.append(b), original(b))
    ranked.lowest(1.0)
    for _ in range(50):
        scored.clear()
        ranked.remove(ranked.lowest(1.0))
        ranked.lowest(1.0)
        assert len(scored) <= 2, scored
