"""The operator's planner (`python -m sglang_marconi.plan`): every configuration in the table, the
recommended flags those of the best row, every number the simulator's own for that configuration,
one-line errors with exit code 2 for bad input, the plot written."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_marconi.plan import grid
from sglang_marconi.plan.grid import Plan, Row
from sglang_marconi.plan.cli import main, verdict
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.sim.cli import main as sim_main

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
MODEL = "nemotron-h-8b"
SYNTHETIC = "synthetic:lmsys:sessions=14"
SHARES = (0.5, 0.35, 0.02)  # 0.02 of 2GB is one Mamba slot: too few for any request


def plan(tmp_path, source: list[str], memory: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "out"
    argv = [*source, "--model", MODEL, "--memory", memory, "--out", str(out), "--no-progress", *extra]
    assert main(argv) == 0
    return json.loads((out / "plan.json").read_text()), str(out)


@pytest.fixture(scope="module")
def synthetic_plan(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("synthetic")
    return plan(tmp, ["--workload", SYNTHETIC], "2GB", "--host-memory", "4GB",
                "--mamba-shares", ",".join(map(str, SHARES)))


@pytest.fixture(scope="module")
def mooncake_plan(tmp_path_factory):
    if not MOONCAKE.exists():
        pytest.skip(f"no Mooncake trace at {MOONCAKE}")
    tmp = tmp_path_factory.mktemp("mooncake")
    return plan(tmp, ["--trace", str(MOONCAKE), "--limit", "40"], "20GB", "--host-memory", "40GB",
                "--mamba-shares", "0.5,0.1")


def expected_configs(profile, memory: int, shares) -> set:
    out = set()
    for share in shares:
        slots = int(share * memory // profile.ssm_state_bytes)
        kv = int((1 - share) * memory // profile.kv_bytes_per_token)
        for strategy, needed in (("no_buffer", 2), ("extra_buffer", 4)):
            if slots >= needed:
                out |= {(share, kv, slots, strategy, p) for p in ("lru", "marconi")}
    return out


@pytest.mark.parametrize("which", ["synthetic_plan", "mooncake_plan"])
def test_table_has_every_configuration(which, request):
    data, out = request.getfixturevalue(which)
    profile = load_profile(MODEL)
    memory, host, shares = {"synthetic_plan": (2 * 10**9, 4 * 10**9, SHARES),
                            "mooncake_plan": (20 * 10**9, 40 * 10**9, (0.5, 0.1))}[which]
    served = {(r["mamba_share"], r["kv_tokens"], r["mamba_slots"], r["strategy"], r["policy"])
              for r in data["rows"] if r["model"] == "served"}
    assert served == expected_configs(profile, memory, shares)
    assert len(served) == len([r for r in data["rows"] if r["model"] == "served"])  # each once
    tiered = sorted((r["host_bytes"], r["policy"]) for r in data["rows"] if r["model"] == "tiered")
    assert tiered == [(0, "lru"), (0, "marconi"), (host, "lru"), (host, "marconi")]
    if which == "synthetic_plan":  # the split too small for a request is named, not silently dropped
        assert any("Mamba 2% / KV 98%, no_buffer" in s for s in data["skipped"])
    assert Path(out, "plan.png").stat().st_size > 10_000


def flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


@pytest.mark.parametrize("which", ["synthetic_plan", "mooncake_plan"])
def test_recommended_flags_are_the_best_rows(which, request):
    data, _ = request.getfixturevalue(which)
    served = [r for r in data["rows"] if r["model"] == "served"]
    best = max(served, key=lambda r: (r["flops_saved_fraction"], r["token_hit_rate"], -r["modeled_ttft_p95_s"]))
    assert data["rows"][data["best"]] == best
    flags = data["recommended_flags"]
    assert flag(flags, "--max-mamba-cache-size") == str(best["mamba_slots"])
    assert flag(flags, "--max-total-tokens") == str(best["kv_tokens"])
    assert flag(flags, "--mamba-radix-cache-strategy") == best["strategy"]
    assert (flag(flags, "--radix-cache-backend") == "marconi") == (best["policy"] == "marconi")
    tiered = {(r["policy"], r["host_bytes"] > 0): r["flops_saved"] for r in data["rows"] if r["model"] == "tiered"}
    host_wins = tiered[best["policy"], True] > tiered[best["policy"], False] * (1 + grid.GAIN_THRESHOLD)
    assert data["host_tier_wins"] == host_wins
    assert ("--enable-hierarchical-cache" in flags) == host_wins
    if host_wins:
        assert flag(flags, "--hicache-write-policy") == "write_back"
        assert float(flag(flags, "--hicache-size")) * 1e9 == max(r["host_bytes"] for r in data["rows"])


@pytest.mark.parametrize("which", ["synthetic_plan", "mooncake_plan"])
def test_the_verdict_is_the_gain_of_marconis_best_over_lrus_best(which, request):
    data, _ = request.getfixturevalue(which)
    m, l = data["rows"][data["best_marconi"]], data["rows"][data["best_lru"]]
    assert m["policy"] == "marconi" and l["policy"] == "lru"
    assert m == max((r for r in data["rows"] if r["model"] == "served" and r["policy"] == "marconi"),
                    key=lambda r: (r["flops_saved_fraction"], r["token_hit_rate"], -r["modeled_ttft_p95_s"]))
    if m["flops_saved"] > l["flops_saved"] * (1 + grid.GAIN_THRESHOLD):
        assert data["verdict"].startswith("verdict: tuned Marconi saves")
        assert f"{100 * m['flops_saved_fraction']:.2f}% of prefill FLOPs ({m['label']})" in data["verdict"]
        assert f"LRU's best {100 * l['flops_saved_fraction']:.2f}% ({l['label']})" in data["verdict"]
    else:
        assert data["verdict"].startswith("verdict: nothing to gain here")
    if which == "synthetic_plan":  # this workload does reward Marconi at 2GB
        assert data["verdict"].startswith("verdict: tuned Marconi saves")


def test_nothing_to_gain_when_the_trace_has_little_reuse(tmp_path):
    data, _ = plan(tmp_path, ["--workload", SYNTHETIC, "--limit", "1"], "1GB", "--mamba-shares", "0.5")
    assert data["infinite"]["token_hit_rate"] == 0
    assert data["verdict"] == ("verdict: nothing to gain here: the trace has little reuse: infinite-cache token "
                               "hit rate 0.00%")


def test_nothing_to_gain_when_every_splits_lru_equals_marconi(tmp_path):
    # 4 GB holds this workload's prefixes (what is lost is the extra_buffer grid's), so the tuner finds
    # nothing to adopt; at 1 GB it adopts SegLen in extra_buffer (64.48% -> 70.63% token hit)
    data, _ = plan(tmp_path, ["--workload", "synthetic:lmsys:sessions=6"], "4GB", "--mamba-shares", "0.6")
    served = {(r["strategy"], r["policy"]): r for r in data["rows"] if r["model"] == "served"}
    for strategy in grid.STRATEGIES:
        assert served[strategy, "lru"]["hit_tokens"] == served[strategy, "marconi"]["hit_tokens"]
    assert data["verdict"].startswith("verdict: nothing to gain here: every split's LRU already equals Marconi")
    best = data["rows"][data["best"]]
    assert best["policy"] == "lru"  # a tie recommends upstream's cache: the first row listed
    assert "--radix-cache-backend" not in data["recommended_flags"]


def sim_runs(tmp_path, argv: list[str]) -> list[dict]:
    out = tmp_path / "sim.json"
    assert sim_main([*argv, "--model", MODEL, "--json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())


SAME = ("hit_tokens", "input_tokens", "token_hit_rate", "flops_saved", "modeled_ttft_p50_s", "modeled_ttft_p95_s")


@pytest.mark.parametrize("which", ["synthetic_plan", "mooncake_plan"])
def test_numbers_are_the_simulators_own(which, request, tmp_path):
    """The best row of each policy and the host-tier rows, run directly by `python -m sglang_marconi.sim`."""
    data, _ = request.getfixturevalue(which)
    source = ["--workload", SYNTHETIC] if which == "synthetic_plan" else ["--trace", str(MOONCAKE), "--limit", "40"]
    checked = 0
    for index in {data["best_marconi"], data["best_lru"]}:
        row = data["rows"][index]
        runs = sim_runs(tmp_path, [*source, "--kv-tokens", str(row["kv_tokens"]), "--mamba-slots",
                                   str(row["mamba_slots"]), "--mamba-radix-cache-strategy", row["strategy"],
                                   "--policies", row["simulator_policy"], "--probation"])
        assert len(runs) == 1
        assert {k: runs[0][k] for k in SAME} == {k: row[k] for k in SAME}
        checked += 1
    tiered = [r for r in data["rows"] if r["model"] == "tiered"]
    runs = sim_runs(tmp_path, [*source, "--capacity", str(tiered[0]["device_bytes"]), "--host-capacity",
                               f"0,{max(r['host_bytes'] for r in tiered)}", "--policies", "sglang+,marconi"])
    by_key = {(r["policy"], r.get("host_capacity_bytes", 0)): r for r in runs}
    for row in tiered:
        sim = by_key[row["simulator_policy"], row["host_bytes"]]
        assert {k: sim[k] for k in SAME} == {k: row[k] for k in SAME}
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("argv, start", [
    (["--trace", "/no/such/trace.jsonl", "--model", MODEL, "--memory", "80GB"],
     "error: /no/such/trace.jsonl: no such trace file"),
    (["--workload", SYNTHETIC, "--model", "no-such-model", "--memory", "80GB"], "error: unknown profile 'no-such-model'"),
    (["--workload", SYNTHETIC, "--model", MODEL, "--memory", "80 gigs"], "error: --memory: cannot read capacity '80 gigs'"),
    (["--workload", SYNTHETIC, "--model", MODEL, "--memory", "1GB", "--host-memory", "lots"],
     "error: --host-memory: cannot read capacity 'lots'"),
    (["--workload", SYNTHETIC, "--model", MODEL, "--memory", "100MB"],
     "error: --memory '100MB' is too small for one request: the longest request needs"),
    (["--workload", SYNTHETIC, "--model", "llama-3-8b", "--memory", "80GB"],
     "error: --model 'llama-3-8b': the planner splits memory between KV and Mamba pools"),
    (["--workload", SYNTHETIC, "--model", MODEL, "--memory", "80GB", "--limit", "0"], "error: --limit must be >= 1, got 0"),
    (["--workload", "synthetic:no-such-kind", "--model", MODEL, "--memory", "80GB"], "error: "),
])
def test_bad_input_is_one_line_and_exit_2(argv, start, capsys):
    assert main([*argv, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err.endswith("\n") and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(start), captured.err
    if argv[1].startswith("synthetic:no-such-kind"):
        assert "no-such-kind" in captured.err
    assert captured.out == ""


def test_the_best_row_ranks_by_flops_saved_then_hit_rate_then_ttft():
    def row(share, flops, hit, ttft):
        return Row(grid.Config("served", "lru", share, 1, 4, "no_buffer"),
                   SimpleNamespace(flops_saved_fraction=flops, token_hit_rate=hit, modeled_ttft_p95_s=ttft))

    rows = [row(0.1, 0.30, 0.90, 1.0), row(0.2, 0.40, 0.50, 1.0), row(0.3, 0.40, 0.50, 0.5), row(0.4, 0.40, 0.50, 0.5)]
    best = Plan(rows, infinite=None).best()
    assert best is rows[2]  # most FLOPs saved, then the lower modeled TTFT; a full tie goes to the first listed


def test_the_command_exits_2_with_one_line():
    result = subprocess.run([sys.executable, "-m", "sglang_marconi.plan", "--trace", "/no/such/trace.jsonl",
                             "--model", MODEL, "--memory", "80GB"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: /no/such/trace.jsonl: no such trace file"


def test_memory_too_small_names_what_one_request_needs(capsys):
    assert main(["--workload", SYNTHETIC, "--model", MODEL, "--memory", "100MB", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "too small for one request" in err and "KV tokens" in err


def test_gpu_memory_gives_the_static_fraction_instead_of_the_kv_tokens(tmp_path):
    data, _ = plan(tmp_path, ["--workload", SYNTHETIC, "--limit", "3"], "2GB", "--mamba-shares", "0.5",
                   "--gpu-memory", "20GB", "--weights-memory", "16GB")
    flags = data["recommended_flags"]
    assert "--max-total-tokens" not in flags
    assert flag(flags, "--mem-fraction-static") == "0.900"  # (16 GB weights + 2 GB pools) / 20 GB
    assert flag(flags, "--max-mamba-cache-size") == str(data["rows"][data["best"]]["mamba_slots"])


def test_gpu_memory_that_cannot_hold_weights_and_pools_is_refused(capsys):
    argv = ["--workload", SYNTHETIC, "--model", MODEL, "--memory", "2GB", "--gpu-memory", "10GB",
            "--weights-memory", "16GB", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --gpu-memory '10GB' holds less than") and "\n" not in err


def fake_row(share, policy, flops, hit=None):
    run = SimpleNamespace(flops_saved=flops * 1e15, flops_saved_fraction=flops, token_hit_rate=hit or flops,
                          hit_tokens=int(flops * 1e6), modeled_ttft_p95_s=1.0, requests=100,
                          choices_used=lambda: ["lru"] if policy == "lru" else ["lru", "0.5"])
    return Row(grid.Config("served", policy, share, 1000, 8, "no_buffer"), run)


def test_a_tie_at_the_best_split_still_names_where_marconi_gains():
    rows = [fake_row(0.5, "lru", 0.20), fake_row(0.5, "marconi", 0.20),
            fake_row(0.1, "lru", 0.04), fake_row(0.1, "marconi", 0.13), fake_row(0.3, "lru", 0.10),
            fake_row(0.3, "marconi", 0.12)]
    text = verdict(Plan(rows, infinite=SimpleNamespace(token_hit_rate=0.3, requests=100)))
    assert text.startswith("verdict: nothing to gain here: tuned Marconi's best saves 20.00% of prefill FLOPs, "
                           "LRU's best 20.00%: within 1% of each other")
    assert text.endswith("; at a worse split Marconi does gain: most at Mamba 10% / KV 90%, no_buffer, "
                         "4.00% -> 13.00%")
    rows = [fake_row(0.5, "lru", 0.20), fake_row(0.5, "marconi", 0.20)]
    text = verdict(Plan(rows, infinite=SimpleNamespace(token_hit_rate=0.3, requests=100)))
    assert "worse split" not in text
