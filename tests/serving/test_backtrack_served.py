"""Backtrack states (`policy/rules/backtrack_states.py`) in SGLang's real cache and in the
served-pools model, which call the one rule: a long replay leaves states at its chunk ends on
probation, so a request that comes back to an earlier point of it lands near that point; at most
B per request, never more states than upstream keeps; the two sides agree request by request."""

import argparse
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang_cpu import build_marconi_serving, run_request  # noqa: E402

from sglang_marconi.policy.cost.model_profile import load_profile  # noqa: E402
from sglang_marconi.policy.rules.backtrack_states import (  # noqa: E402
    BacktrackStates, default_setting, upstream_states,
)
from sglang_marconi.policy.tree.served_cache import ServedCache, ServedPools  # noqa: E402
from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig, add_marconi_args, config_from_args  # noqa: E402
from sglang_marconi.serving.runtime import served_pools  # noqa: E402
from sglang_marconi.sim.stress import agent_backtrack  # noqa: E402
from test_backtrack_branch_states import FIRST, question, users_behind_one_prompt  # noqa: E402
from test_sim_equivalence import _check_script  # noqa: E402

CHUNK = 128
PROFILE = "nemotron-h-8b"


class Pair:
    """The served cache and its model, fed the same requests."""

    def __init__(self, extra_buffer: bool, backtrack: int, kv: int = 20000, mamba: int = 40, alpha=0.0):
        config = MarconiServingConfig(alpha=alpha, tune_workers=0, extra={"backtrack_states": backtrack})
        self.cc, self.runtime = build_marconi_serving(config, profile=PROFILE, kv_size=kv, mamba_size=mamba,
                                                      max_num_reqs=2, max_context_len=16384,
                                                      extra_buffer=extra_buffer, chunked_prefill_size=CHUNK)
        pools = ServedPools(kv, mamba, "extra_buffer" if extra_buffer else "no_buffer", CHUNK)
        self.sim = ServedCache(load_profile(PROFILE), replace(pools, backtrack_states=backtrack), alpha)

    def serve(self, tokens, out):
        _, served = run_request(self.cc, list(tokens), len(out), chunk_size=CHUNK, out_tokens=list(out),
                                chunk_end=chunk_end_for_branch, decode_at_once=True)
        sim = self.sim.serve(np.asarray(tokens), np.asarray(out)).hit_tokens
        return served, sim

    def close(self):
        self.cc.check_no_leak()
        self.sim.check_invariants()
        self.runtime.close()


SYSTEM = list(range(1, 101))
LONG = SYSTEM + list(range(1000, 1900))  # 1,000 tokens: a long replay from the system prompt
OUT = list(range(50000, 50008))


def backtrack_hits(extra_buffer: bool, backtrack: int):
    pair = Pair(extra_buffer, backtrack)
    assert pair.serve(SYSTEM + [7, 7], OUT) == (0, 0)  # the system prompt's state, as a branch
    pair.serve(LONG, OUT)
    back = LONG[:700] + list(range(9000, 9100))  # comes back to token 700 of the long trajectory
    hits = pair.serve(back, OUT)
    admitted = pair.sim.counters.backtrack_admitted
    pair.close()
    return hits, admitted


def test_a_chunk_end_less_than_a_step_before_the_input_end_is_the_input_end_state():
    """extra_buffer, chunks of 128: the second turn resumes at 896 and runs [896, 1024), then
    [1024, 1059), 35 tokens, which snapshot nothing. So 1,024 is that turn's input-end state (on
    probation), not a backtrack state, and the third turn, which leaves the tree at 1,059 (as a
    reasoning model's next turn does, its history without the decoded reasoning), resumes there:
    a match may not resume at a backtrack state less than a step before where it leaves the
    tree, and would go back to 896. Long decodes, so each turn's final state is its own."""
    pair = Pair(True, 3)
    first = SYSTEM + list(range(1000, 1800))  # 900 tokens
    second = first + list(range(70000, 70159))  # 1,059
    third = second + list(range(80000, 80200))
    hits = [pair.serve(tokens, list(range(60000 + 1000 * i, 60300 + 1000 * i)))
            for i, tokens in enumerate((first, second, third))]
    pair.close()
    assert hits == [(0, 0), (896, 896), (1024, 1024)]


@pytest.mark.parametrize("extra_buffer", [False, True])
def test_a_return_to_an_earlier_point_lands_near_it(extra_buffer):
    (served_off, sim_off), none = backtrack_hits(extra_buffer, 0)
    (served_on, sim_on), admitted = backtrack_hits(extra_buffer, 3)
    assert none == 0 and served_off == sim_off and served_on == sim_on
    assert served_off <= 100  # without: only the system prompt's state lies before token 700
    # with: the chunk-end states cut the 900-token replay in near-equal FLOP parts, B = 3 at most
    assert 1 <= admitted <= 3
    assert 400 <= served_on <= 700, served_on


def test_users_behind_one_system_prompt_hit_all_of_it_from_the_third_on():
    """SGLang's frontend program's shape (five users behind one 182-token system prompt, two forks
    each), extra_buffer, chunks of 128. The first user's cold prefill leaves a backtrack state at
    its chunk end 128, 54 tokens before the prompt's end: reused, no extend from it could snapshot
    the branch (64 tokens in at least), and every user would hit 128. Passed over, the second user
    writes the branch state and the users after it hit the whole prompt, as without the rule."""
    rows = {}
    for backtrack in (0, 3):
        pair = Pair(True, backtrack)
        rows[backtrack] = users_behind_one_prompt(pair.serve, 182)
        admission = pair.cc.cache.marconi.admission
        counts = (admission.branch_states_admitted, admission.backtrack_admitted)
        assert counts == (pair.sim.counters.branch_states_admitted, pair.sim.counters.backtrack_admitted)
        pair.close()
        assert all(served == sim for row in rows[backtrack] for served, sim in row), rows[backtrack]
        assert counts[0] >= 1 and (counts[1] >= 1) == (backtrack > 0), counts  # the branch state; the rule ran
    on, off = ([[served for served, _ in row] for row in rows[b]] for b in (3, 0))
    assert [row[0] for row in on[2:]] == [182] * 3, on
    assert all(a >= b for row_on, row_off in zip(on, off) for a, b in zip(row_on, row_off)), (on, off)


@pytest.mark.parametrize("shared,hits", [(191, [0, 191, 191]), (192, [128, 192, 192])])
def test_a_backtrack_state_less_than_a_step_before_the_branch_is_passed_over_in_sglang(shared, hits):
    """Either side of the window (`tests/test_backtrack_branch_states.py` has the model's table):
    63 tokens past the backtrack state at 128 the match resumes before it, a whole step past it
    the match reuses it."""
    pair = Pair(True, 3)
    pair.serve(FIRST, OUT)
    served = [pair.serve(FIRST[:shared] + question(user), OUT) for user in range(3)]
    pair.close()
    assert served == [(hit, hit) for hit in hits]


def test_never_more_than_b_nor_more_than_upstream_keeps():
    flops = load_profile(PROFILE).prefill_flops
    rule = BacktrackStates(2)
    # chunk ends a third of the stretch's FLOPs apart, B = 2: the third is refused
    assert rule.admits(420, 100, 100, 1000, 0, 1, 128, flops)
    assert rule.admits(750, 420, 100, 1000, 1, 2, 128, flops)
    assert not rule.admits(900, 750, 100, 1000, 2, 3, 128, flops)
    assert rule.admits(1350, 900, 100, 1400, 1, 3, 128, flops)  # far enough apart: only B refuses it
    assert not rule.admits(1350, 900, 100, 1400, 2, 3, 128, flops)
    # closer to the previous state than a third of the stretch: not worth a slot
    assert not rule.admits(380, 100, 100, 1000, 0, 1, 128, flops)
    # upstream keeps ceil(900 / 512) + 1 = 3 states: with 2 offered, none more (the final one is due)
    assert upstream_states(1000, 100, 512) == 3
    assert not rule.admits(750, 420, 100, 1000, 0, 2, 512, flops)
    assert rule.admits(750, 420, 100, 1000, 0, 1, 512, flops)
    # only inside the stretch
    assert not rule.admits(1000, 420, 100, 1000, 0, 1, 128, flops)
    assert not rule.admits(None, 420, 100, 1000, 0, 1, 128, flops)


@pytest.mark.parametrize("extra_buffer", [False, True])
def test_served_and_model_agree_request_by_request_with_the_rule_on(extra_buffer):
    workload = list(agent_backtrack(sessions=3, steps=14, system=120, observation=(100, 500), max_input=3000,
                                    backtrack=0.5))
    pair = Pair(extra_buffer, 3, kv=4000, mamba=12)
    served, sim = zip(*(pair.serve(r.input_tokens.tolist(), r.output_tokens.tolist()) for r in workload))
    admitted = pair.sim.counters.backtrack_admitted
    pair.close()
    assert list(served) == list(sim)
    assert admitted > 0  # the rule ran (and, agreeing, ran alike on both sides)


def config_of_flags(*flags) -> MarconiServingConfig:
    """The serving config the launcher builds from these flags."""
    parser = argparse.ArgumentParser()
    add_marconi_args(parser)
    return config_from_args(parser.parse_args(["--marconi-alpha", "0", "--marconi-tune-workers", "0", *flags]))


# (strategy, --marconi-backtrack-states, B the flag stands for): each B differs from the strategy's
# default but "auto", so a flag that never reached the rule fails
EXTRA_DEFAULT, NO_DEFAULT = default_setting(True), default_setting(False)
FLAG_CASES = [(True, "1", 1), (True, "0", 0) if EXTRA_DEFAULT else (True, "3", 3), (True, "auto", EXTRA_DEFAULT),
              (False, "2", 2), (False, "auto", NO_DEFAULT)]


@pytest.mark.parametrize("extra_buffer,flag,per_request", FLAG_CASES,
                         ids=[f"{'extra' if e else 'no'}_buffer-{f}" for e, f, _ in FLAG_CASES])
def test_the_flag_reaches_the_rule_and_the_counter_counts_its_states(extra_buffer, flag, per_request):
    config = config_of_flags("--marconi-backtrack-states", flag)
    cc, runtime = build_marconi_serving(config, profile=PROFILE, kv_size=20000, mamba_size=40, max_num_reqs=2,
                                        max_context_len=16384, extra_buffer=extra_buffer,
                                        chunked_prefill_size=CHUNK)
    pools = ServedPools(20000, 40, "extra_buffer" if extra_buffer else "no_buffer", CHUNK,
                        backtrack_states=per_request)
    sim = ServedCache(load_profile(PROFILE), pools, 0.0)
    assert served_pools(cc.cache, config).backtrack_setting == per_request  # the served shadows' model alike
    requests = [(SYSTEM + [7, 7], OUT), (LONG, OUT), (LONG[:700] + list(range(9000, 9100)), OUT),
                (SYSTEM + list(range(3000, 4400)), OUT)]
    taken = []  # backtrack states each request admitted, served
    for tokens, out in requests:
        req, served_hit = run_request(cc, tokens, len(out), chunk_size=CHUNK, out_tokens=out,
                                    chunk_end=chunk_end_for_branch, decode_at_once=True)
        assert served_hit == sim.serve(np.asarray(tokens), np.asarray(out)).hit_tokens
        taken.append(req.marconi_backtrack.taken)
    served, model = cc.cache.marconi.admission, sim.counters
    figures = runtime.metrics(cc.cache)
    cc.check_no_leak()
    runtime.close()
    assert max(taken) == per_request, taken  # the long replays reach B, and none passes it
    # the counter: every backtrack state a request admitted, once, and what the model admits
    assert served.backtrack_admitted == sum(taken)
    assert served.backtrack_admitted == model.backtrack_admitted
    # the other states are counted as the server counts them: probationary ones never as branch states
    assert served.branch_states_admitted == model.branch_states_admitted
    assert figures["marconi_backtrack_states_admitted"] == served.backtrack_admitted
    # the input-end probationary states are counted apart from them
    assert (served.probationary_admitted - served.backtrack_admitted
            == model.probationary_admitted - model.backtrack_admitted)


def test_the_request_by_request_check_runs_both_sides_with_the_same_setting():
    check = _check_script()
    workload = list(agent_backtrack(sessions=3, steps=14, system=120, observation=(100, 500), max_input=3000,
                                    backtrack=0.5))
    reports = {b: check.run(workload, PROFILE, 4000, 12, "extra_buffer", CHUNK, 0.0, True,
                            backtrack_states=b, workload_name="agent-backtrack") for b in (0, 3)}
    for b, report in reports.items():
        assert report.agree == report.requests and report.served_hits == report.sim_hits, report.lines()
        assert report.config["backtrack_states"] == b
    assert reports[3].served_hits != reports[0].served_hits  # the setting reached the served cache
    with pytest.raises(SystemExit):
        check.main(["--workload", "synthetic:swe-agent", "--kv-tokens", "4000", "--mamba-slots", "12",
                    "--backtrack-states", "-1"])
