"""`http_api.same_up_to_numeric_ties`, the warm == cold comparison of the live tests, on made-up
generations (no server): it passes a near tie that the numeric gap can flip, and fails a token
that differs where the margin is large, a logprob that moved more than the gap, and a token that
is not the other run's runner-up."""

from __future__ import annotations

import pytest

from http_api import Generation, reads_decode_written_kv, same_up_to_numeric_ties

INPUT = [5, 6, 7]


def gen(steps, cached=0, input_ids=INPUT):
    """steps: per output position ((chosen logprob, token), (runner-up logprob, token))."""
    return Generation(list(input_ids), [best[1] for best, _ in steps], [best[0] for best, _ in steps],
                      len(input_ids), cached, [[best, second] for best, second in steps])


COLD = gen([((-0.5, 10), (-2.5, 11)), ((-0.70, 20), (-0.72, 21)), ((-0.3, 30), (-3.0, 31))])


def test_identical_outputs_are_the_same_even_at_gap_zero():
    result = same_up_to_numeric_ties(COLD, COLD, 0.0)
    assert result and result.compared == 3


def test_logprobs_within_the_gap_pass_and_beyond_it_fail():
    warm = gen([((-0.51, 10), (-2.5, 11)), ((-0.69, 20), (-0.72, 21)), ((-0.31, 30), (-3.0, 31))])
    assert same_up_to_numeric_ties(warm, COLD, 0.02)
    result = same_up_to_numeric_ties(warm, COLD, 0.0)  # exact arithmetic: any move is a failure
    assert not result and result.compared == 0 and "moved" in result.detail


def test_a_near_tie_that_flips_passes_and_ends_the_comparison():
    # Position 1: cold prefers 20 by 0.02, warm prefers 21 by 0.01; later tokens then differ freely.
    warm = gen([((-0.5, 10), (-2.5, 11)), ((-0.70, 21), (-0.71, 20)), ((-0.1, 99), (-5.0, 98))])
    result = same_up_to_numeric_ties(warm, COLD, 0.05)
    assert result and result.compared == 1 and "near tie" in result.detail
    # The same flip is a failure where the arithmetic is identical (gap 0), or the gap too small.
    assert not same_up_to_numeric_ties(warm, COLD, 0.0)
    assert not same_up_to_numeric_ties(warm, COLD, 0.01)  # margins 0.03 > 2 * 0.01


def test_a_token_that_differs_where_the_margin_is_large_fails():
    # Position 0: cold prefers 10 by 2.0; warm picks 11 (a real divergence, a wrong state).
    warm = gen([((-0.5, 11), (-2.5, 10)), ((-0.70, 20), (-0.72, 21)), ((-0.3, 30), (-3.0, 31))])
    result = same_up_to_numeric_ties(warm, COLD, 0.1)
    assert not result and result.compared == 0 and "not a near tie" in result.detail


def test_a_token_outside_the_other_runs_top_two_fails():
    warm = gen([((-0.5, 10), (-2.5, 11)), ((-0.70, 22), (-0.71, 20)), ((-0.3, 30), (-3.0, 31))])
    result = same_up_to_numeric_ties(warm, COLD, 0.5)
    assert not result and result.compared == 1 and "runner-up" in result.detail


def test_different_lengths_or_inputs_fail_and_a_bad_gap_is_refused():
    assert not same_up_to_numeric_ties(gen([((-0.5, 10), (-2.5, 11))]), COLD, 1.0)
    assert not same_up_to_numeric_ties(gen([((-0.5, 10), (-2.5, 11))] * 3, input_ids=[1]), COLD, 1.0)
    with pytest.raises(ValueError, match="-0.1"):
        same_up_to_numeric_ties(COLD, COLD, -0.1)


def test_reads_decode_written_kv():
    first = Generation([1, 2, 3], [4, 5], [-1.0, -1.0], 3, 0)
    prefill_hit = Generation([1, 2, 3, 9], [7], [-1.0], 4, 3)  # up to the end of `first`'s input
    decode_hit = Generation([1, 2, 3, 4, 8], [7], [-1.0], 5, 4)  # into `first`'s output
    assert not reads_decode_written_kv(prefill_hit, [first])
    assert reads_decode_written_kv(decode_hit, [first])
    assert not reads_decode_written_kv(Generation([1, 2, 3, 4, 8], [7], [-1.0], 5, 3), [first])  # hit stopped before
