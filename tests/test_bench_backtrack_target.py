"""`scripts/bench_backtrack_states.py --target`: the choices it takes, and why a cell misses
"tuned >= upstream + target" (the verdict the issue's agent table reports)."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_backtrack_states.py"


@pytest.fixture(scope="module")
def script():
    return SimpleNamespace(**runpy.run_path(str(SCRIPT)))


def test_choices_parse_every_fixed_choice_the_served_cache_runs(script):
    assert script.parse_choices("lru,0,2.5,seglen:1,depth:4,depth:auto,auto") == [
        "lru", 0.0, 2.5, "seglen:1", "depth:4", "depth:auto", "auto"]


@pytest.mark.parametrize("bad", ["foo", "-1", "seglen:x", "depth:99", "coverage:1"])
def test_a_bad_choice_is_named_in_one_line(script, bad):
    with pytest.raises(SystemExit) as err:
        script.parse_choices(f"lru,{bad}")
    message = str(err.value)
    assert repr(bad) in message and "\n" not in message


def test_the_tuners_columns_are_its_choices_at_its_rule_setting(script):
    choices = ["lru", 1.0, 5.0, "seglen:1", "depth:4", "auto"]
    # extra_buffer runs the backtrack rule (3 per request), no_buffer does not; alpha 5 is not in
    # the default grid and `auto` is the tuner itself
    assert script.tuner_columns("extra_buffer", choices, 3) == ["lru+bt", "1+bt", "seglen:1+bt", "depth:4+bt"]
    assert script.tuner_columns("no_buffer", choices, 3) == ["lru", "1", "seglen:1", "depth:4"]
    assert script.tuner_columns("extra_buffer", choices, 2) == []  # its setting was not run


def _row(**values):
    return {"upstream": 80.0, "bound": 90.0, "tuned (default)": 81.0, **values}


@pytest.mark.parametrize("row, verdict", [
    (_row(**{"tuned (default)": 83.0, "a": 70.0, "b": 70.0}), "met"),
    (_row(bound=82.5, a=82.4, b=82.0), "above the bound"),
    (_row(a=82.9, b=82.0), "no fixed choice run reaches it"),
    (_row(a=83.1, b=82.0), "none of the tuner's choices reaches it; a does"),
    (_row(a=83.5, b=83.0), "the tuner's b reaches it; tuned does not"),
])
def test_the_verdict_names_what_stands_in_the_way(script, row, verdict):
    # fixed choices a and b were run; only b is one the tuner can adopt
    assert script.target_verdict(row, ["a", "b"], ["b"], 3.0) == verdict
