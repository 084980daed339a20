"""`belady`, the offline upper bound on any eviction under Marconi's admission: it is never below
a policy that admits that way (SGLang+, coverage, Marconi fixed or tuned), never above the
infinite cache, equals a hand-computed LP optimum on a tiny trace, and its dual search reaches the
LP's optimum (checked against an exact LP solver where scipy is installed)."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, choice_label, eviction_for
from sglang_marconi.sim.baselines.belady import BeladyBound
from sglang_marconi.sim.baselines.dual_bound import DualBound
from sglang_marconi.sim.baselines.hit_options import hit_options
from sglang_marconi.sim.baselines.hybrid_radix import HybridRadixPolicy
from sglang_marconi.sim.cli import main
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.synthetic import generate
from sglang_marconi.sim.workload import ListWorkload, Request

from toy_profile import ToyProfile

PROFILE = load_profile("paper-7b")
TOY = ToyProfile()


def fixed_runs(workload, profile, capacity, *, probation=False):
    """Every policy with Marconi's admission the bound must cover: SGLang+, coverage, each fixed choice."""
    runs = {name: replay(workload, build_policy(name, profile, capacity, probation=probation), profile, capacity,
                         progress=False) for name in ("sglang+", "coverage")}
    for choice in ShadowConfig().choices:
        policy = HybridRadixPolicy(choice_label(choice), profile, capacity, eviction_for(choice), probation=probation)
        runs[choice_label(choice)] = replay(workload, policy, profile, capacity, progress=False)
    return runs


@pytest.mark.parametrize("kind,sessions,capacities_gb", [
    ("swe-agent", 6, (2, 5, 10)),
    ("lmsys", 25, (1, 2, 5)),
    ("sharegpt", 40, (0.5, 1, 2)),
    ("system-prompt", 150, (0.1, 0.2, 0.5)),
])
def test_bound_is_above_every_fixed_choice_and_sglang_plus(kind, sessions, capacities_gb):
    workload = generate(kind, seed=3, sessions=sessions)
    bound = BeladyBound(workload, PROFILE)
    infinite = replay(workload, build_policy("infinite", PROFILE, 1), PROFILE, 1, progress=False)
    gaps = []
    for gb in capacities_gb:
        cap = int(gb * 1e9)
        opt = bound.run(cap)
        runs = fixed_runs(workload, PROFILE, cap)
        for name, run in runs.items():
            assert opt.hit_tokens >= run.hit_tokens, (kind, gb, name)
            assert opt.flops_saved >= run.flops_saved * (1 - 1e-9), (kind, gb, name)
        assert opt.hit_tokens <= infinite.hit_tokens
        gaps.append(opt.hit_tokens - max(r.hit_tokens for r in runs.values()))
    assert max(gaps) > 0  # not vacuous: somewhere the bound sees headroom


def test_bound_covers_tuned_marconi_and_probation():
    workload = generate("lmsys", seed=5, sessions=20)
    cap = int(2e9)
    tuned = replay(workload, build_policy("marconi", PROFILE, cap, tuning=ShadowConfig()), PROFILE, cap, progress=False)
    assert BeladyBound(workload, PROFILE).run(cap).hit_tokens >= tuned.hit_tokens
    with_probation = BeladyBound(workload, PROFILE, probation=True).run(cap, flops=False)
    for name, run in fixed_runs(workload, PROFILE, cap, probation=True).items():
        assert with_probation.hit_tokens >= run.hit_tokens, name


def request(session, turn, inp, out):
    return Request(session, turn, float(turn), np.asarray(inp, dtype=np.int64), np.asarray(out, dtype=np.int64))


def two_interleaved_sessions() -> ListWorkload:
    """A1, B1, A2, B2: each second turn can reuse its first turn's 12 tokens (input 10 + output 2)."""
    a, b = list(range(1, 11)), list(range(101, 111))
    return ListWorkload("two-sessions", [
        request("A", 0, a, [11, 12]),
        request("B", 0, b, [111, 112]),
        request("A", 1, a + [11, 12, 13, 14], [15, 16]),
        request("B", 1, b + [111, 112, 113, 114], [115, 116]),
    ])


def test_tiny_trace_by_hand():
    """Toy bytes: 1 per token, 10 per state. A2's hit at 12 needs A1's 12 tokens and end state (22
    bytes) held at arrivals 1 and 2; arrival 1 is free (A1's admission holds its sequence then), and
    at arrival 2 B1's sequence is held (22), so with C = 40 only 18 of A2's 22 bytes fit: the LP hits
    A2 with weight 18/22. Likewise B2 at arrival 3, beside A2's admitted sequence (16 + 10 = 26 bytes,
    which its path can hold with at most 2 states: 16 + 20 <= 40): weight 14/22. Bound = 12 x 32/22."""
    w = two_interleaved_sessions()
    bound = BeladyBound(w, TOY)
    tokens = bound.options.option_hit_tokens.astype(float)
    assert bound.bound(40, tokens) == pytest.approx(12 * 32 / 22, rel=1e-3)  # the search stops within 0.1%
    assert bound.run(40).hit_tokens == 17
    assert bound.run(1000).hit_tokens == 24  # everything fits: both second turns hit 12
    # C = 30: A2 holds at most 8/22; A2's admission might be skipped (16 + 2 x 10 > 30), so nothing
    # is forced at arrival 3 and B2 can hold all of its 22 bytes
    assert bound.bound(30, tokens) == pytest.approx(12 * (8 / 22 + 1), rel=1e-3)
    # a real cache at C = 40 holds A1 + B1 = 44 > 40 bytes at once, so it loses A1 and then B1: no hit
    for name in ("sglang+", "coverage", "marconi:0"):
        assert replay(w, build_policy(name, TOY, 40), TOY, 40, progress=False).hit_tokens == 0


def test_hit_options_of_the_tiny_trace():
    o = hit_options(two_interleaved_sessions(), TOY)
    assert o.option_request.tolist() == [2, 3] and o.option_hit_tokens.tolist() == [12, 12]
    assert o.piece_since.tolist() == [0, 1] and o.piece_bytes.tolist() == [12, 12]
    assert o.option_state_is_end_of_since.tolist() == [True, True]
    assert o.forced_bytes.tolist() == [22, 22, 26, 26]


def test_branch_states_count_only_from_the_request_that_reveals_the_branch():
    """Marconi admits a state at a shared prompt's end only when a second request branches there,
    so the first reuse is by the third request: the bound does not credit the second one."""
    prompt = list(range(1000, 1050))
    w = ListWorkload("prompt", [request(f"u{i}", 0, prompt + [i], [5000 + i]) for i in range(3)])
    o = hit_options(w, TOY)
    assert o.option_request.tolist() == [2] and o.option_hit_tokens.tolist() == [50]


def test_dual_search_reaches_the_exact_lp_optimum():
    scipy_optimize = pytest.importorskip("scipy.optimize")
    from scipy.sparse import lil_matrix

    workload = generate("sharegpt", seed=2, sessions=10)
    o = hit_options(workload, PROFILE)
    cap = int(0.3e9)
    dual = DualBound(o, cap, o.option_hit_tokens.astype(float))
    # the primal LP: one weight per option; at most 1 per request; bytes held at each arrival <= C - forced
    n_opt, n = o.option_request.size, o.requests
    a = lil_matrix((n + n, n_opt))
    for k in range(n_opt):
        r = o.option_request[k]
        a[r, k] = 1.0
        for p in range(o.request_first_piece[r], o.option_end_piece[k]):
            for t in range(dual.piece_from[p], r + 1):
                a[n + t, k] += dual.piece_bytes[p]
        for t in range(dual.state_from[k], r + 1):
            a[n + t, k] += dual.state_bytes
    rhs = np.concatenate((np.ones(n), 1.0 - dual.forced_share))
    lp = scipy_optimize.linprog(-o.option_hit_tokens.astype(float), A_ub=a.tocsr(), b_ub=rhs, bounds=(0, 1),
                                method="highs")
    assert lp.status == 0
    bound = BeladyBound(workload, PROFILE).bound(cap, o.option_hit_tokens.astype(float))
    assert -lp.fun - 1e-6 <= bound <= -lp.fun * 1.002  # weak duality, and the search converged


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), sessions=st.integers(2, 6), capacity=st.integers(20, 200),
       probation=st.booleans())
def test_bound_covers_every_policy_on_random_small_traces(seed, sessions, capacity, probation):
    """Sessions over a 3-token vocabulary, so that prefixes collide and branch in every way, at
    capacities where admissions are skipped and inner states evicted."""
    rng = np.random.default_rng(seed)
    reqs, history = [], {}
    for i in range(sessions * 3):
        s = int(rng.integers(sessions))
        base = history.get(s, [int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 12)))])
        inp = base + [int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 12)))]
        out = [int(x) for x in rng.integers(0, 3, size=int(rng.integers(0, 6)))]
        history[s] = inp + out if rng.random() < 0.8 else base
        reqs.append(request(str(s), i, inp, out))
    w = ListWorkload("random", reqs)
    opt = BeladyBound(w, TOY, probation=probation).run(capacity)
    for name, run in fixed_runs(w, TOY, capacity, probation=probation).items():
        assert opt.hit_tokens >= run.hit_tokens, name
        assert opt.flops_saved >= run.flops_saved * (1 - 1e-9) - 1e-6, name


def test_cli_runs_belady_once_per_trace_and_reports_it(tmp_path, capsys):
    out = tmp_path / "runs.json"
    rc = main(["--workload", "synthetic:sharegpt:sessions=15", "--capacity", "1GB,2GB", "--policies",
               "sglang+,coverage,belady", "--json", str(out), "--no-progress"])
    assert rc == 0
    runs = json.loads(out.read_text())
    bound = {r["capacity_bytes"]: r for r in runs if r["policy"] == "belady"}
    lru = {r["capacity_bytes"]: r for r in runs if r["policy"] == "sglang+"}
    assert set(bound) == {10**9, 2 * 10**9}
    assert all(bound[c]["token_hit_rate"] >= lru[c]["token_hit_rate"] for c in bound)
    assert bound[10**9]["token_hit_rate"] <= bound[2 * 10**9]["token_hit_rate"] + 1e-9
    assert "belady" in capsys.readouterr().out


def test_belady_is_not_a_per_request_policy_nor_a_window_model():
    with pytest.raises(MarconiError, match="belady"):
        build_policy("belady", PROFILE, 10**9)
    with pytest.raises(MarconiError, match="sliding-window"):
        BeladyBound(generate("sharegpt", sessions=2), load_profile("gpt-oss-20b"))
