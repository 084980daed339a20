"""Synthetic workloads and session sampling."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.synthetic import SYNTHETIC_KINDS, default_workload, generate
from sglang_marconi.sim.workload import ListWorkload, Request, sample_sessions, session_in_sample


def same(a, b) -> bool:
    return [(r.session_id, r.turn, r.arrival_s, r.input_tokens.tolist(), r.output_tokens.tolist()) for r in a] == [
        (r.session_id, r.turn, r.arrival_s, r.input_tokens.tolist(), r.output_tokens.tolist()) for r in b
    ]


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_deterministic_per_seed(kind):
    a = generate(kind, seed=5, sessions=6, scale=0.1)
    assert same(a, generate(kind, seed=5, sessions=6, scale=0.1))
    assert not same(a, generate(kind, seed=6, sessions=6, scale=0.1))
    assert same(a, a)  # re-iterable


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_turns_extend_previous_input_and_output(kind):
    w = generate(kind, seed=1, sessions=8, scale=0.1)
    last: dict[str, Request] = {}
    for r in w:
        assert r.input_len >= 1 and r.input_tokens.dtype == np.int64
        prev = last.get(r.session_id)
        if prev is None:
            assert r.turn == 0
        else:
            assert r.turn == prev.turn + 1
            full = prev.full_sequence()
            assert r.input_len > len(full)
            np.testing.assert_array_equal(r.input_tokens[: len(full)], full)
        last[r.session_id] = r


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_arrivals_sorted_and_sessions_interleave(kind):
    w = generate(kind, seed=2, sessions=10, session_rate=2.0, turn_gap_s=1.0, scale=0.1)
    arrivals = [r.arrival_s for r in w]
    assert arrivals == sorted(arrivals) and len(arrivals) == len(w)
    assert len(set(w.session_ids())) == 10
    if kind != "system-prompt":  # multi-turn sessions overlap in time
        sessions = [r.session_id for r in w]
        assert sum(a != b for a, b in zip(sessions, sessions[1:])) > 10


def test_swe_agent_shares_system_prompt():
    reqs = list(generate("swe-agent", seed=0, sessions=5, scale=0.1))
    first = [r for r in reqs if r.turn == 0]
    assert len(first) == 5
    common = min(r.input_len for r in reqs)
    k = 0
    while k < common and len({int(r.input_tokens[k]) for r in reqs}) == 1:
        k += 1
    assert k >= 180  # 2000-3000 tokens at scale 0.1
    assert max(Counter(r.session_id for r in reqs).values()) >= 10


def test_full_scale_shapes():
    sw = list(generate("swe-agent", seed=0, sessions=4))
    assert 2000 <= min(r.input_len for r in sw) and max(r.input_len for r in sw) > 20_000
    assert all(r.output_len <= 400 for r in sw)
    lm = list(generate("lmsys", seed=0, sessions=10))
    assert max(r.input_len for r in lm) <= 10_000 and np.median([r.output_len for r in lm]) > 150
    sg = list(generate("sharegpt", seed=0, sessions=10))
    assert np.mean([r.input_len < 2000 for r in sg]) > 0.8
    sp = list(generate("system-prompt", seed=0, sessions=200))
    heads = Counter(tuple(r.input_tokens[:16].tolist()) for r in sp)
    assert len(heads) == 3 and heads.most_common(1)[0][1] > 200 / 3


def test_default_workload_is_modest():
    w = default_workload()
    assert 100 <= len(w) <= 1000 and "swe-agent" in w.name


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"sessions": 0}, "sessions"),
        ({"sessions": 2.5}, "sessions"),
        ({"session_rate": 0}, "session_rate"),
        ({"session_rate": -1.0}, "session_rate"),
        ({"turn_gap_s": -1.0}, "turn_gap_s"),
        ({"scale": 0}, "scale"),
        ({"vocab": 0}, "vocab"),
    ],
)
def test_bad_parameters_are_named(kwargs, name):
    with pytest.raises(MarconiError, match=f"'{name}'"):
        generate("lmsys", **kwargs)


def test_unknown_kind_lists_known():
    with pytest.raises(MarconiError, match="'chess'.*'lmsys'.*'swe-agent'"):
        generate("chess")


def test_session_in_sample_stable_and_rate():
    ids = [f"session-{i}" for i in range(20000)]
    assert all(session_in_sample(s, 1.0) for s in ids[:100])
    kept = [s for s in ids if session_in_sample(s, 0.1)]
    assert abs(len(kept) / len(ids) - 0.1) < 0.01
    assert kept == [s for s in ids if session_in_sample(s, 0.1)]
    # nested: a smaller rate keeps a subset; a different salt picks a different sample
    assert set(s for s in ids if session_in_sample(s, 0.05)) <= set(kept)
    assert kept != [s for s in ids if session_in_sample(s, 0.1, salt=1)]
    # pinned values: stable across processes and releases
    assert [session_in_sample(f"session-{i}", 0.5) for i in range(8)] == PINNED
    for bad in (0, -0.1, 1.5):
        with pytest.raises(MarconiError, match="rate"):
            session_in_sample("x", bad)


PINNED = [False, True, False, False, False, True, False, False]  # blake2b, salt 0


def test_sample_sessions_keeps_whole_sessions():
    w = generate("lmsys", seed=0, sessions=40, scale=0.05)
    s = sample_sessions(w, 0.5, salt=3)
    reqs = list(s)
    assert len(reqs) == len(s) and 0 < len(s) < len(w)
    kept = {r.session_id for r in reqs}
    assert [r.session_id for r in w if r.session_id in kept] == [r.session_id for r in reqs]
    assert sample_sessions(w, 1.0) is w
    assert len(sample_sessions(ListWorkload("e", []), 0.5)) == 0
