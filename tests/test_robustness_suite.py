"""The robustness suite's traces: Mooncake halves and slices partition what they should, the
adversarial traces are built as described, and the dev and held-out parts do not overlap."""

import numpy as np
import pytest

from sglang_marconi.policy.tuning.sampling import session_in_sample
from sglang_marconi.sim import robustness as R


def test_halves_split_sessions_and_slices_keep_arrival_order(mooncake_path):
    trace = R.mooncake(path=mooncake_path)
    a, b = R.mooncake_half(trace, 1, 0), R.mooncake_half(trace, 1, 1)
    assert len(a) + len(b) == len(trace) and not set(a.session_ids()) & set(b.session_ids())
    assert all(session_in_sample(s, 0.5, 1) for s in a.session_ids()[:200])
    sl = R.mooncake_slice(trace, 4000, 100)
    assert len(sl) == 100 and sl.name != trace.name
    lengths = trace.request_lengths()[4000:4100]
    assert (sl.request_lengths() == lengths).all()
    assert R.mooncake("blocks", mooncake_path).name != trace.name  # fixed-choice results are keyed by name


def test_misleading_sample_puts_exactly_the_chats_in_the_tuners_sample():
    w = R.misleading_sample(1)
    sampled = [r for r in w if session_in_sample(r.session_id, 0.2)]
    others = [r for r in w if not session_in_sample(r.session_id, 0.2)]
    assert sampled and len({r.session_id for r in others}) > 5 * len({r.session_id for r in sampled})
    assert all(r.turn >= 0 for r in sampled) and max(r.turn for r in sampled) > 5  # multi-turn chats
    assert max(r.turn for r in others) == 0  # single-request sessions only
    arrivals = [r.arrival_s for r in w]
    assert arrivals == sorted(arrivals)


def test_shift_halfway_adds_documents_only_in_the_second_half():
    w = R.shift_halfway(1)
    reqs = list(w)
    end = reqs[-1].arrival_s
    docs = [r for r in reqs if r.session_id.startswith("docs/")]
    chats = [r for r in reqs if r.session_id.startswith("chat/")]
    assert docs and chats and min(r.arrival_s for r in docs) >= max(r.arrival_s for r in chats) / 2 - 1e-9
    assert min(len(r.input_tokens) for r in docs) >= 2000 and end >= max(r.arrival_s for r in docs)


def test_huge_sessions_are_few_and_carry_a_large_share_of_tokens():
    w = R.huge_sessions(1)
    tokens = {}
    for r in w:
        tokens[r.session_id.split("/")[0]] = tokens.get(r.session_id.split("/")[0], 0) + r.input_len
    sessions = set(w.session_ids())
    giants = {s for s in sessions if s.startswith("giant/")}
    assert len(giants) == 3 and len(sessions) > 3000 and tokens["giant"] > 0.4 * (tokens["giant"] + tokens["crowd"])


def test_dev_and_held_out_do_not_share_a_workload(mooncake_path):
    cells = R.suite(mooncake_path=mooncake_path)
    dev = {c.workload for c in cells if c.group == "dev"}
    held = {c.workload for c in cells if c.group == "held-out"}
    assert dev and held and not dev & held
    assert {c.family for c in cells} >= {"mooncake-half", "mooncake-slice", "synthetic:lmsys", "adversarial:shift-halfway"}
    quick = R.suite(("dev",), mooncake_path=mooncake_path, quick=True)
    assert len(quick) < len([c for c in cells if c.group == "dev"])


def test_one_shot_documents_are_never_reused():
    w = R.one_shot_documents(50, 3, rate=1.0)
    firsts = [tuple(r.input_tokens[:8].tolist()) for r in w]
    assert len(set(firsts)) == 50 and len(set(w.session_ids())) == 50
    assert np.all(np.diff([r.arrival_s for r in w]) > 0)
