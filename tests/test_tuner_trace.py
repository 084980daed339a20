"""`scripts/tuner_trace.py`, the tuner's evidence over a replay: recording it leaves the tuned replay
unchanged, every switch the tuner made is in the record at the request it made it, and the hindsight
gap is located where it accrued."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, choice_label
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.traces import load_workload
from sglang_marconi.sim.tuning import shadow_config_for

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tuner_trace.py"
# a cell where the tuner switches early (LRU, then a value-first choice) on a 500-request trace
WORKLOAD, CAPACITY = "synthetic:system-prompt", int(0.5e9)


def _script():
    return SimpleNamespace(**runpy.run_path(str(SCRIPT)))


def test_the_gap_is_located_where_it_accrued():
    gap = _script().where_the_gap_accrues(tuned_hits=[0, 2, 0, 0, 0, 0, 0, 0, 0, 0],
                                          best_hits=[0, 0, 2, 3, 0, 0, 0, 0, 0, 4])
    assert gap["final_lead_tokens"] == 7
    assert gap["last_request_not_ahead"] == 3  # behind after request 2, level after 3, ahead from 4 on
    assert gap["lead_before_last_tenth_tokens"] == 3  # the last request's 4 tokens come after it


def test_recording_changes_nothing_and_holds_every_switch(capsys):
    script = _script()
    result = script.run(WORKLOAD, "paper-7b", CAPACITY, None, False)

    workload, profile = load_workload(WORKLOAD), load_profile("paper-7b")
    config = shadow_config_for(workload, profile, CAPACITY, ShadowConfig(), None)
    plain = build_policy("marconi", profile, CAPACITY, tuning=config)
    run = replay(workload, plain, profile, CAPACITY, progress=False)
    assert result["tuned_hit_rate"] == run.token_hit_rate
    decisions = [(n, choice_label(c)) for n, c in plain.tuner.log.decisions]
    assert [tuple(d) for d in result["decisions"]] == decisions and len(decisions) > 1
    switches = [(t["request"], t["switched_to"]) for t in result["trace"] if t["switched_to"]]
    assert switches == decisions[1:]
    # no shadow was pruned on this short trace, and none is recorded as pruned
    assert plain.tuner.log.pruned == 0 and not any(t["pruned"] for t in result["trace"])
    # each record's leads are over LRU (arm 0) and the hindsight best is the best fixed replay
    assert all(t["lead_over_lru"]["long"][0] == 0.0 for t in result["trace"])
    best = max(result["candidates"].values(), key=lambda c: c["flops_saved"])
    assert result["best_hit_rate"] == best["token_hit_rate"]
    tuned_hits = np.asarray(run.per_request["hit_tokens"])
    assert result["gap"]["final_lead_tokens"] == round(result["best_hit_rate"] * run.input_tokens) - tuned_hits.sum()
    assert "decisions: lru@0 > " in capsys.readouterr().out


def test_the_robustness_suites_adversarial_traces_are_named_as_in_the_suite():
    script = _script()
    assert script.workload_named("adversarial:shift-halfway:seed=2").name == "adversarial:shift-halfway:seed=2"
    with pytest.raises(MarconiError, match="'adversarial:nope:seed=2'"):
        script.workload_named("adversarial:nope:seed=2")
    with pytest.raises(MarconiError, match="'adversarial:shift-halfway'"):
        script.workload_named("adversarial:shift-halfway")
