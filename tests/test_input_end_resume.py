"""Turns that resume where the previous input ended (`policy/rules/input_end_resume.py`), in the
served-pools model: such a turn keeps its own input-end state as a regular state and its final
state on probation, so under Mamba pressure a reasoning model's conversations keep the states their
next turns resume at; a conversation that continues after its decode is served as before."""

import random
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.rules import input_end_resume
from sglang_marconi.policy.tree.served_cache import ServedCache, ServedPools
from sglang_marconi.sim.stress import reasoning_chat

PROFILE = load_profile("nemotron-h-8b")
SYSTEM = list(range(1, 401))


def cache(strategy="extra_buffer", kv=200_000, mamba=200, **kw) -> ServedCache:
    return ServedCache(PROFILE, ServedPools(kv, mamba, strategy, 512), 0.0, **kw)


def fresh(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def state_nodes(c: ServedCache) -> dict:
    """Depth -> node, for every node holding a state."""
    return {n.end: n for n in c.tree.nodes() if n.has_state}


def test_the_rule_runs_in_extra_buffer_with_probation_only():
    assert input_end_resume.applies(True, True)
    assert not input_end_resume.applies(False, True) and not input_end_resume.applies(True, False)
    assert cache().input_end_rule and not cache("no_buffer").input_end_rule
    assert not cache(probation=False).input_end_rule


def test_a_turn_resuming_at_an_input_end_keeps_its_own_and_puts_its_final_state_on_probation():
    c = cache()
    first = SYSTEM + fresh(10_000, 300)  # 700 tokens
    c.serve(first, fresh(20_000, 600))  # reasoning 400 + answer 200
    states = state_nodes(c)
    end_1 = max(d for d in states if d <= len(first))
    assert states[end_1].input_end and states[end_1] in c._probation  # input end: on probation, marked
    final_1 = max(states)
    assert final_1 > len(first) and not states[final_1].input_end and states[final_1] not in c._probation

    # the next turn drops the reasoning: the previous input, its answer, a new user message
    second = first + fresh(20_400, 200) + fresh(30_000, 150)
    out = c.serve(second, fresh(40_000, 600))
    assert len(first) - 64 < out.hit_tokens <= len(first)  # it resumed at the first turn's input end
    states = state_nodes(c)
    end_2 = max(d for d in states if d <= len(second))
    assert end_2 > len(first)
    assert states[end_2].input_end and states[end_2] not in c._probation  # kept regular
    final_2 = max(states)
    assert final_2 > len(second) and states[final_2] in c._probation  # the decode's state: on probation
    assert c.counters.input_end_states_kept == 1
    c.check_invariants()


def test_a_conversation_that_continues_after_its_decode_never_turns_it_on():
    c = cache()
    history = SYSTEM + fresh(10_000, 300)
    for turn in range(5):
        out = fresh(100_000 + 1000 * turn, 300)
        c.serve(history, out)
        last_input = len(history)
        history = history + out[:-1] + fresh(200_000 + 1000 * turn, 100)
    assert c.counters.input_end_states_kept == 0
    # on probation: input-end states and backtrack ones, never a final state
    backtrack = set(c.backtrack_marks.nodes())
    assert all(n.input_end for n in c._probation if n not in backtrack)
    final = state_nodes(c)[max(state_nodes(c))]
    assert final.end > last_input and final not in c._probation  # the last turn's final state: regular


def replay(workload, pools: ServedPools, rule: bool, monkeypatch) -> tuple[float, int]:
    """Hit % of the workload, and the input-end states the rule kept."""
    with monkeypatch.context() as m:
        if not rule:
            m.setattr(input_end_resume, "applies", lambda extra_buffer, probation: False)
        c = ServedCache(PROFILE, pools, 0.0)
        hits = sum(c.serve(r.input_tokens, r.output_tokens).hit_tokens for r in workload)
        c.check_invariants()
    return 100 * hits / sum(len(r.input_tokens) for r in workload), c.counters.input_end_states_kept


@pytest.mark.parametrize("seed", [3, 11])
def test_under_mamba_pressure_reasoning_conversations_keep_what_their_next_turns_resume_at(seed, monkeypatch):
    """Twelve conversations of a reasoning model, interleaved, in a pool of 40 Mamba slots (KV for
    all of them): without the rule the input-end states are probationary and go first while the
    decodes' final states, never reused, stay; with it the next turns find theirs."""
    workload = list(reasoning_chat(12, 8, seed=seed))
    pools = ServedPools(400_000, 40, "extra_buffer", 512)
    on, kept = replay(workload, pools, True, monkeypatch)
    off, none = replay(workload, pools, False, monkeypatch)
    assert none == 0 and kept > 0
    assert on >= off + 3, (on, off)


def regenerating_chat(sessions: int, turns: int, seed: int) -> list:
    """An adversary of the rule: every turn is sent twice (a regenerated answer), and the next turn
    continues the second answer. The second try resumes at the first's input-end state, so the rule
    puts its final state, the one the next turn continues, on probation."""
    rng = random.Random(seed)
    system = [rng.randint(1, 32000) for _ in range(400)]
    history = [list(system) for _ in range(sessions)]
    order = [s for s in range(sessions) for _ in range(turns)]
    rng.shuffle(order)
    fresh, requests = 40_000, []
    for s in order:
        prompt = history[s] + [rng.randint(1, 32000) for _ in range(rng.randint(50, 400))]
        for _ in range(2):
            n = rng.randint(150, 600)
            out, fresh = list(range(fresh, fresh + n)), fresh + n
            requests.append(SimpleNamespace(input_tokens=np.asarray(prompt), output_tokens=np.asarray(out)))
        history[s] = prompt + out[:-1]
    return requests


@pytest.mark.parametrize("kv,mamba", [(400_000, 40), (400_000, 69), (30_000, 40)])
def test_a_regenerated_turn_whose_answer_is_continued_loses_nothing(kv, mamba, monkeypatch):
    workload = regenerating_chat(12, 8, seed=3)
    pools = ServedPools(kv, mamba, "extra_buffer", 512)
    on, kept = replay(workload, pools, True, monkeypatch)
    off, _ = replay(workload, pools, False, monkeypatch)
    assert kept > 0 and on >= off - 0.5, (on, off)
