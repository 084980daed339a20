"""The `marconi` backend under SGLang's `--enable-unified-memory` (full KV and Mamba states carved
from one byte buffer), end to end through a real server on this CPU, for the tiny gated-delta-net
and Mamba2 models: every scenario of `test_live_server.py` (imported below; they run against this
module's `server` fixture), then byte pressure on the one budget.

SGLang refuses unified memory with torch_native attention; on this CPU it runs through the
test-only page-major stand-in (`tests/cpu_engine/page_major_attention.py`, checked by
`test_page_major_attention.py`). no_buffer Mamba strategy (overlap scheduling off), the
`marconi` launcher: the flag combination, not the launchers, is what this module adds.

"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from http_api import flush_cache, generate, internal_state, marconi_figures  # noqa: E402
from test_live_server import (  # noqa: E402,F401  (the end-to-end scenarios, run here on one budget)
    CHUNK,
    test_figures_and_gauges_agree_with_the_responses,
    test_frontend_program_many_users_one_system_prompt,
    test_frontend_program_multi_turn_agent,
    test_long_prompts_leave_at_most_two_states_each,
    test_multi_turn_chat_reuses_the_previous_turn,
    test_shared_system_prompt_hits_from_the_third_request,
    test_the_scheduler_runs_the_marconi_cache,
    test_third_request_sharing_a_150_token_prompt_hits_all_150,
    test_tuner_choice_and_shadow_scores_are_served,
    test_warm_responses_equal_cold_ones,
    tokens,
)

KINDS = ("gated-delta", "mamba2")
UNIFIED = ("--enable-unified-memory", "--chunked-prefill-size", str(CHUNK))


@pytest.fixture(scope="module", params=KINDS)
def server(request, tiny_model, launch):
    srv = launch(tiny_model(request.param), extra_args=UNIFIED)
    srv.kind, srv.strategy = request.param, "no_buffer"
    srv.page_size = 1
    yield srv
    srv.stop()


def test_served_on_one_byte_budget_by_marconi(server):
    state = internal_state(server.url)
    assert state.get("enable_unified_memory") is True, sorted(state)
    marconi = state["marconi"]
    assert "marconi_fallback" not in marconi and marconi["marconi_eviction_policy"] != "upstream", marconi


def test_byte_pressure_evicts_across_kinds_and_stays_exact(server):
    """Far more distinct long prompts than the one buffer holds (KV and states together): the
    cache evicts, keeps serving, and a hit after the pressure is still exact (warm == cold)."""
    flush_cache(server.url)
    before = marconi_figures(server.url)
    system = tokens(40, 120)
    # Each prompt leaves a branch state at 120 and its own state and ~400 KV tokens; 40 of them
    # need far more than the pool (the fixture's 8192 KV tokens + 24 states as one byte budget).
    for i in range(40):
        generate(server.url, system + tokens(4000 + i, 400), max_new_tokens=2)
    after = marconi_figures(server.url)
    evicted = sum(after[k] - before[k] for k in ("marconi_evictions_leaf", "marconi_evictions_single_child",
                                                "marconi_evictions_fallback", "marconi_evictions_probationary")
                  if k in after)
    assert evicted > 0, after
    warm = generate(server.url, system + tokens(5000, 30), max_new_tokens=12)
    assert warm.cached_tokens >= len(system), warm.cached_tokens  # the shared prefix survived
    flush_cache(server.url)
    cold = generate(server.url, warm.input_ids, max_new_tokens=12)
    assert cold.cached_tokens == 0
    assert (cold.output_ids, cold.logprobs) == (warm.output_ids, warm.logprobs)
    other = generate(server.url, tokens(41, 120) + tokens(5000, 30), max_new_tokens=12)
    assert other.output_ids != warm.output_ids  # the comparison can fail
