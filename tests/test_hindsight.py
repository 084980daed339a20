"""`marconi-best` (the best fixed choice in hindsight) and the simulator's automatic sample rate."""

import json

import pytest

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
from sglang_marconi.sim.cli import main
from sglang_marconi.sim.hindsight import replay_best
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.synthetic import generate
from sglang_marconi.sim.tuning import COST_BUDGET, auto_sample_rate

PROFILE = load_profile("paper-7b")
CAPACITY = 3 * 10**9


@pytest.fixture(scope="module")
def workload():
    return generate("sharegpt", sessions=12)


@pytest.mark.parametrize("objective", ["flops", "token_hit_rate"])
def test_best_is_the_candidate_with_the_most_saved(workload, objective):
    config = ShadowConfig(alpha_grid=(0.0, 20.0), seglen_weights=(), objective=objective)
    best = replay_best(workload, PROFILE, CAPACITY, config, progress=False)
    fixed = {"lru": replay(workload, build_policy("sglang+", PROFILE, CAPACITY), PROFILE, CAPACITY, progress=False)}
    for alpha in (0.0, 20.0):
        policy = build_policy(f"marconi:{alpha:g}", PROFILE, CAPACITY)
        fixed[f"{alpha:g}"] = replay(workload, policy, PROFILE, CAPACITY, progress=False)
    key = (lambda r: r.flops_saved) if objective == "flops" else (lambda r: r.hit_tokens)
    assert best.policy == "marconi-best" and best.best_choice == max(fixed, key=lambda c: key(fixed[c]))
    assert best.hit_tokens == fixed[best.best_choice].hit_tokens
    assert len({r.hit_tokens for r in fixed.values()}) > 1  # the choice matters here
    assert {c: v["token_hit_rate"] for c, v in best.candidates.items()} == {
        c: r.token_hit_rate for c, r in fixed.items()}
    assert best.wall_seconds == pytest.approx(sum(v["wall_seconds"] for v in best.candidates.values()))


def test_cli_reports_marconi_best_beside_the_tuned_run(tmp_path, capsys):
    out = tmp_path / "runs.json"
    rc = main(["--workload", "synthetic:sharegpt:sessions=12", "--capacity", "3GB", "--policies",
               "sglang+,marconi,marconi-best", "--alpha-grid", "0,20", "--seglen-weights", "5", "--json", str(out), "--no-progress"])
    assert rc == 0
    runs = {r["policy"]: r for r in json.loads(out.read_text())}
    assert set(runs["marconi-best"]["candidates"]) == {"lru", "0", "20", "seglen:5"}
    assert runs["marconi-best"]["best_choice"] in runs["marconi-best"]["candidates"]
    assert "candidates" not in runs["marconi"] and runs["marconi"]["choice_history"][0] == [0, "lru"]
    assert "marconi-best" in capsys.readouterr().out


def test_marconi_best_is_not_a_per_request_policy():
    with pytest.raises(MarconiError, match="marconi-best"):
        build_policy("marconi-best", PROFILE, CAPACITY)


def test_auto_sample_rate_samples_only_large_traces():
    small = generate("lmsys", sessions=30)
    assert auto_sample_rate(small, PROFILE, 10 * 10**9, 6) == 1.0  # too few sessions to sample
    many = generate("system-prompt", sessions=4000)  # one request per session
    rate = auto_sample_rate(many, PROFILE, 10**13, 6)
    assert rate == pytest.approx(COST_BUDGET / 6)  # the cost budget: shadows ~ one replay
    assert auto_sample_rate(many, PROFILE, 10**11, 6) > rate  # a smaller cache needs a larger sample
