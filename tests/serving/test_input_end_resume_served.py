"""Turns that resume where the previous input ended (`policy/rules/input_end_resume.py`) in SGLang's
real cache and in the served-pools model, which call the one rule: a reasoning model's
conversations (each turn's history without its reasoning) under Mamba pressure keep the states
their next turns resume at; the two sides agree request by request, the rule's states counted
alike; without the rule both sides hit far less."""

import pytest

pytest.importorskip("sglang")

from test_backtrack_served import Pair  # noqa: E402

from sglang_marconi.policy.rules import input_end_resume  # noqa: E402
from sglang_marconi.sim.stress import reasoning_chat  # noqa: E402

MAMBA = 20  # Mamba slots: the KV pool holds every conversation, this pool does not


def replay(extra_buffer: bool):
    workload = list(reasoning_chat(8, 6, system=200))
    pair = Pair(extra_buffer, 3 if extra_buffer else 0, kv=100_000, mamba=MAMBA)
    rows = [pair.serve(r.input_tokens.tolist(), r.output_tokens.tolist()) for r in workload]
    counts = (pair.cc.cache.marconi.admission.input_end_states_kept, pair.sim.counters.input_end_states_kept)
    pair.close()
    return rows, counts, sum(len(r.input_tokens) for r in workload)


def test_reasoning_turns_keep_their_input_end_states_served_as_modeled(monkeypatch):
    rows, (served_kept, model_kept), total = replay(True)
    assert all(served == sim for served, sim in rows), [i for i, (a, b) in enumerate(rows) if a != b]
    assert served_kept == model_kept > 0  # the rule ran, alike on both sides
    on = sum(served for served, _ in rows)
    monkeypatch.setattr(input_end_resume, "applies", lambda extra_buffer, probation: False)
    rows_off, (none, _), _ = replay(True)
    off = sum(served for served, _ in rows_off)
    assert none == 0 and all(served == sim for served, sim in rows_off)
    assert on >= off + 0.03 * total, (on / total, off / total)  # 3 points of the input tokens at least


def test_no_buffer_does_not_run_it():
    """There two-pass prefill leaves a branch state at the previous input's end anyway."""
    rows, counts, _ = replay(False)
    assert counts == (0, 0) and all(served == sim for served, sim in rows)
