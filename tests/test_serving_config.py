"""Marconi's serving flags and the launcher's checks (no SGLang needed)."""

import argparse

import pytest

from sglang_marconi.launch_server import gpu_problem, main, prepare
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.serving.config import ENV_VAR, MarconiServingConfig, add_marconi_args, config_from_args


def parse(*argv):
    p = argparse.ArgumentParser()
    add_marconi_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_defaults_and_round_trip_through_the_environment():
    config = parse()
    assert config.alpha is None and config.alpha_grid == (0.0, 1.0, 20.0, 100.0) and config.tune_workers == 1
    assert config.tuning().choices == ("lru", 0.0, 1.0, 20.0, 100.0, "seglen:1", "seglen:100")
    assert parse("--marconi-seglen-weights", "none").tuning().choices[-1] == 100.0
    assert MarconiServingConfig.from_env({ENV_VAR: config.to_env()}) == config
    fixed = parse("--marconi-alpha", "0.7", "--marconi-alpha-grid", "0,1", "--marconi-admission", "off")
    assert (fixed.alpha, fixed.alpha_grid, fixed.admission) == (0.7, (0.0, 1.0), False)


@pytest.mark.parametrize("flag, value", [
    ("--marconi-alpha", "-1"), ("--marconi-alpha", "lots"), ("--marconi-alpha-grid", "2:0:0.1"),
    ("--marconi-retune", "maybe"), ("--marconi-objective", "latency"), ("--marconi-admission", "yes"),
    ("--marconi-bootstrap-multiplier", "0"), ("--marconi-tune-workers", "two"), ("--marconi-tune-workers", "-1"),
    ("--marconi-tune-sample-rate", "1.5"), ("--marconi-tune-sample-rate", "half"), ("--marconi-tune-epoch", "0"),
    ("--marconi-tune-margin", "-0.1"), ("--marconi-seglen-weights", "x"), ("--marconi-seglen-weights", "-1"),
    ("--marconi-backtrack-states", "-1"), ("--marconi-backtrack-states", "1.5"), ("--marconi-backtrack-states", "on"),
    ("--marconi-backtrack-states", "²"),
])
def test_bad_flag_values_name_the_flag(flag, value):
    with pytest.raises(MarconiError, match=flag):
        parse(flag, value)


def test_prepare_selects_marconi_backend_and_keeps_sglang_flags(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    argv = prepare(["--model-path", "m", "--tp", "2", "--marconi-alpha", "1"])
    assert argv == ["--model-path", "m", "--tp", "2", "--radix-cache-backend", "marconi"]
    assert MarconiServingConfig.from_env().alpha == 1.0
    assert prepare(["--model-path", "m", "--radix-cache-backend=other"])[-1] == "--radix-cache-backend=other"


def test_launcher_reports_missing_gpu_in_one_line(capsys):
    problem = gpu_problem(None)
    if problem is None:
        pytest.skip("this machine has a GPU")
    assert main(["--model-path", "m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GPU" in err and "Traceback" not in err


def test_launcher_rejects_bad_marconi_flag_before_anything_else(capsys):
    assert main(["--model-path", "m", "--marconi-objective", "speed"]) == 2
    assert "--marconi-objective" in capsys.readouterr().err


UPSTREAM_ONLY = ["--enable-hierarchical-cache", "--enable-session-radix-cache", "--enable-lmcache", "--enable-flexkv",
                 "--radix-eviction-policy", "lfu"]


def test_prepare_forwards_the_flags_marconi_steps_aside_for(monkeypatch):
    # They reach SGLang as given; the backend's factory builds upstream's cache for them (one
    # warning), exactly as through `python -m sglang.launch_server --radix-cache-backend marconi`.
    monkeypatch.delenv(ENV_VAR, raising=False)
    argv = prepare(["--model-path", "m", *UPSTREAM_ONLY, "--marconi-alpha", "1"])
    assert argv == ["--model-path", "m", *UPSTREAM_ONLY, "--radix-cache-backend", "marconi"]
    assert prepare(["--model-path", "m", "--radix-eviction-policy=fifo"])[:3] == [
        "--model-path", "m", "--radix-eviction-policy=fifo"]


def test_forwarded_flags_reach_sglangs_server_args(monkeypatch):
    pytest.importorskip("sglang")
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.delenv(ENV_VAR, raising=False)
    args = prepare_server_args(prepare(["--model-path", "m", *UPSTREAM_ONLY, "--marconi-admission", "off"]))
    assert (args.enable_hierarchical_cache, args.enable_session_radix_cache, args.enable_lmcache, args.enable_flexkv,
            args.radix_eviction_policy, args.radix_cache_backend) == (True, True, True, True, "lfu", "marconi")
    assert MarconiServingConfig.from_env().admission is False


@pytest.mark.parametrize("flag", ["--enable-unified-cache-external-linker", "--enable-int8-mamba-checkpoint",
                                  "--enable-kv-cache-sharding"])
def test_flags_sglang_allows_no_backend_with_are_not_given_marconi(monkeypatch, capsys, flag):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert prepare(["--model-path", "m", flag]) == ["--model-path", "m", flag]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err  # one warning line naming the flag
    assert prepare(["--model-path", "m", flag, "--radix-cache-backend", "other"])[-1] == "other"


@pytest.mark.parametrize("backend", [["--radix-cache-backend", "marconi"], ["--radix-cache-backend=marconi"]])
def test_marconi_asked_for_with_such_a_flag_is_refused_in_one_line(capsys, backend):
    assert main(["--model-path", "m", "--enable-int8-mamba-checkpoint", *backend]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--enable-int8-mamba-checkpoint" in err and "Traceback" not in err


def test_backtrack_states_flag_reaches_the_config_and_the_environment():
    assert parse().backtrack_states is None  # auto: the rule's default for the Mamba strategy
    for flag, count in (("0", 0), ("4", 4), ("auto", None)):
        config = parse("--marconi-backtrack-states", flag)
        assert config.backtrack_states == count
        assert MarconiServingConfig.from_env({ENV_VAR: config.to_env()}).backtrack_states == count


@pytest.mark.parametrize("off", ["--marconi-probation", "--marconi-admission"])
def test_backtrack_states_need_marconis_admission_and_probation(off, capsys):
    assert parse("--marconi-backtrack-states", "0", off, "off").backtrack_states == 0
    assert parse(off, "off").backtrack_states is None
    with pytest.raises(MarconiError, match="--marconi-backtrack-states '2'.*needs"):
        parse("--marconi-backtrack-states", "2", off, "off")
    assert main(["--model-path", "m", "--marconi-backtrack-states", "many"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--marconi-backtrack-states" in err and "'many'" in err
