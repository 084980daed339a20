"""The simulator's host tier: `--host-capacity`, its JSON fields and table, and the modeled cost
of a load back."""

import json

import numpy as np
import pytest

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.sim.cli import main
from sglang_marconi.sim.host_link import link_bytes_per_s, modeled_load_seconds
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.units import parse_host_capacities
from sglang_marconi.sim.workload import ListWorkload, Request

WORKLOAD = "synthetic:lmsys:sessions=12,scale=0.3"
TIER_FIELDS = ("host_capacity_bytes", "device_hit_tokens", "host_hit_tokens", "device_token_hit_rate",
               "host_token_hit_rate", "requests_host_hit", "bytes_demoted", "bytes_loaded", "bytes_dropped",
               "bytes_evicted_host", "states_demoted", "states_dropped", "load_backs")


def test_cli_host_capacity_runs_each_pair(tmp_path, capsys):
    out = tmp_path / "runs.json"
    code = main(["--workload", WORKLOAD, "--capacity", "0.5GB,1GB", "--host-capacity", "0,2GB",
                 "--policies", "sglang+,marconi:1,infinite", "--json", str(out), "--no-progress"])
    assert code == 0
    runs = json.loads(out.read_text())
    assert [(r["policy"], r["capacity_bytes"], r.get("host_capacity_bytes")) for r in runs] == [
        ("sglang+", 5 * 10**8, None), ("sglang+", 5 * 10**8, 2 * 10**9),
        ("sglang+", 10**9, None), ("sglang+", 10**9, 2 * 10**9),
        ("marconi(alpha=1)", 5 * 10**8, None), ("marconi(alpha=1)", 5 * 10**8, 2 * 10**9),
        ("marconi(alpha=1)", 10**9, None), ("marconi(alpha=1)", 10**9, 2 * 10**9),
        ("infinite", 5 * 10**8, None)]
    for r in runs:
        if r.get("host_capacity_bytes"):
            assert all(f in r for f in TIER_FIELDS)
            assert r["device_hit_tokens"] + r["host_hit_tokens"] == r["hit_tokens"]
            assert r["host_rules"] == ("upstream-write-back" if r["policy"] == "sglang+" else "marconi")
    # a host tier only adds hits here (the device is the same, the host only keeps what it drops)
    by = {(r["policy"], r["capacity_bytes"], r.get("host_capacity_bytes")): r for r in runs}
    for policy in ("sglang+", "marconi(alpha=1)"):
        assert by[(policy, 10**9, 2 * 10**9)]["host_hit_tokens"] > 0
    text = capsys.readouterr().out
    assert "host tier" in text and "sglang+ +host 2 GB" in text and "GB loaded" in text


def test_cli_host_capacity_needs_a_policy_with_a_host_tier(capsys):
    assert main(["--workload", WORKLOAD, "--host-capacity", "1GB", "--policies", "vllm+,none", "--no-progress"]) == 2
    assert "--host-capacity" in capsys.readouterr().err


def test_cli_host_errors_name_the_bad_value(capsys):
    assert main(["--workload", WORKLOAD, "--policies", "sglang+", "--host-capacity", "lots", "--no-progress"]) == 2
    assert "cannot read capacity 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--workload", WORKLOAD, "--policies", "sglang+", "--host-alpha", "-1"])
    assert "--host-alpha must be a number >= 0 or 'device'" in capsys.readouterr().err


def test_host_alpha_device_follows_the_device():
    profile = load_profile("paper-7b")
    policy = build_policy("marconi:20", profile, 10**9, host_capacity=2 * 10**9, host_alpha=None)
    assert policy.cache.rules.host_alpha(policy.cache.eviction) == 20.0
    assert build_policy("marconi:20", profile, 10**9, host_capacity=10**9).cache.rules.host_alpha(None) == 1.0
    with pytest.raises(MarconiError, match="host-tier"):
        build_policy("vllm+", profile, 10**9, host_capacity=10**9)
    with pytest.raises(MarconiError, match="probation"):
        build_policy("sglang+", profile, 10**9, host_capacity=10**9, probation=True)


def test_parse_host_capacities():
    assert parse_host_capacities("0, 2GB,0.5GiB") == [0, 2 * 10**9, 2**29]
    with pytest.raises(MarconiError):
        parse_host_capacities(" , ")


def test_load_backs_cost_modeled_time():
    """A host hit is not free: its load back is added to the modeled TTFT."""
    profile = load_profile("paper-7b")
    prefix = np.arange(50_000)
    requests = [Request("a", 0, 0.0, prefix, np.arange(5)), Request("b", 0, 1.0, np.arange(10**6, 10**6 + 40_000), []),
                Request("a", 1, 2.0, np.concatenate((prefix, np.arange(5), [7])), [])]
    workload = ListWorkload("hand", requests)
    capacity = 50_005 * profile.kv_bytes_per_token + 3 * profile.ssm_state_bytes  # one request at a time
    run = replay(workload, build_policy("sglang+", profile, capacity, host_capacity=10**13), profile, capacity,
                 progress=False)
    assert run.per_request["host_hit_tokens"] == [0, 0, 50_005]
    loaded = run.per_request["loaded_bytes"][2]
    assert loaded == 50_005 * profile.kv_bytes_per_token + profile.ssm_state_bytes
    flops_left = profile.prefill_flops(50_005, 50_006)
    from sglang_marconi.sim.ttft_model import modeled_ttft_seconds

    assert run.per_request["modeled_ttft_s"][2] == pytest.approx(
        modeled_ttft_seconds(flops_left, run.gpu) + loaded / 25e9, abs=1e-6)


def test_host_link_bandwidths():
    assert link_bytes_per_s("A100-80GB") == 25e9
    assert link_bytes_per_s("4xA100-40GB") == 100e9
    assert link_bytes_per_s("H100-SXM") == 50e9
    assert float(modeled_load_seconds(50e9, "H200")) == pytest.approx(1.0)
