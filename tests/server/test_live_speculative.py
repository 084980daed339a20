"""The `marconi` backend with speculative decoding, end to end through a real SGLang server on this
CPU: `python -m sglang_marconi.launch_server --speculative-algorithm NEXTN --speculative-num-steps 3
--speculative-eagle-topk 1 --speculative-num-draft-tokens 4` (the command Qwen3-Next is served with)
on the tiny gated-delta-net hybrid that carries Qwen3-Next's MTP layer (`tiny_models`,
`gated-delta-mtp`: its draft layer agrees with the target about half the time, so drafts are both
accepted and rejected), no_buffer Mamba strategy. A second server, the same model without
speculative decoding, is the reference for the outputs.

SGLang runs speculative decoding on CPU through test-only stand-ins (`tests/cpu_engine/`:
`speculative_attention.py`, `torch_kernels/speculative.py`, the verify paths of the conv and
delta-rule stand-ins), each checked by `test_cpu_kernels.py` against SGLang's own Triton kernels
(the Triton interpreter), SGLang's own torch path or plain indexing; and here, end to end: outputs
cold and warm equal the server's without speculative decoding, token for token and logprob for
logprob.

What the tree holds under speculative decoding (SGLang 0.5.23, Mamba hybrids): tokens, not bigrams
(`UnifiedTreeCore.is_eagle` is off with a Mamba component); each verify commits the state of the
last accepted step into the request's slot (rejected steps' states are dropped with the
verify's intermediate buffer). A finished request therefore holds the state after its last
accepted token: all its output but the pending bonus token when its stop lands on the bonus, all
of it when the stop lands on an accepted draft (`produced == output + 1`), and tokens past the stop
when the last verify accepted more than the request needed (`produced >= output + 2`): SGLang then
keeps the whole request out of the tree (`_mamba_can_cache_finished_req`), which Marconi counts
(`marconi_speculative_final_states_skipped`). `produced` is read off the response:
1 (the prefill's token) + sum over verifies of (accepted drafts + 1).
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("sglang")

from http_api import (  # noqa: E402
    flush_cache, generate_with_meta, internal_state, marconi_figures, marconi_gauges, reads_decode_written_kv,
    same_up_to_numeric_ties,
)
from numeric_gap import DECODE_KV_GAP  # noqa: E402
from test_live_server import assert_at_most_two_states_per_prompt, tokens, turns_then_branches  # noqa: E402

CHUNK = 128
SPECULATIVE = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
               "--speculative-num-draft-tokens", "4")


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """(speculative, plain): the two servers, started side by side."""
    from live_server import start_server

    model = tiny_model("gated-delta-mtp")
    logs = tmp_path_factory.mktemp("speculative-logs")
    flags = {"speculative": SPECULATIVE, "plain": ()}
    started, failed = {}, []

    def start(name):
        try:
            started[name] = start_server(model, extra_args=("--chunked-prefill-size", str(CHUNK), *flags[name]),
                                         log_path=logs / f"{name}.log")
        except Exception as exc:  # noqa: BLE001 - reported below, after both are up or down
            failed.append(exc)

    threads = [threading.Thread(target=start, args=(name,)) for name in flags]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if failed:
            raise failed[0]
        yield started["speculative"], started["plain"]
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def generate(url: str, input_ids: list[int], max_new_tokens: int = 8):
    """Greedy generation from token ids: (Generation, tokens produced), where produced counts the
    accepted run of every verify (what the request's state covers, plus its pending bonus token)."""
    g, meta = generate_with_meta(url, input_ids, max_new_tokens)
    histogram = meta.get("spec_correct_drafts_histogram")
    g.histogram = histogram
    g.produced = None if histogram is None else 1 + sum((k + 1) * n for k, n in enumerate(histogram))
    return g


def overshoot(g) -> int:
    """Accepted tokens past the stop (1: only the pending bonus token, as without speculation)."""
    return g.produced - len(g.output_ids)


def reusable(g) -> int:
    """What a request extending `g`'s input and visible output can at least reuse: its final state
    (all of its output but the last token, or all of it when its stop landed on an accepted draft),
    or, when its last verify ran past the stop (no final state), the state it left on probation at
    the end of its input."""
    if overshoot(g) >= 2:
        return g.prompt_tokens
    return g.prompt_tokens + g.produced - 1


def test_marconi_serves_speculative_decoding(server):
    state = internal_state(server.url)
    marconi = state["marconi"]
    assert "marconi_fallback" not in marconi and marconi["marconi_eviction_policy"] != "upstream", marconi
    assert state["speculative_algorithm"] in ("NEXTN", "EAGLE")  # SGLang serves NEXTN as EAGLE
    assert marconi["marconi_speculative"] == state["speculative_algorithm"]
    assert marconi["marconi_speculative_num_draft_tokens"] == 4
    assert marconi["marconi_checkpoint_grid"] == 1  # no_buffer: the exact branch
    generate(server.url, tokens(1, 20), max_new_tokens=2)  # gauges are published on a release
    gauges = marconi_gauges(server.url)
    assert gauges["marconi_speculative_num_draft_tokens"] == 4
    assert gauges["marconi_speculative_final_states_skipped"] == marconi_figures(
        server.url)["marconi_speculative_final_states_skipped"]


def test_shared_system_prompt_hits_from_the_third_request(server):
    flush_cache(server.url)
    system = tokens(2, 150)
    cached = [generate(server.url, system + tokens(200 + i, 20), max_new_tokens=4).cached_tokens for i in range(4)]
    assert cached[:2] == [0, 0]  # nothing shared is cached before the second request leaves its branch
    assert all(c >= len(system) for c in cached[2:]), cached


def test_multi_turn_chat_reuses_the_previous_turn(server):
    flush_cache(server.url)
    prompt = tokens(1, 90)
    full_turn_hits = 0
    previous = None
    for turn in range(3):
        g = generate(server.url, prompt, max_new_tokens=10)
        if previous is not None:
            assert g.cached_tokens >= reusable(previous) > 0, (turn, previous.histogram, g.cached_tokens)
            full_turn_hits += g.cached_tokens >= previous.prompt_tokens + len(previous.output_ids) - 1
        previous = g
        prompt = prompt + g.output_ids + tokens(100 + turn, 25)
    assert full_turn_hits >= 1  # at least one turn reused its whole previous turn


def test_long_prompts_leave_at_most_two_states_each(server):
    flush_cache(server.url)
    prompts = [tokens(3, 3 * CHUNK)]  # three prefill chunks: upstream's admission would keep three states
    prompts.append(prompts[0][: CHUNK + 40] + tokens(4, 2 * CHUNK))  # branches inside the second chunk
    prompts.append(prompts[0][: CHUNK + 40] + tokens(5, 2 * CHUNK))
    before, after = assert_at_most_two_states_per_prompt(
        server.url, prompts, lambda prompt: generate(server.url, prompt, max_new_tokens=4))
    assert after["marconi_ssm_states_admitted"] - before["marconi_ssm_states_admitted"] >= 2  # two branches
    assert after["marconi_evictions_leaf"] == before["marconi_evictions_leaf"]


def test_warm_responses_equal_cold_ones_and_the_plain_servers(servers):
    speculative, plain = servers
    flush_cache(speculative.url)
    warm = turns_then_branches(lambda prompt: generate(speculative.url, prompt, max_new_tokens=8), turns=2, branches=2)
    hits = [g for g in warm if g.cached_tokens > 0]
    assert len(hits) >= 2, [g.cached_tokens for g in warm]

    def gap(g):  # identical arithmetic unless the hit read KV / a state that verify steps wrote
        return DECODE_KV_GAP["gated-delta-mtp"] if reads_decode_written_kv(g, warm[:warm.index(g)]) else 0.0

    for g in hits:
        flush_cache(speculative.url)
        cold = generate(speculative.url, g.input_ids, max_new_tokens=8)
        assert cold.cached_tokens == 0
        assert (result := same_up_to_numeric_ties(g, cold, gap(g))), result.detail
    # With speculative decoding on and off: the plain server's outputs, bitwise, for a request
    # served cold (the first); for one served warm, as its cold run compares.
    for g in (warm[0], hits[0]):
        ref = generate(plain.url, g.input_ids, max_new_tokens=8)
        assert ref.histogram is None  # no speculative decoding there
        assert (result := same_up_to_numeric_ties(g, ref, gap(g))), result.detail
    histograms = [g.histogram for g in warm]
    assert any(h[0] for h in histograms), histograms  # verifies that accepted no draft
    assert any(sum(h[1:]) for h in histograms), histograms  # and some that accepted drafts
    assert len({tuple(g.output_ids) for g in warm}) == len(warm)  # the check can fail


def test_a_verify_past_the_stop_leaves_no_state_claiming_tokens(server):
    """A request whose last verify accepted tokens past its stop: nothing of its decode is cached
    (its state covers tokens the client never sees); the next turn reuses what it can (its input,
    on probation), exactly; the request still counts in the figures."""
    found = None
    for seed in range(8):  # greedy and deterministic: the first prompt whose last verify overshoots
        flush_cache(server.url)
        before = marconi_figures(server.url)
        prompt = tokens(900 + seed, 40)
        g = generate(server.url, prompt, max_new_tokens=5)
        if overshoot(g) >= 2:
            found = g
            break
    assert found is not None, "no request overshot its stop"
    after = marconi_figures(server.url)
    assert after["marconi_speculative_final_states_skipped"] - before["marconi_speculative_final_states_skipped"] == 1
    assert after["marconi_requests"] - before["marconi_requests"] == 1
    follow_up = found.input_ids + found.output_ids + tokens(950, 10)
    warm = generate(server.url, follow_up, max_new_tokens=8)
    assert warm.cached_tokens == found.prompt_tokens  # the input's state (probation), nothing decoded
    flush_cache(server.url)
    cold = generate(server.url, follow_up, max_new_tokens=8)
    assert cold.cached_tokens == 0
    assert (result := same_up_to_numeric_ties(warm, cold, 0.0)), result.detail  # prefill-written: identical
