"""`score.score_each`, the eviction score over lists (the shadows' small candidate index), against
`score.scorer` on each candidate: the same float, bit for bit, under every kind of scale."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.rules import score

values = st.floats(min_value=0, max_value=1e9, allow_nan=False)
tiny = st.sampled_from([0.0, 5e-324, 1e-320, 1.0, 2.0])  # spans whose weight overflows (subnormal)


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def scale_of(t, e, alpha):
    return score.scale(min(t), max(t), min(e), max(e), alpha)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.one_of(values, tiny), st.one_of(values, tiny)), min_size=1, max_size=40),
       st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0]))
def test_score_each_is_scorer_on_each_candidate_bit_for_bit(rows, alpha):
    t, e = [r[0] for r in rows], [r[1] for r in rows]
    s = scale_of(t, e, alpha)
    one = score.scorer(s)
    assert [bits(x) for x in score.score_each(s, t, e)] == [bits(one(a, b)) for a, b in zip(t, e)]


def test_every_kind_of_scale_is_covered():
    """The cases `scorer` distinguishes, each met by a fixed example: LRU, no value spread, both
    columns spread, and a subnormal span (divide instead of weighting)."""
    cases = {
        "lru": ([3.0, 1.0, 2.0], [1.0, 2.0, 3.0], 0.0),
        "recency only": ([3.0, 1.0, 2.0], [7.0, 7.0, 7.0], 1.0),
        "both": ([3.0, 1.0, 2.0, 0.3], [1.0, 9.0, 3.0, 1e-7], 0.7),
        "subnormal": ([5e-324, 0.0, 0.0, 5e-324], [1.0, 2.0, 2.0, 1.0], 1.0),
    }
    for name, (t, e, alpha) in cases.items():
        s = scale_of(t, e, alpha)
        assert (s is score.LRU_SCALE) == (name == "lru")
        assert (s.spans is not None) == (name == "subnormal"), name
        one = score.scorer(s)
        assert [bits(x) for x in score.score_each(s, t, e)] == [bits(one(a, b)) for a, b in zip(t, e)], name


def test_a_scorer_put_in_its_place_is_applied_over_lists(monkeypatch):
    """Replacing `score.scorer` (a new rule, or `tests/serving/test_rule_mutants.py`'s mutant)
    replaces the list form too: `score_each` applies the replacement, not its inlined copy."""
    t, e = [3.0, 1.0, 2.0, 0.3], [1.0, 9.0, 3.0, 1e-7]
    s = scale_of(t, e, 0.7)
    original = score.scorer

    def value_first(scale):
        return original(scale._replace(w_e=-scale.w_e))

    monkeypatch.setattr(score, "scorer", value_first)
    mutated = [bits(x) for x in score.score_each(s, t, e)]
    assert mutated == [bits(value_first(s)(a, b)) for a, b in zip(t, e)]
    assert mutated != [bits(original(s)(a, b)) for a, b in zip(t, e)]
