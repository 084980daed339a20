"""Session sampling answers from its memo exactly what it computes, and a bad rate is refused
even for a session whose answer under a good rate is remembered."""

import pytest

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.tuning.sampling import session_in_sample


def test_remembered_answers_are_the_computed_ones():
    keys = [f"session-{i}\0{i % 3}" for i in range(300)]
    for rate, salt in ((0.5, 1), (0.25, 0), (1.0, 0)):
        computed = [session_in_sample.__wrapped__(key, rate, salt) for key in keys]
        assert [session_in_sample(key, rate, salt) for key in keys] == computed
        assert [session_in_sample(key, rate, salt) for key in keys] == computed  # now remembered
    assert 100 < sum(session_in_sample(key, 0.5, 1) for key in keys) < 200


@pytest.mark.parametrize("bad", [True, 0, 1.5, -0.5])
def test_a_bad_rate_is_refused_after_a_good_one_was_remembered(bad):
    session_in_sample("s", 1)
    session_in_sample("s", 1.0)
    with pytest.raises(MarconiError, match="sampling rate"):
        session_in_sample("s", bad)
