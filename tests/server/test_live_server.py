"""End to end through a real SGLang server on this CPU (SGLang's CPU engine, tiny random hybrid
models): `python -m sglang_marconi.launch_server`, and upstream's `python -m sglang.launch_server
--radix-cache-backend marconi` (the plugin entry point), for a gated-delta-net and a Mamba2 model,
in both of SGLang's Mamba radix-cache strategies: `no_buffer` (overlap scheduling off, which that
mode requires) and `extra_buffer` (SGLang's GPU default, overlap scheduling on; on this CPU through
the test-only state-snapshot platform stand-in, `tests/cpu_engine/snapshot_platform.py`).

Through the HTTP API (token ids, greedy) and SGLang frontend programs (`examples/`):
multi-turn reuse, a shared system prompt and forked branches, warm == cold exactness, at most two
SSM states per request, and figures that agree with what the responses reported.

What a later request can reuse differs by mode. no_buffer: the state after the last decoded token
(what it reuses: the previous prompt and output, less the last sampled token) and the state at the
exact branch (two-pass prefill). extra_buffer: only states the forward pass snapshotted, 64k tokens
into each extend (prefill chunks here are 128 tokens, so every 64 tokens from where the extend
started) or at every 256th token decoded; a finished request leaves its last one, and the tree keeps
its KV only that far.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from http_api import (  # noqa: E402
    flush_cache, generate, internal_state, labelled_gauge, marconi_figures, marconi_gauges,
    reads_decode_written_kv, same_up_to_numeric_ties,
)
from numeric_gap import DECODE_KV_GAP  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

CHUNK = 128  # --chunked-prefill-size: long prompts prefill in several chunks
SNAPSHOT = 64  # extra_buffer: SGLang's mamba_cache_chunk_size for both tiny models (page size 1)
STRATEGIES = ("no_buffer", "extra_buffer")
SERVED = [(kind, "marconi", strategy) for strategy in STRATEGIES for kind in ("gated-delta", "mamba2")]
# SGLang's own launcher with `--radix-cache-backend marconi` (the plugin entry point) loads the same
# backend; the launcher does not depend on the model kind or the strategy, so it runs each kind
# and each strategy once rather than every pair.
SERVED += [("gated-delta", "sglang", "no_buffer"), ("mamba2", "sglang", "extra_buffer")]
# Two more configurations operators run, ours only: the lazy copy of extra_buffer's tracked
# states, and a page size above 1 (SGLang allows it with extra_buffer only).
SERVED += [("gated-delta", "marconi", "extra_buffer_lazy"), ("mamba2", "marconi", "extra_buffer-page16")]


@contextlib.contextmanager
def strategy_flags(strategy: str):
    """`live_server.CPU_FLAGS` for the strategy while a server starts: extra_buffer, and overlap
    scheduling on (SGLang's default with it), instead of no_buffer without overlap."""
    import live_server

    saved = live_server.CPU_FLAGS
    if strategy != "no_buffer":
        flags = [f for f in saved if f != "--disable-overlap-schedule"]
        flags[flags.index("--mamba-radix-cache-strategy") + 1] = strategy.partition("-")[0]
        live_server.CPU_FLAGS = tuple(flags)
    try:
        yield
    finally:
        live_server.CPU_FLAGS = saved


@pytest.fixture(scope="module", params=SERVED, ids=["-".join(p) for p in SERVED])
def server(request, tiny_model, launch):
    kind, launcher, strategy = request.param
    extra = ["--chunked-prefill-size", str(CHUNK)]
    if strategy.endswith("-page16"):
        extra += ["--page-size", "16"]
    if launcher == "sglang":
        extra += ["--radix-cache-backend", "marconi"]
    with strategy_flags(strategy):
        srv = launch(tiny_model(kind), launcher=launcher, extra_args=extra)
    srv.kind, srv.strategy = kind, strategy.partition("-")[0]
    srv.page_size = 16 if strategy.endswith("-page16") else 1
    yield srv
    srv.stop()


def tokens(seed: int, n: int) -> list[int]:
    """n random word ids (2..511: never a special token)."""
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def floor_to(n: int, grid: int) -> int:
    return n // grid * grid


def reusable(server, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> int:
    """What the next request extending this one can at least reuse. no_buffer: the prompt and the
    output but the last sampled token (never fed back: no KV, no state after it). extra_buffer: the
    extend's last snapshot, 64k tokens past where it started (a lower bound: a decode snapshot
    may lie further)."""
    if server.strategy == "no_buffer":
        return prompt_tokens + output_tokens - 1
    return cached_tokens + floor_to(prompt_tokens - cached_tokens, SNAPSHOT)


def test_client_cache_hints_keep_a_keyed_conversation(server):
    """`live_hints.py`, on one server of the set and before the others (from a fresh server the
    tuner keeps LRU): the hint rule depends on neither the model kind nor the launcher."""
    if (server.kind, server.strategy, server.page_size) != ("gated-delta", "no_buffer", 1) \
            or "sglang_marconi.launch_server" not in server.argv:
        pytest.skip("runs on the gated-delta no_buffer server of our launcher")
    from live_hints import check_hints

    check_hints(server)


def test_the_scheduler_runs_the_marconi_cache(server):
    state = internal_state(server.url)
    assert "marconi" in state, sorted(state)
    assert state["mamba_radix_cache_strategy"] == server.strategy
    assert state["disable_overlap_schedule"] is (server.strategy == "no_buffer")  # overlap on with extra_buffer
    # Branch states sit at the exact branch in no_buffer mode (two-pass prefill; page size 1), on
    # SGLang's 64-token snapshot grid in extra_buffer mode.
    assert state["marconi"]["marconi_checkpoint_grid"] == (1 if server.strategy == "no_buffer" else SNAPSHOT)


def test_multi_turn_chat_reuses_the_previous_turn(server):
    flush_cache(server.url)
    prompt = tokens(1, 90)
    for turn in range(4):
        g = generate(server.url, prompt, max_new_tokens=10)
        if turn:
            assert g.cached_tokens >= reusable(server, previous.prompt_tokens, previous.cached_tokens,
                                               len(previous.output_ids)) > 0, turn
        previous = g
        prompt = prompt + g.output_ids + tokens(100 + turn, 25)


def test_reasoning_turns_resume_where_the_previous_input_ended(server):
    """A reasoning model's conversation whose template drops the decoded reasoning: each next turn is
    the previous input, then fresh tokens (the answer, a new user message), so it leaves the tree
    where the previous input ended. Every turn resumes less than a snapshot step before it (no_buffer:
    there exactly, its probationary input-end state), and in extra_buffer each turn that resumed
    at an input-end state keeps its own as a regular one (`policy/rules/input_end_resume.py`)."""
    flush_cache(server.url)
    before = marconi_figures(server.url)["marconi_input_end_states_kept"]
    prompt, turns = tokens(8, 150), 4
    for turn in range(turns):
        g = generate(server.url, prompt, max_new_tokens=30)
        if turn:
            assert previous - SNAPSHOT < g.cached_tokens <= previous, (turn, g.cached_tokens, previous)
            if server.strategy == "no_buffer":
                assert g.cached_tokens == previous
        previous = len(prompt)
        prompt = prompt + tokens(500 + turn, 60)  # the output dropped from the history
    kept = marconi_figures(server.url)["marconi_input_end_states_kept"] - before
    assert kept == (0 if server.strategy == "no_buffer" else turns - 1), kept


def test_shared_system_prompt_hits_from_the_third_request(server):
    flush_cache(server.url)
    grid = marconi_figures(server.url)["marconi_checkpoint_grid"]
    system = tokens(2, 150)
    cached = [generate(server.url, system + tokens(200 + i, 20)).cached_tokens for i in range(6)]
    if server.strategy == "no_buffer":
        assert cached[:2] == [0, 0]  # nothing shared is cached before the second request leaves its branch
    else:  # the first request's last snapshot (128) lies inside the shared prompt: reused at once
        assert cached[0] == 0
    assert all(c >= floor_to(len(system), grid) for c in cached[2:]), (cached, grid)


def test_third_request_sharing_a_150_token_prompt_hits_all_150(server):
    flush_cache(server.url)
    before = marconi_figures(server.url)
    shared = tokens(12, 150)
    # Suffixes whose first tokens differ from each other, so exactly 150 tokens are shared.
    cached = [generate(server.url, shared + [2 + i] + tokens(1200 + i, 19), max_new_tokens=4).cached_tokens
              for i in range(3)]
    lost = marconi_figures(server.url)["marconi_branch_tokens_lost_to_grid"] - before["marconi_branch_tokens_lost_to_grid"]
    if server.strategy == "no_buffer":
        assert cached == [0, 0, 150] and lost == 0  # the branch state at 150 itself, not at 128 on the grid
    else:
        # One snapshot per extend, 64k tokens in: the first request's last one (128) is the best
        # the mode keeps inside the shared prompt (its KV is kept that far only).
        assert cached == [0, 128, 128], cached


def backtrack_states_of(server) -> int:
    """B, the backtrack states per request the server keeps: its `--marconi-backtrack-states`, else
    the rule's default for its strategy (`policy/rules/backtrack_states.py`)."""
    from sglang_marconi.policy.rules.backtrack_states import default_setting, parse_backtrack_states

    flag = "--marconi-backtrack-states"
    setting = parse_backtrack_states(server.argv[server.argv.index(flag) + 1]) if flag in server.argv else None
    return default_setting(server.strategy != "no_buffer") if setting is None else setting


def assert_at_most_two_states_per_prompt(url: str, prompts, serve, backtrack_states: int = 0) -> tuple[dict, dict]:
    """`serve(prompt)` (a Generation) each prompt in turn: each admits at most two SSM states (its
    branch and its end), plus at most one on probation at the end of its input (--marconi-probation,
    the default) and at most `backtrack_states` (B) on probation at its chunk ends, and the tree
    holds no more states than that after it; with B, never more than upstream keeps for the
    prompt (a state per prefill chunk from its hit, and the final one). Returns the figures before
    and after."""
    from sglang_marconi.policy.rules.backtrack_states import upstream_states

    before = marconi_figures(url)
    for prompt in prompts:
        figures = marconi_figures(url)
        generation = serve(prompt)
        after = marconi_figures(url)
        assert after["marconi_ssm_states_admitted"] - figures["marconi_ssm_states_admitted"] <= 2
        probationary = (after["marconi_probationary_states_admitted"]
                        - figures["marconi_probationary_states_admitted"])
        backtrack = after["marconi_backtrack_states_admitted"] - figures["marconi_backtrack_states_admitted"]
        assert backtrack <= backtrack_states and probationary - backtrack <= 1, (probationary, backtrack)
        cached = after["marconi_ssm_states_cached"] - figures["marconi_ssm_states_cached"]
        assert cached <= 2 + probationary
        if backtrack_states:
            assert cached <= upstream_states(len(prompt), generation.cached_tokens, CHUNK), (cached, generation)
    return before, marconi_figures(url)


def test_long_prompts_leave_at_most_two_states_each(server):
    flush_cache(server.url)
    prompts = [tokens(3, 5 * CHUNK)]  # five prefill chunks: upstream's admission would keep five states
    prompts.append(prompts[0][: 2 * CHUNK + 40] + tokens(4, 3 * CHUNK))  # branches inside the third chunk
    prompts.append(prompts[0][: 2 * CHUNK + 40] + tokens(5, 3 * CHUNK))
    before, after = assert_at_most_two_states_per_prompt(
        server.url, prompts, lambda prompt: generate(server.url, prompt, max_new_tokens=6), backtrack_states_of(server))
    assert after["marconi_ssm_states_admitted"] - before["marconi_ssm_states_admitted"] >= len(prompts)
    assert after["marconi_evictions_leaf"] == before["marconi_evictions_leaf"]  # nothing left by eviction


def turns_then_branches(serve, turns: int, branches: int) -> list:
    """What `serve(prompt)` returns for `turns` turns of one conversation (each turn reuses the
    previous one), then for `branches` prompts that share only its system prompt."""
    system = tokens(6, 140)
    served, prompt = [], system + tokens(7, 30)
    for turn in range(turns):
        served.append(serve(prompt))
        prompt = prompt + served[-1].output_ids + tokens(300 + turn, 20)
    return served + [serve(system + tokens(400 + i, 30)) for i in range(branches)]


def test_warm_responses_equal_cold_ones(server):
    flush_cache(server.url)
    warm = turns_then_branches(lambda prompt: generate(server.url, prompt, max_new_tokens=12), turns=3, branches=3)
    hits = [(i, g) for i, g in enumerate(warm) if g.cached_tokens > 0]
    assert len(hits) >= 3, [g.cached_tokens for g in warm]
    for i, g in hits:
        flush_cache(server.url)
        cold = generate(server.url, g.input_ids, max_new_tokens=12)
        assert cold.cached_tokens == 0
        # Identical where the hit read prefill-written KV and states only; up to the measured
        # numeric gap (a near tie may flip) where it read a previous turn's decode-written ones.
        gap = DECODE_KV_GAP[server.kind] if reads_decode_written_kv(g, warm[:i]) else 0.0
        result = same_up_to_numeric_ties(g, cold, gap)
        assert result, f"hit of {g.cached_tokens} tokens: {result.detail}"
    # The check can fail: different prompts give different greedy outputs.
    assert len({tuple(g.output_ids) for g in warm}) == len(warm)


def gauge_shows(gauge: float, figure) -> bool:
    """A gauge shows its /server_info figure (None, a figure that does not apply now: NaN)."""
    return math.isnan(gauge) if figure is None else gauge == pytest.approx(float(figure))


def test_figures_and_gauges_agree_with_the_responses(server):
    before = marconi_figures(server.url)
    system = tokens(8, 100)
    responses = [generate(server.url, system + tokens(500 + i, 15)) for i in range(4)]
    after = marconi_figures(server.url)
    assert after["marconi_requests"] - before["marconi_requests"] == len(responses)
    assert after["marconi_hit_tokens"] - before["marconi_hit_tokens"] == sum(r.cached_tokens for r in responses)
    assert after["marconi_input_tokens"] - before["marconi_input_tokens"] == sum(r.prompt_tokens for r in responses)
    assert sum(r.cached_tokens for r in responses) > 0
    from sglang_marconi.serving.metrics import GAUGES

    # The shadow tuner counts what it observed in the background: /server_info reads it live, the
    # gauges as last published (each /server_info call, answered while idle, publishes them again).
    deadline = time.monotonic() + 30
    while True:
        gauges = marconi_gauges(server.url)
        assert set(GAUGES) <= set(gauges)
        stale = [key for key in GAUGES if not gauge_shows(gauges[key], after[key])]
        if not stale or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        after = marconi_figures(server.url)
    assert stale == [], [(key, gauges[key], after[key]) for key in stale]
    assert after["marconi_requests"] - before["marconi_requests"] == len(responses)  # still nothing else


def test_tuner_choice_and_shadow_scores_are_served(server):
    """The shadow tuner runs in the server (the default `--marconi-alpha auto`): every candidate of
    the default configuration has a score in /server_info and a gauge on /metrics, and exactly one
    choice is marked in force."""
    from sglang_marconi.policy.tuning.shadow_tuner import choice_label
    from sglang_marconi.serving.config import MarconiServingConfig

    if (server.kind, server.strategy, server.page_size) == ("gated-delta", "no_buffer", 1) \
            and "sglang_marconi.launch_server" in server.argv:
        # the cache-hint test's traffic ran first here and shifts the tuner's batch boundaries this
        # test counts on; the other seven servers run it
        pytest.skip("the cache-hint test ran first on this server")
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
    from sglang_marconi.policy.tuning.shadow_tuner import served_config

    # the depth choices where the shadows model SGLang's pools (not on pages > 1 nor one byte budget)
    models_pools = server.page_size == 1 and not internal_state(server.url).get("enable_unified_memory")
    tuning = MarconiServingConfig().tuning()
    expected = {choice_label(c) for c in (served_config(tuning) if models_pools else tuning).choices}
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
    # From the third user on, the whole shared prompt (its pages): the branch state sits on the
    # branch in both modes (extra_buffer: the extend is cut one snapshot step before it).
    shared_pages = floor_to(shared, server.page_size)
    assert all(a.cached_tokens >= shared_pages for a in answers[2:]), ([a.cached_tokens for a in answers], shared, grid)
    for a in answers:  # every forked branch reuses its user's whole question and answer (no_buffer)
        for b in (c for c in calls if c.user == a.user and c.part != "answer"):
            # extra_buffer keeps one snapshot per extend: when the user's last extend took its
            # branch state (at the shared prompt's end), that is also the latest state it left.
            bound = reusable(server, a.prompt_tokens, a.cached_tokens, a.completion_tokens)
            if server.strategy != "no_buffer" and a.cached_tokens < shared_pages:
                bound = min(bound, shared_pages)
            assert b.cached_tokens >= bound, (a, b, bound)


def test_frontend_program_multi_turn_agent(server):
    import multi_turn_agent

    flush_cache(server.url)
    # Two agents at once in no_buffer mode. In extra_buffer mode one at a time: a batch's token
    # budget cuts a concurrent prefill's extend anywhere, and an extend under 64 tokens gets no
    # snapshot there (upstream's tracking), so what a turn leaves would depend on timing.
    parallel = 2 if server.strategy == "no_buffer" else 1
    turns = multi_turn_agent.run(server.url, agents=2, turns=4, max_tokens=8, parallel=parallel)
    for prev, cur in zip(turns, turns[1:]):
        if cur.agent == prev.agent:
            assert cur.cached_tokens >= reusable(server, prev.prompt_tokens, prev.cached_tokens,
                                                 prev.completion_tokens), (prev, cur)
