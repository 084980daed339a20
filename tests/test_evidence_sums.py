"""`Evidence`'s sums, kept in one buffer with the gains added once per window, against the
reference tuner's plain per-array updates (`tests/reference_shadow_tuner.py`): every sum equal bit
for bit after any stream of requests, and after the operations that reshape the evidence."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.tuning.evidence import Evidence
from tests.reference_shadow_tuner import Evidence as ReferenceEvidence


def assert_same(ev: Evidence, ref: ReferenceEvidence) -> None:
    for name in ("scores", "potential", "moments", "halves"):
        assert np.array_equal(getattr(ev, name), getattr(ref, name)), name
    assert ev.sessions.keys() == ref.sessions.keys()
    for key, (d, t, h, n) in ev.sessions.items():
        rd, rt, rh, rn = ref.sessions[key]
        assert np.array_equal(d, rd) and (t, h, n) == (rt, rh, rn), key


requests = st.lists(st.tuples(st.integers(0, 5), st.lists(st.floats(0, 1e13), min_size=4, max_size=4)),
                    min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(requests, st.sampled_from([(1000.0, 250.0), (float("inf"),), (3.0, 7.0)]), st.integers(1, 4))
def test_sums_equal_the_plain_updates_bit_for_bit(stream, half_lives, block):
    ev, ref = Evidence(4, half_lives, block=block), ReferenceEvidence(4, half_lives, block=block)
    for session, gains in stream:
        g = np.array(gains)
        ev.add(f"s{session}", g, float(sum(gains)))
        ref.add(f"s{session}", g, float(sum(gains)))
    assert_same(ev, ref)
    ev.copy_arm(2, 0)
    ref.copy_arm(2, 0)
    assert_same(ev, ref)
    assert_same(ev.select([3, 0]), ref.select([3, 0]))
    for a in range(4):
        for b in range(4):
            for w in range(len(half_lives)):
                assert ev.lead(a, b, w, 0.001, 0.5) == ref.lead(a, b, w, 0.001, 0.5)


def test_a_session_coming_back_adds_its_cross_moments_to_its_own_half():
    """A fixed stream that exercises both halves and a returning cluster (the cross terms)."""
    ev, ref = Evidence(3, (10.0,), block=4), ReferenceEvidence(3, (10.0,), block=4)
    for i in range(40):
        g = np.array([1.0 + i, 0.5 * i, 3.0])
        ev.add(f"s{i % 3}", g, 9.0)
        ref.add(f"s{i % 3}", g, 9.0)
    assert ev.halves[0, 0].any() and ev.halves[0, 1].any()
    assert_same(ev, ref)
