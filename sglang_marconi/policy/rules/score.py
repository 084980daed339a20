"""Marconi's eviction score (Eq. 2), the one implementation every candidate index calls: the
simulator's caches and the tuner's shadows (`tree/candidate_index.py`, `tree/small_candidates.py`),
the host tier's ranked admission (`tree/host_candidates.py`), the sliding-window plan
(`tree/ranked_candidates.py`) and, through them, the served cache's components.

The rule. Over a set of candidates, each with a recency `t` (grows with time) and a value `e`
(what keeping it saves, `rules/value.py`), the victim is the candidate with the lowest

    S = norm(t) * (1 + 1e-12) + alpha * norm(e)

where norm min-max normalizes a column over the set (a column whose values are all equal
normalizes to 0: it cannot rank anything). The relative 1e-12 on recency, far below any real
score difference, sends the common exact tie of alpha = 1 (the oldest, most valuable candidate and
the newest, least valuable one both score 1) to the older candidate. alpha = 0 is LRU: recency
alone, not normalized (the same order, with no rounding). Among candidates whose scores are
exactly equal the smallest tie key wins: an int or tuple of ints every rank computes identically
(an SGLang node id: nodes are numbered in creation order, which the request stream fixes), never
a slot or an order of insertion.

The arithmetic, fixed so that every index, whatever its storage, computes each score bit for bit
alike (a near-tie is then decided the same way in the simulator and in the server):
`scale(lo_t, hi_t, lo_e, hi_e, alpha)` turns the set's extremes into weights, and
`scorer(scale)` is the score as a function of `(t, e)`, which evaluates one candidate (floats) or
a numpy array of them element by element: `(t - lo_t) * w_t + (e - lo_e) * w_e`, each operation
rounded on its own (never a BLAS dot, which may fuse or reorder them); `utility(t, e, scale)` is
`scorer(scale)(t, e)`. Where a span is subnormal (a weight overflows) the scale divides
instead, as the paper's formula does. Both are monotone in `t` and in `e`, which the incremental
index (`RankedCandidates`) relies on for its lower bounds.

Callers reach these functions through this module (`score.scorer(...)`), never a copy: replacing
one here replaces it everywhere (`tests/serving/test_rule_mutants.py` does).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np

RECENCY_WEIGHT = 1.0 + 1e-12  # exact ties of the normalized sum go to the older candidate
_INF = float("inf")


class Scale(NamedTuple):
    """What `scorer` needs of a candidate set: `(t - lo_t) * w_t + (e - lo_e) * w_e`, or, with
    `spans` (a weight would overflow), `(t - lo_t) / span_t * RECENCY_WEIGHT + alpha * ((e - lo_e) / span_e)`."""

    lo_t: float
    lo_e: float
    w_t: float
    w_e: float
    spans: Optional[tuple] = None  # (span_t, span_e, alpha): divide instead of weighting


LRU_SCALE = Scale(0.0, 0.0, 1.0, 0.0)  # alpha = 0: recency itself
_new_scale = tuple.__new__


def scale(lo_t: float, hi_t: float, lo_e: float, hi_e: float, alpha: float) -> Scale:
    """The scale of a candidate set with these extremes (see the module docstring)."""
    if not alpha:
        return LRU_SCALE
    w_t = RECENCY_WEIGHT / (hi_t - lo_t) if hi_t > lo_t else 0.0
    w_e = alpha / (hi_e - lo_e) if hi_e > lo_e else 0.0
    if w_t == _INF or w_e == _INF:
        return Scale(lo_t, lo_e, 0.0, 0.0, (hi_t - lo_t, hi_e - lo_e, alpha))
    return _new_scale(Scale, (lo_t, lo_e, w_t, w_e, None))  # `Scale(...)` without its Python-level __new__


def scorer(s: Scale) -> Callable:
    """The score under `s` as a function of `(t, e)`: one candidate's floats, or numpy arrays of
    several (element by element, each operation rounded on its own). A zero value weight adds
    nothing and reads nothing (+inf marks a dead slot in `RankedCandidates`)."""
    if s is LRU_SCALE:
        return _recency  # (t - 0.0) * 1.0, bit for bit
    lo_t, lo_e, w_t, w_e = s.lo_t, s.lo_e, s.w_t, s.w_e
    if s.spans is not None:
        span_t, span_e, alpha = s.spans
        if span_t > 0 and span_e > 0:
            return lambda t, e: (t - lo_t) / span_t * RECENCY_WEIGHT + alpha * ((e - lo_e) / span_e)
        if span_t > 0:
            return lambda t, e: (t - lo_t) / span_t * RECENCY_WEIGHT
        return lambda t, e: (t - lo_t) * 0.0 + alpha * ((e - lo_e) / span_e)
    if not w_e:
        return lambda t, e: (t - lo_t) * w_t
    return lambda t, e: (t - lo_t) * w_t + (e - lo_e) * w_e


def _recency(t, e):
    return t


_INLINED_SCORER = scorer  # the `scorer` whose operations `score_each` inlines


def score_each(s: Scale, t: list, e: list) -> list:
    """`scorer(s)` on each candidate of two parallel lists of floats, as a list: each score is
    `scorer(s)(t[i], e[i])` bit for bit (the same operations in the same order, in one
    comprehension rather than a call per candidate: a small candidate index scores its handful
    of candidates so at every eviction). The list form of the rule: the comprehensions below are
    `scorer`'s operations, inlined while `scorer` is this module's own; a `scorer` put in its place
    (a new rule, a mutant) is applied as it stands, so that replacing `scorer` replaces this too."""
    if scorer is not _INLINED_SCORER:
        return list(map(scorer(s), t, e))
    if s is LRU_SCALE:
        return t
    if s.spans is not None:
        return list(map(scorer(s), t, e))
    lo_t, lo_e, w_t, w_e = s.lo_t, s.lo_e, s.w_t, s.w_e
    if not w_e:
        return [(x - lo_t) * w_t for x in t]
    return [(x - lo_t) * w_t + (y - lo_e) * w_e for x, y in zip(t, e)]


def utility(t, e, s: Scale):
    """The score of one candidate (floats) or of each of several (numpy arrays) under `s`
    (`scorer(s)(t, e)`)."""
    return scorer(s)(t, e)


def scores(t: np.ndarray, e: np.ndarray, alpha: float) -> np.ndarray:
    """Every candidate's score, normalized over these candidates (the definition, from scratch;
    alpha = 0: the recency itself)."""
    if not len(t) or not alpha:
        return np.asarray(t, dtype=float)
    return utility(t, e, scale(float(t.min()), float(t.max()), float(e.min()), float(e.max()), alpha))


def lowest_slot(values, least_key) -> int:
    """The position of the lowest of `values` (a numpy array or a list); among positions holding
    exactly that value, `least_key(positions)`: the one with the smallest tie key. The keys are
    read only on a tie."""
    if isinstance(values, list):
        best = min(values)
        slot = values.index(best)
        if values.count(best) > 1:
            slot = least_key([i for i, v in enumerate(values) if v == best])
        return slot
    slot = int(values.argmin())
    equal = values == values[slot]
    if np.count_nonzero(equal) == 1:
        return slot
    return least_key(np.flatnonzero(equal))

