"""End to end through a real SGLang server on this CPU (SGLang's CPU engine, tiny random hybrid
models): `python -m sglang_marconi.launch_server`, and upstream's `python -m sglang.launch_server
--radix-cache-backend marconi` (the plugin entry point), for a gated-delta-net and a Mamba2 model.

Through the HTTP API (token ids, greedy) and SGLang frontend programs (`examples/`):
multi-turn reuse, a shared system prompt and forked branches, warm == cold exactness, at most two
SSM states per request, and figures that agree with what the responses reported.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from http_api import (  # noqa: E402
    flush_cache, generate, internal_state, labelled_gauge, marconi_figures, marconi_gauges,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

CHUNK = 128  # --chunked-prefill-size: long prompts prefill in several chunks
SERVED = [("gated-delta", "marconi"), ("mamba2", "marconi"), ("gated-delta", "sglang"), ("mamba2", "sglang")]


@pytest.fixture(scope="module", params=SERVED, ids=[f"{k}-{launcher}" for k, launcher in SERVED])
def server(request, tiny_model, launch):
    kind, launcher = request.param
    extra = ["--chunked-prefill-size", str(CHUNK)]
    if launcher == "sglang":
        extra += ["--radix-cache-backend", "marconi"]
    srv = launch(tiny_model(kind), launcher=launcher, extra_args=extra)
    yield srv
    srv.stop()


def tokens(seed: int, n: int) -> list[int]:
    """n random word ids (2..511: never a special token)."""
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def floor_to(n: int, grid: int) -> int:
    return n // grid * grid


def test_the_scheduler_runs_the_marconi_cache(server):
    state = internal_state(server.url)
    assert "marconi" in state, sorted(state)
    # Both tiny models checkpoint on SGLang's 64-token Mamba cache chunk (page size 1).
    assert state["marconi"]["marconi_checkpoint_grid"] == 64


def test_multi_turn_chat_reuses_the_previous_turn(server):
    flush_cache(server.url)
    prompt = tokens(1, 90)
    for turn in range(4):
        g = generate(server.url, prompt, max_new_tokens=10)
        if turn:
            # The previous turn's prompt and output, less its last sampled token (no KV for it yet).
            assert g.cached_tokens >= previous.prompt_tokens + len(previous.output_ids) - 1, turn
        previous = g
        prompt = prompt + g.output_ids + tokens(100 + turn, 25)


def test_shared_system_prompt_hits_from_the_third_request(server):
    flush_cache(server.url)
    grid = marconi_figures(server.url)["marconi_checkpoint_grid"]
    system = tokens(2, 150)
    cached = [generate(server.url, system + tokens(200 + i, 20)).cached_tokens for i in range(6)]
    assert cached[:2] == [0, 0]  # nothing shared is cached before the second request leaves its branch
    assert all(c >= floor_to(len(system), grid) for c in cached[2:]), (cached, grid)


def test_long_prompts_leave_at_most_two_states_each(server):
    flush_cache(server.url)
    before = marconi_figures(server.url)
    prompts = [tokens(3, 5 * CHUNK)]  # five prefill chunks: upstream's admission would keep five states
    prompts.append(prompts[0][: 2 * CHUNK + 40] + tokens(4, 3 * CHUNK))  # branches inside the third chunk
    prompts.append(prompts[0][: 2 * CHUNK + 40] + tokens(5, 3 * CHUNK))
    for prompt in prompts:
        figures = marconi_figures(server.url)
        generate(server.url, prompt, max_new_tokens=6)
        after = marconi_figures(server.url)
        assert after["marconi_ssm_states_admitted"] - figures["marconi_ssm_states_admitted"] <= 2
        assert after["marconi_ssm_states_cached"] - figures["marconi_ssm_states_cached"] <= 2
    after = marconi_figures(server.url)
    assert after["marconi_ssm_states_admitted"] - before["marconi_ssm_states_admitted"] >= len(prompts)
    assert after["marconi_evictions_leaf"] == before["marconi_evictions_leaf"]  # nothing left by eviction


def test_warm_responses_equal_cold_ones(server):
    flush_cache(server.url)
    system = tokens(6, 140)
    warm = []
    prompt = system + tokens(7, 30)
    for turn in range(3):  # multi-turn reuse, then branches off the shared system prompt
        warm.append(generate(server.url, prompt, max_new_tokens=12))
        prompt = prompt + warm[-1].output_ids + tokens(300 + turn, 20)
    warm += [generate(server.url, system + tokens(400 + i, 30), max_new_tokens=12) for i in range(3)]
    hits = [g for g in warm if g.cached_tokens > 0]
    assert len(hits) >= 3, [g.cached_tokens for g in warm]
    for g in hits:
        flush_cache(server.url)
        cold = generate(server.url, g.input_ids, max_new_tokens=12)
        assert cold.cached_tokens == 0
        assert cold.output_ids == g.output_ids
        assert cold.logprobs == g.logprobs
    # The check can fail: different prompts give different greedy outputs.
    assert len({tuple(g.output_ids) for g in warm}) == len(warm)


def test_figures_and_gauges_agree_with_the_responses(server):
    before = marconi_figures(server.url)
    system = tokens(8, 100)
    responses = [generate(server.url, system + tokens(500 + i, 15)) for i in range(4)]
    after = marconi_figures(server.url)
    assert after["marconi_requests"] - before["marconi_requests"] == len(responses)
    assert after["marconi_hit_tokens"] - before["marconi_hit_tokens"] == sum(r.cached_tokens for r in responses)
    assert after["marconi_input_tokens"] - before["marconi_input_tokens"] == sum(r.prompt_tokens for r in responses)
    assert sum(r.cached_tokens for r in responses) > 0
    gauges = marconi_gauges(server.url)
    from sglang_marconi.serving.metrics import GAUGES

    assert set(GAUGES) <= set(gauges)
    for key in GAUGES:
        assert gauges[key] == pytest.approx(float(after[key])), key


def test_tuner_choice_and_shadow_scores_are_served(server):
    """The shadow tuner runs in the server (the default `--marconi-alpha auto`): every candidate of
    the default configuration has a score in /server_info and a gauge on /metrics, and exactly one
    choice is marked in force."""
    from sglang_marconi.policy.shadow_tuner import choice_label
    from sglang_marconi.serving.config import MarconiServingConfig

    system = tokens(9, 100)

    def tuner_caught_up() -> dict:  # it observes in the background, at the lowest CPU priority
        deadline = time.monotonic() + 60
        while True:
            figures = marconi_figures(server.url)
            if figures["marconi_tuner_requests_observed"] >= figures["marconi_tuner_requests_fed"]:
                return figures
            assert time.monotonic() < deadline, figures
            time.sleep(0.5)

    for i in range(20):  # more than one batch (16 requests) handed to the tuner
        generate(server.url, system + tokens(700 + i, 15), max_new_tokens=4)
    figures = tuner_caught_up()
    assert figures["marconi_tuner_requests_fed"] > 0
    # Gauges are published when a request is released. Release one that does not complete a batch
    # (the tuner's scores then stay as they are), so /metrics and /server_info must agree.
    if figures["marconi_requests"] - figures["marconi_tuner_requests_fed"] == 15:
        generate(server.url, system + tokens(798, 15), max_new_tokens=4)
        tuner_caught_up()
    generate(server.url, system + tokens(799, 15), max_new_tokens=4)
    figures = marconi_figures(server.url)
    expected = {choice_label(c) for c in MarconiServingConfig().tuning().choices}
    assert figures["marconi_tuning_failures"] == 0 and figures["marconi_tuner_requests_dropped"] == 0
    scores = figures["marconi_shadow_scores"]
    assert set(scores) == expected and len(expected) > 2
    assert labelled_gauge(server.url, "sglang:marconi_shadow_score", "choice") == pytest.approx(scores)
    in_force = labelled_gauge(server.url, "sglang:marconi_choice", "choice")
    assert set(in_force) == expected
    assert [c for c, v in in_force.items() if v == 1.0] == [figures["marconi_choice"]]


def test_frontend_program_many_users_one_system_prompt(server):
    import system_prompt_users
    from transformers import AutoTokenizer

    flush_cache(server.url)
    grid = marconi_figures(server.url)["marconi_checkpoint_grid"]
    tokenizer = AutoTokenizer.from_pretrained(server.argv[server.argv.index("--model-path") + 1])
    shared = len(tokenizer.encode("SYSTEM:" + system_prompt_users.SYSTEM_PROMPT + "\nUSER:"))
    calls = system_prompt_users.run(server.url, users=5, branches=2, max_tokens=8)
    answers = [c for c in calls if c.part == "answer"]
    assert all(a.cached_tokens >= floor_to(shared, grid) for a in answers[2:]), [a.cached_tokens for a in answers]
    for a in answers:  # every forked branch reuses its user's whole question and answer
        for b in (c for c in calls if c.user == a.user and c.part != "answer"):
            assert b.cached_tokens >= a.prompt_tokens + a.completion_tokens - 1, (a, b)


def test_frontend_program_multi_turn_agent(server):
    import multi_turn_agent

    flush_cache(server.url)
    turns = multi_turn_agent.run(server.url, agents=2, turns=4, max_tokens=8, parallel=2)
    for prev, cur in zip(turns, turns[1:]):
        if cur.agent == prev.agent:
            assert cur.cached_tokens >= prev.prompt_tokens + prev.completion_tokens - 1, (prev, cur)
