"""End-to-end replays whose hit counts are checked by hand, and the CLI contract."""

import dataclasses
import json

import numpy as np
import pytest

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.sim.cli import main
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.traces import save_trace
from sglang_marconi.sim.units import parse_bytes, parse_capacities
from sglang_marconi.sim.workload import ListWorkload, Request

SYSTEM = np.arange(1000, 1100)  # 100-token system prompt


def req(sid, turn, inp, out):
    return Request(sid, turn, float(turn), np.asarray(inp), np.asarray(out))


def hand_workload():
    a1 = np.concatenate((SYSTEM, [1, 2, 3]))
    b1 = np.concatenate((SYSTEM, [4, 5]))
    c1 = np.concatenate((SYSTEM, [6]))
    a2 = np.concatenate((a1, [7, 7], [8, 8, 8]))  # a1 + its output + 3 new tokens
    return ListWorkload("hand", [
        req("a", 0, a1, [7, 7]),  # cold: 0
        req("b", 0, b1, [9]),  # branch at 100 found and checkpointed: 0 for SGLang+/Marconi
        req("c", 0, c1, [9]),  # reuses the system prompt: 100
        req("a", 1, a2, [5]),  # continues after a's last decoded token: 105
    ])


@pytest.mark.parametrize("policy, hits", [
    ("none", [0, 0, 0, 0]),
    ("sglang+", [0, 0, 100, 105]),
    ("marconi", [0, 0, 100, 105]),
    ("marconi:1", [0, 0, 100, 105]),
    ("infinite", [0, 100, 100, 105]),
    ("vllm+", [0, 96, 96, 96]),  # whole 32-token blocks: 3 blocks of the prompt; a2's 4th block spans 96..128
])
def test_hand_checked_hits(policy, hits):
    profile = load_profile("paper-7b")
    capacity = 10**12
    run = replay(hand_workload(), build_policy(policy, profile, capacity), profile, capacity, progress=False)
    assert run.per_request["hit_tokens"] == hits
    assert run.token_hit_rate == pytest.approx(sum(hits) / (103 + 102 + 101 + 108))
    assert run.request_hit_rate == pytest.approx(sum(h > 0 for h in hits) / 4)
    assert run.flops_saved == pytest.approx(sum(profile.prefill_flops(0, h) for h in hits))


def test_cli_contract(tmp_path, capsys):
    trace = save_trace(hand_workload(), tmp_path / "hand.jsonl")
    out, png = tmp_path / "runs.json", tmp_path / "plot.png"
    rc = main(["--trace", str(trace), "--model", "paper-7b", "--capacity", "2GB,5GiB",
               "--policies", "none,vllm+,sglang+,marconi", "--json", str(out), "--plot", str(png),
               "--block-size", "32", "--no-progress"])
    assert rc == 0
    runs = json.loads(out.read_text())
    assert [(r["policy"], r["capacity_bytes"]) for r in runs] == [
        ("none", 2 * 10**9), ("vllm+", 2 * 10**9), ("vllm+", 5 * 2**30), ("sglang+", 2 * 10**9),
        ("sglang+", 5 * 2**30), ("marconi", 2 * 10**9), ("marconi", 5 * 2**30)]
    for r in runs:
        for key in ("token_hit_rate", "request_hit_rate", "flops_saved", "wall_seconds", "alpha_history"):
            assert key in r
    assert runs[-1]["token_hit_rate"] == pytest.approx(205 / 414)
    assert png.stat().st_size > 10_000
    assert "MODELED" in capsys.readouterr().out


def test_cli_fixed_alpha(tmp_path):
    trace = save_trace(hand_workload(), tmp_path / "hand.jsonl")
    out = tmp_path / "runs.json"
    assert main(["--trace", str(trace), "--capacity", "1GB", "--policies", "marconi", "--alpha", "0.5",
                 "--json", str(out), "--no-progress"]) == 0
    (run,) = json.loads(out.read_text())
    assert run["alpha_history"] == [[0, 0.5]]
    assert run["choice_history"] == [[0, "0.5"]]


def test_choice_history_tells_sglang_lru_from_alpha_zero():
    profile = load_profile("paper-7b")
    run = replay(hand_workload(), build_policy("marconi:0", profile, 10**12), profile, 10**12, progress=False)
    stats = dataclasses.replace(run.stats, eviction_history=[(0, "marconi"), (2, "lru-leaves")])
    run = dataclasses.replace(run, alpha_history=[(0, 0.0), (2, 0.0)], stats=stats)
    assert run.choice_history() == [(0, "0"), (2, "lru")]
    assert run.choices_used() == ["0", "lru"]
    assert run.to_json()["choice_history"] == [[0, "0"], [2, "lru"]]


@pytest.mark.parametrize("args, message", [
    (["--capacity", "5XB"], "5XB"),
    (["--capacity", "0GB"], "0GB"),
    (["--policies", "lru"], "lru"),
    (["--model", "gpt-9"], "gpt-9"),
    (["--alpha", "-1"], "alpha"),
    (["--trace", "/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl"),
    (["--capacity", "10MB"], "capacity"),  # smaller than one request's two SSM states
])
def test_cli_errors_name_the_bad_value(args, message, capsys):
    assert main(args + ["--no-progress", "--limit", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_malformed_trace_line_reported_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    assert main(["--trace", str(bad), "--no-progress"]) == 2
    assert f"{bad}:2" in capsys.readouterr().err


def test_mooncake_prefix_replay(mooncake_path):
    """The first 300 Mooncake requests: every policy stays within the infinite-cache bound."""
    from sglang_marconi.sim.traces import load_trace

    profile, workload = load_profile("paper-7b"), load_trace(mooncake_path)
    runs = {p: replay(workload, build_policy(p, profile, 100 * 10**9), profile, 100 * 10**9, progress=False, limit=300)
            for p in ("vllm+", "sglang+", "marconi", "infinite")}
    bound = np.array(runs["infinite"].per_request["hit_tokens"])
    for name, run in runs.items():
        assert (np.array(run.per_request["hit_tokens"]) <= bound).all(), name
    # block 0 (512 tokens) is shared by every request: checkpointed by the 2nd, reused from the 3rd on
    assert min(runs["sglang+"].per_request["hit_tokens"][2:]) >= 512


def test_units():
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("1.5TB") == 1_500 * 10**9 and parse_bytes("512") == 512
    assert parse_capacities("1GB, 2GB") == [10**9, 2 * 10**9]
    for bad in ("", "GB", "-1GB", "1 parsec"):
        with pytest.raises(MarconiError):
            parse_capacities(bad)


def test_a_log_gets_one_line_per_finished_run(tmp_path, capsys):
    # stderr is not a terminal here (as in `bash scripts/demo.sh > log.txt 2>&1`): no progress
    # frames, one line per run (marconi-best's candidates are runs too)
    trace = save_trace(hand_workload(), tmp_path / "hand.jsonl")
    assert main(["--trace", str(trace), "--capacity", "2GB,5GB", "--policies", "none,sglang+,marconi-best",
                 "--alpha-grid", "0,20", "--seglen-weights", "none"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 1 + 2 + 2 * 3, lines  # none once; sglang+ per capacity; 3 candidates per capacity
    assert lines[0].startswith("none @ 2 GB: 4 requests, token hit 0.00%")
    assert sum(line.startswith("sglang+ @ ") for line in lines) == 2


def test_a_terminal_gets_a_progress_bar():
    import io

    from sglang_marconi.sim.replay import Progress, tqdm

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    if tqdm is None:
        pytest.skip("tqdm not installed")
    profile = load_profile("paper-7b")
    stream = Terminal()
    progress = Progress(4, "sglang+ @ 1000 GB", True, stream)
    for _ in range(4):
        progress.update()
    run = replay(hand_workload(), build_policy("sglang+", profile, 10**12), profile, 10**12, progress=False)
    progress.finish(run)
    assert "\r" in stream.getvalue() and "requests, token hit" not in stream.getvalue()
    silent = io.StringIO()
    Progress(4, "x", False, silent).finish(run)
    assert silent.getvalue() == ""
