"""Mooncake block ids -> tokens: the literal block expansion and the conversation reconstruction."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_marconi.sim.mooncake_tokens import MooncakeTokenizer
from sglang_marconi.sim.traces import load_trace, output_tokens_for

MOONCAKE = Path(__file__).resolve().parents[1] / "../shared/data/mooncake/conversation_trace.jsonl"
B = 8  # a small block keeps the arrays readable


def serve(tokenizer, records):
    """[(ids, input_len, output_len)] -> [(input tokens, output tokens)] in order."""
    out = []
    for i, (ids, n_in, n_out) in enumerate(records):
        outputs = output_tokens_for(i, n_out)
        out.append((tokenizer.input_tokens(ids, n_in, outputs), outputs))
    return out


def test_blocks_mode_is_the_literal_expansion():
    (a, _), (b, _) = serve(MooncakeTokenizer("blocks", B), [([0, 1, 2], 20, 3), ([0, 1, 5, 6], 30, 1)])
    np.testing.assert_array_equal(a, np.concatenate([np.arange(8), 8 + np.arange(8), 16 + np.arange(4)]))
    # the next turn shares the two full blocks only, not the partial block 2 or the reply
    np.testing.assert_array_equal(b[:16], a[:16])
    np.testing.assert_array_equal(b[16:24], 5 * B + np.arange(8))


def test_next_turn_repeats_the_previous_tail_and_reply():
    t = MooncakeTokenizer("conversation", B)
    (a, a_out), (b, _) = serve(t, [([0, 1, 2], 20, 3), ([0, 1, 5, 6], 30, 1)])
    np.testing.assert_array_equal(b[:23], np.concatenate([a, a_out]))  # 20 input + 3 output tokens
    np.testing.assert_array_equal(b[23:24], 5 * B + np.arange(7, 8))  # the rest of block 5 is fresh
    np.testing.assert_array_equal(b[24:], 6 * B + np.arange(6))
    assert t.continuations == 1


def test_a_turn_ending_on_a_block_boundary_is_continued_too():
    (a, a_out), (b, _) = serve(MooncakeTokenizer("conversation", B), [([0, 1], 16, 2), ([0, 1, 4], 20, 1)])
    np.testing.assert_array_equal(b[:18], np.concatenate([a, a_out]))


@pytest.mark.parametrize(
    "second, why",
    [
        (([0, 7, 8], 24, 1), "shares only the system-prompt block"),
        (([0, 1, 5, 6], 22, 1), "shorter than the previous input + output"),
    ],
)
def test_not_a_continuation(second, why):
    t = MooncakeTokenizer("conversation", B)
    (a, _), (b, _) = serve(t, [([0, 1, 2], 20, 3), second])
    assert t.continuations == 0, why
    ids = second[0]
    np.testing.assert_array_equal(b[8:16], ids[1] * B + np.arange(8))


def test_later_requests_sharing_a_reconstructed_block_share_its_tokens():
    # b continues a; c shares b's first new block (same id) and must repeat b's tokens there.
    t = MooncakeTokenizer("conversation", B)
    (a, a_out), (b, _), (c, _) = serve(t, [([0, 1, 2], 20, 3), ([0, 1, 5, 6], 30, 1), ([0, 1, 5, 9], 26, 1)])
    np.testing.assert_array_equal(c[:24], b[:24])
    np.testing.assert_array_equal(c[24:], 9 * B + np.arange(2))


def test_the_latest_turn_is_the_parent():
    t = MooncakeTokenizer("conversation", B)
    (_, _), (a2, a2_out), (b, _) = serve(t, [([0, 1, 2], 20, 3), ([0, 1, 3], 20, 2), ([0, 1, 5], 24, 1)])
    np.testing.assert_array_equal(b[:22], np.concatenate([a2, a2_out]))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="'tokens'"):
        MooncakeTokenizer("tokens")
    with pytest.raises(ValueError, match="block_tokens 0"):
        MooncakeTokenizer("blocks", 0)


@st.composite
def chained_traces(draw):
    """Requests whose ids are prefix-chained as in Mooncake: a prefix of an earlier request's
    ids, then fresh ids."""
    records, all_ids, next_id = [], [], 100
    for _ in range(draw(st.integers(1, 12))):
        base = draw(st.sampled_from(all_ids)) if all_ids and draw(st.booleans()) else [0]
        keep = draw(st.integers(1, len(base)))
        extra = draw(st.integers(0, 4))
        ids = base[:keep] + list(range(next_id, next_id + extra))
        next_id += extra
        n_in = draw(st.integers((len(ids) - 1) * B + 1, len(ids) * B))
        records.append((ids, n_in, draw(st.integers(0, 12))))
        all_ids.append(ids)
    return records


@settings(max_examples=200, deadline=None)
@given(chained_traces())
def test_shared_block_ids_always_mean_shared_tokens(records):
    # Whatever is reconstructed, two requests agree on every full block whose id they share
    # (ids are prefix-chained, so they agree on everything up to it), and inputs have their length.
    streams = serve(MooncakeTokenizer("conversation", B), records)
    for (ids, n_in, _), (tokens, _) in zip(records, streams):
        assert tokens.size == n_in
    for i, (ids_i, n_i, _) in enumerate(records):
        for j in range(i):
            ids_j, n_j, _ = records[j]
            common = 0
            while common < min(len(ids_i), len(ids_j)) and ids_i[common] == ids_j[common]:
                common += 1
            upto = min(common * B, n_i, n_j)
            np.testing.assert_array_equal(streams[i][0][:upto], streams[j][0][:upto])


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not present")
def test_real_trace_continuations():
    t = MooncakeTokenizer("conversation")
    records = sorted((json.loads(line) for line in open(MOONCAKE)), key=lambda r: r["timestamp"])
    for i, r in enumerate(records):
        t.input_tokens(r["hash_ids"], r["input_length"], output_tokens_for(i, r["output_length"]))
    assert t.continuations == 3548  # the count sim/mooncake_tokens.py quotes
    # the loader's default is this reconstruction; 'blocks' keeps the literal expansion
    first = [r for r, _ in zip(load_trace(MOONCAKE), range(300))]
    literal = [r for r, _ in zip(load_trace(MOONCAKE, "blocks"), range(300))]
    assert any(not np.array_equal(a.input_tokens, b.input_tokens) for a, b in zip(first, literal))
