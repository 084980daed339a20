"""`scripts/bench_policies.py --tuner KEY=VALUE,...`: the tuner's settings a run of the sweeps or the
suite changes (how the benchmarks show what the never-below-LRU guard costs and buys), parsed
strictly and applied to every tuned cell."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_policies.py"


@pytest.fixture()
def script():
    namespace = runpy.run_path(str(SCRIPT))
    return SimpleNamespace(**namespace, namespace=namespace["main"].__globals__)


def test_settings_parse_numbers_integers_and_yes_no(script):
    config = script.tuner_settings("guard_margin=1e9,live_guard=false,epoch=8,z=2.5")
    assert (config.guard_margin, config.live_guard, config.epoch, config.z) == (1e9, False, 8, 2.5)
    assert script.tuner_settings("") == ShadowConfig()


@pytest.mark.parametrize("bad", ["foo=1", "z", "epoch=2.5", "live_guard=maybe", "guard_margin=abc",
                                 "sample_rate=0.5", "alpha_grid=1"])
def test_a_bad_setting_is_named_in_one_line(script, bad):
    with pytest.raises(ValueError) as err:
        script.tuner_settings(f"z=2,{bad}")
    message = str(err.value)
    assert repr(bad) in message and "\n" not in message


def test_main_refuses_a_bad_value_with_one_line(script, capsys, tmp_path):
    assert script.main(["--tuner", "guard_margin=-1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "guard_margin" in err and "\n" not in err


def test_the_settings_reach_every_tuned_cell(script, tmp_path):
    """main() installs the settings; a suite cell builds its tuner from them (the sweeps' cells read
    the same module setting)."""
    assert script.main(["--tuner", "guard_margin=1e9,live_guard=false", "--only", "nothing",
                        "--out", str(tmp_path)]) == 2  # an unknown sweep: stops after the settings
    seen = []

    class Stop(Exception):
        pass

    def capture(workload, profile, capacity, config, sample_rate):
        seen.append(config)
        raise Stop

    script.namespace["shadow_config_for"] = capture
    cell = SimpleNamespace(build=lambda: [], capacity_gb=1.0)
    with pytest.raises(Stop):
        script.namespace["suite_cell"](cell, None, None)
    assert seen and seen[0].guard_margin == 1e9 and seen[0].live_guard is False


def test_a_forced_sample_rate_reaches_the_tuned_cells_and_holds_two_states(script, tmp_path, capsys):
    """`--sample-rate R`: every tuned cell at R, where the shadows' scaled capacity holds a request's
    two states; below that, at the least rate that does. A bad rate is named in one line."""
    from sglang_marconi.policy.cost.model_profile import load_profile
    from sglang_marconi.sim.synthetic import generate

    assert script.main(["--sample-rate", "1.5", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sample-rate" in err and "1.5" in err and "\n" not in err
    assert script.main(["--sample-rate", "0.1", "--only", "nothing", "--out", str(tmp_path)]) == 2
    profile, workload = load_profile("paper-7b"), generate("lmsys", sessions=4, scale=0.05)
    assert script.namespace["SAMPLE_RATE"] == 0.1
    assert script.namespace["tuned_config"](workload, profile, int(10e9)).sample_rate == 0.1
    small = script.namespace["tuned_config"](workload, profile, int(0.2e9)).sample_rate
    assert 0.1 < small < 1 and int(0.2e9 * small) >= 2 * profile.ssm_state_bytes
    script.namespace["SAMPLE_RATE"] = None  # the automatic rate
    assert script.namespace["tuned_config"](workload, profile, int(10e9)).sample_rate == 1.0
