"""Trace loading: Mooncake expansion, the authors' format, malformed input, workload specs."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from sglang_marconi.policy.errors import MarconiError, TraceError
from sglang_marconi.sim.synthetic import generate
from sglang_marconi.sim.traces import OUTPUT_BASE, load_trace, load_workload, save_trace
from sglang_marconi.sim.workload import ListWorkload, Request

MOONCAKE = Path(__file__).resolve().parents[1] / "../shared/data/mooncake/conversation_trace.jsonl"


def write_lines(tmp_path: Path, lines: list, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def mc(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_mooncake_expansion(tmp_path):
    path = write_lines(tmp_path, [mc(0, 1000, 5, [0, 1]), mc(1500, 1300, 0, [0, 1, 2]), mc(2000, 10, 3, [7])])
    w = load_trace(path)
    assert len(w) == 3 and w.name == "t"
    a, b, c = list(w)
    assert (a.input_len, b.input_len, c.input_len) == (1000, 1300, 10)
    assert (a.output_len, b.output_len, c.output_len) == (5, 0, 3)
    assert a.input_tokens.dtype == np.int64
    # shared blocks 0 and 1 give equal tokens; partial last block cut to input_length
    np.testing.assert_array_equal(a.input_tokens, b.input_tokens[:1000])
    np.testing.assert_array_equal(a.input_tokens[:512], np.arange(512))
    np.testing.assert_array_equal(b.input_tokens[1024:], 2 * 512 + np.arange(276))
    np.testing.assert_array_equal(c.input_tokens, 7 * 512 + np.arange(10))
    assert b.arrival_s == 1.5
    # outputs: disjoint from every input and from each other
    ins = np.concatenate([r.input_tokens for r in (a, b, c)])
    outs = np.concatenate([r.output_tokens for r in (a, b, c)])
    assert outs.min() >= OUTPUT_BASE > ins.max()
    assert len(np.unique(outs)) == len(outs)
    np.testing.assert_array_equal(a.full_sequence(), np.concatenate((a.input_tokens, a.output_tokens)))
    # re-iterable, same tokens each time
    np.testing.assert_array_equal(next(iter(w)).output_tokens, a.output_tokens)


def test_mooncake_sessions_and_turns(tmp_path):
    path = write_lines(tmp_path, [
        mc(0, 1024, 1, [0, 5]),
        mc(0, 600, 1, [0, 9]),
        mc(10, 2000, 1, [0, 5, 6, 8]),
        mc(20, 100, 1, [3]),
        mc(30, 3000, 1, [0, 5, 6, 8, 11, 12]),
    ])
    reqs = list(load_trace(path))
    assert [r.session_id for r in reqs] == ["5", "9", "5", "3", "5"]
    assert [r.turn for r in reqs] == [0, 0, 1, 0, 2]
    assert load_trace(path).session_ids() == ["5", "9", "5", "3", "5"]


def test_mooncake_sorted_by_arrival(tmp_path):
    path = write_lines(tmp_path, [mc(5000, 10, 1, [1]), mc(1000, 10, 1, [2]), mc(1000, 10, 1, [3])])
    assert [r.session_id for r in load_trace(path)] == ["2", "3", "1"]


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not present")
def test_real_mooncake_first_200_lines(tmp_path):
    with open(MOONCAKE) as f:
        head = list(islice(f, 200))
    path = tmp_path / "head.jsonl"
    path.write_text("".join(head))
    reqs = list(load_trace(path))
    assert len(reqs) == 200
    rows = [json.loads(l) for l in head]
    assert [r.input_len for r in reqs] == [row["input_length"] for row in rows]
    assert [r.output_len for r in reqs] == [row["output_length"] for row in rows]
    # block 0 is the shared system prompt: every request starts with the same 512 tokens
    assert all(row["hash_ids"][0] == 0 for row in rows)
    assert all(np.array_equal(r.input_tokens[:512], np.arange(512)) for r in reqs if r.input_len >= 512)
    assert [r.session_id for r in reqs] == [str(row["hash_ids"][1]) for row in rows]


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not present")
def test_real_mooncake_session_structure():
    w = load_trace(MOONCAKE)
    assert len(w) == 12031
    counts = Counter(w.session_ids())
    assert len(counts) == 7373 and max(counts.values()) == 43


# ------------------------------------------------------------------ malformed input

AUTH = {"session_id": "s", "turn_id": 0, "ts": 0.0, "input_tokens": [1, 2], "output_tokens": [3]}


@pytest.mark.parametrize(
    "lines, bad_line, fragment",
    [
        ([mc(0, 10, 1, [0]), "{not json"], 2, "bad JSON"),
        ([mc(0, 10, 1, [0]), "[1, 2]"], 2, "JSON object"),
        ([mc(0, 10, 1, [0]), {"timestamp": 0, "input_length": 10, "output_length": 1}], 2, "hash_ids"),
        ([mc(0, 10, 1, [0]), mc(0, 10, -1, [0])], 2, "output_length"),
        ([mc(0, 10, 1, [0]), mc(0, 10, 1.5, [0])], 2, "integer"),
        ([mc(0, 10, 1, [0]), mc(0, 0, 1, [])], 2, "empty input"),
        ([mc(0, 10, 1, [0]), mc(0, 10, 1, [0, 1])], 2, "ceil"),
        ([mc(0, 10, 1, [0]), mc(0, 10, 1, ["a"])], 2, "integers"),
        ([mc(0, 10, 1, [0]), mc("x", 10, 1, [0])], 2, "timestamp"),
        (["", mc(0, 10, 1, [0]), "", mc(0, 10, 1, [-3])], 4, "negative"),
        ([AUTH, {**AUTH, "input_tokens": []}], 2, "empty input"),
        ([AUTH, {**AUTH, "input_tokens": [1, 2.5]}], 2, "integers"),
        ([AUTH, {**AUTH, "input_tokens": [1, True]}], 2, "integers"),
        ([AUTH, {**AUTH, "output_tokens": -2}], 2, "output_tokens"),
        ([AUTH, {**AUTH, "turn_id": "3"}], 2, "turn_id"),
        ([AUTH, {k: v for k, v in AUTH.items() if k != "ts"}], 2, "'ts'"),
        ([AUTH, {**AUTH, "session_id": None}], 2, "session_id"),
        (["", {"foo": 1, "bar": 2}], 2, "unknown trace format"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, lines, bad_line, fragment):
    path = write_lines(tmp_path, lines)
    with pytest.raises(TraceError) as e:
        load_trace(path)
    msg = str(e.value)
    assert f"{path}:{bad_line}:" in msg and fragment in msg, msg


def test_unknown_format_names_fields(tmp_path):
    with pytest.raises(TraceError, match=r"fields seen: \['bar', 'foo'\]"):
        load_trace(write_lines(tmp_path, [{"foo": 1, "bar": 2}]))


def test_empty_and_missing_files(tmp_path):
    empty = write_lines(tmp_path, ["", "   "])
    with pytest.raises(TraceError, match="empty trace file"):
        load_trace(empty)
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="not a regular file"):
        load_trace(tmp_path)


# ------------------------------------------------------------------ authors' format


def test_authors_format_round_trip(tmp_path):
    w = generate("sharegpt", seed=3, sessions=4, scale=0.2)
    path = save_trace(w, tmp_path / "sub" / "w.jsonl")
    back = load_trace(path)
    assert len(back) == len(w)
    for a, b in zip(w, back):
        assert (a.session_id, a.turn, a.arrival_s) == (b.session_id, b.turn, b.arrival_s)
        np.testing.assert_array_equal(a.input_tokens, b.input_tokens)
        np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    assert back.session_ids() == w.session_ids()
    assert len(list(back)) == len(w)  # re-iterable


def test_authors_output_count_expands_to_unique_tokens(tmp_path):
    path = write_lines(tmp_path, [
        {**AUTH, "ts": 2.0, "output_tokens": 4},
        {**AUTH, "session_id": 7, "ts": 1.0, "output_tokens": 3},
    ])
    a, b = list(load_trace(path))
    assert (a.session_id, a.output_len, b.output_len) == ("7", 3, 4)
    assert len(np.unique(np.concatenate((a.output_tokens, b.output_tokens)))) == 7


def test_save_hand_made_workload(tmp_path):
    w = ListWorkload("x", [Request("s", 0, 0.5, np.array([5, 6]), np.array([], dtype=np.int64))])
    (r,) = list(load_trace(save_trace(w, tmp_path / "x.jsonl")))
    assert r.input_tokens.tolist() == [5, 6] and r.output_len == 0 and r.arrival_s == 0.5


# ------------------------------------------------------------------ CLI workload specs


def test_load_workload_specs(tmp_path):
    w = load_workload("synthetic:lmsys:seed=1,sessions=3,session_rate=0.5,turn_gap_s=10,scale=0.1")
    assert w.name.startswith("synthetic:lmsys:seed=1,sessions=3")
    assert {r.session_id for r in w} == {"lmsys-0", "lmsys-1", "lmsys-2"}
    assert len(load_workload("synthetic:system-prompt")) == 500
    path = write_lines(tmp_path, [mc(0, 10, 1, [0])])
    assert len(load_workload(str(path))) == 1
    with pytest.raises(MarconiError, match="'bogus'"):
        load_workload("synthetic:lmsys:bogus=1")
    with pytest.raises(MarconiError, match="'sessions'.*'many'"):
        load_workload("synthetic:lmsys:sessions=many")
    with pytest.raises(MarconiError, match="key=value"):
        load_workload("synthetic:lmsys:seed")
    with pytest.raises(MarconiError, match="'chess'"):
        load_workload("synthetic:chess")
    with pytest.raises(TraceError, match="no such trace file"):
        load_workload(str(tmp_path / "missing.jsonl"))


def test_stress_workloads_load_by_spec_and_bad_specs_name_the_value():
    assert len(load_workload("stress:chain-fanout:n=40")) == 40
    assert len(load_workload("stress:agent-backtrack:sessions=2,steps=5")) == 10
    assert len(load_workload("stress:reasoning-chat:sessions=3,turns=4")) == 12
    with pytest.raises(MarconiError, match="unknown stress kind 'nope'"):
        load_workload("stress:nope")
    with pytest.raises(MarconiError, match="'sessions' needs an integer, got 'x'"):
        load_workload("stress:reasoning-chat:sessions=x")
    with pytest.raises(MarconiError, match="backtrack must be a probability"):
        load_workload("stress:agent-backtrack:backtrack=2")


def test_a_reasoning_chat_turn_extends_the_previous_input_but_not_its_decoded_reasoning():
    from sglang_marconi.sim.stress import reasoning_chat

    last = {}
    for r in reasoning_chat(sessions=3, turns=5, seed=1):
        previous = last.get(r.session_id)
        if previous is not None:
            inp, out = previous
            assert np.array_equal(r.input_tokens[: len(inp)], inp)  # the previous input, whole
            assert r.input_tokens[len(inp)] != out[0]  # then the answer alone, not the reasoning
            assert any(np.array_equal(r.input_tokens[len(inp): len(inp) + k], out[-k:]) for k in range(1, len(out)))
        last[r.session_id] = (r.input_tokens, r.output_tokens)
