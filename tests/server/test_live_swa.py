"""A sliding-window-attention (SWA) hybrid served by the `marconi` backend through a real SGLang
server on this CPU: the tiny Mellum model (`tiny_models.py`, kind `sliding-window`: 3 SWA layers
with a 32-token window, 1 global layer), SGLang's SWA cache component with Marconi's eviction
(`sglang_marconi/serving/swa_component.py`).

One server, with an SWA pool of about 400 tokens (`--swa-full-tokens-ratio`), so that the
pressure tests evict windows while the others (each starting from an empty cache) do not; the
flood test also runs its request sequence against upstream's server (`python -m
sglang.launch_server`, SGLang's own SWA eviction, same flags) and holds it to losing what ours
keeps.

Also here (no server): the CPU stand-in that lets torch_native read sliding-window layers from
SGLang's SWA pool (`tests/cpu_engine/torch_kernels/swa_attention.py`), against SDPA over the
contiguous K/V with the window mask.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import random
from pathlib import Path

import pytest

from http_api import common_prefix
from tiny_models import SLIDING_WINDOW

SWA_KIND = "sliding-window"
CHUNK = 64  # --chunked-prefill-size: prompts prefill in several chunks, windows slide between them
SWA_FLAGS = ("--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "8192", "--swa-full-tokens-ratio", "0.05")
STAND_IN = Path(__file__).resolve().parents[1] / "cpu_engine" / "torch_kernels" / "swa_attention.py"


def tokens(seed: int, n: int) -> list[int]:
    """n random word ids (2..511: never a special token)."""
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


# --- the stand-in, against a reference (no server) ------------------------------------------

def _stand_in():
    spec = importlib.util.spec_from_file_location("swa_attention_stand_in", STAND_IN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_swa_reads_through_swa_slots_match_windowed_sdpa():
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    swa_rows = _stand_in().swa_rows
    g = torch.Generator().manual_seed(0)
    heads, dim, window = 2, 8, 5  # the backend's sliding_window_size: keys q-window..q
    prefix, extend = 11, 6
    seq = prefix + extend
    k_full = torch.randn(seq, heads, dim, generator=g)
    v_full = torch.randn(seq, heads, dim, generator=g)
    q = torch.randn(extend, heads, dim, generator=g)
    # Full-pool slots of the request, and an SWA pool holding only positions still in the window
    # of some query, at shuffled slots; older positions map to a sink slot full of garbage.
    full_slots = torch.randperm(64, generator=g)[:seq] + 1
    live = list(range(prefix - window, seq))
    swa_slots = torch.randperm(30, generator=g)[:len(live)] + 1
    full_to_swa = torch.zeros(66, dtype=torch.int64)
    full_to_swa[full_slots[live]] = swa_slots
    k_swa, v_swa = torch.randn(80, heads, dim, generator=g) * 50, torch.randn(80, heads, dim, generator=g) * 50
    k_swa[swa_slots], v_swa[swa_slots] = k_full[live], v_full[live]
    req_to_token = torch.zeros(3, 80, dtype=torch.int32)
    req_to_token[2, :seq] = full_slots.to(torch.int32)
    req_pool_indices, seq_lens = torch.tensor([2]), torch.tensor([seq])

    def run(table, indices, k_cache, v_cache):
        out = torch.empty_like(q)
        backend = object.__new__(TorchNativeAttnBackend)
        backend._run_sdpa_forward_extend(q, out, k_cache, v_cache, table, indices, seq_lens, torch.tensor([prefix]),
                                         torch.tensor([extend]), scaling=dim ** -0.5, causal=True,
                                         sliding_window_size=window)
        return out

    positions = torch.arange(seq)
    query_pos = positions[prefix:, None]
    mask = (positions[None, :] <= query_pos) & (positions[None, :] >= query_pos - window)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k_full.transpose(0, 1), v_full.transpose(0, 1), attn_mask=mask, scale=dim ** -0.5,
    ).transpose(0, 1)
    translated = run(swa_rows(req_to_token, req_pool_indices, seq_lens, full_to_swa), torch.arange(1), k_swa, v_swa)
    torch.testing.assert_close(translated, reference, rtol=1e-5, atol=1e-5)
    # SGLang's own read (full-pool slots into the SWA buffer) is wrong: the stand-in is needed.
    untranslated = run(req_to_token, req_pool_indices, k_swa, v_swa)
    assert not torch.allclose(untranslated, reference, atol=1e-2)


# --- live -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def swa_server(tiny_model, launch):
    """Marconi's SWA rule at a fixed alpha (1, the paper's): what these tests check is the rule.
    Under `--marconi-alpha auto` (the default) the server starts from alpha 0 (recency alone over
    Marconi's candidates) and moves only on the shadows' evidence, which a few dozen requests do
    not give; `tuned_swa_server` checks that path."""
    server = launch(tiny_model("sliding-window"), launcher="marconi", extra_args=SWA_FLAGS + ("--marconi-alpha", "1"))
    yield server
    server.stop()


@pytest.fixture  # one test uses it: stopped right after
def tuned_swa_server(tiny_model, launch):
    server = launch(tiny_model("sliding-window"), launcher="marconi", extra_args=SWA_FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def upstream_swa_server(tiny_model, launch):
    server = launch(tiny_model("sliding-window"), launcher="sglang", extra_args=SWA_FLAGS)
    yield server
    server.stop()


def _cold(url, generation):
    """The same request on an empty cache."""
    from http_api import flush_cache, generate

    flush_cache(url)
    cold = generate(url, generation.input_ids, max_new_tokens=len(generation.output_ids))
    assert cold.cached_tokens == 0
    return cold


def assert_warm_equals_cold(url, warm_generations):
    """Every request that hit gives what it gives on an empty cache: token for token and logprob
    for logprob where the hit read prefill-written KV only (the same arithmetic), and up to the
    measured numeric gap of decode-written KV otherwise (`http_api.same_up_to_numeric_ties`);
    and requests with different prompts gave different outputs (so equality is not a constant
    model's). `warm_generations` in the order they ran."""
    from http_api import reads_decode_written_kv, same_up_to_numeric_ties
    from numeric_gap import DECODE_KV_GAP

    hits = [(i, g) for i, g in enumerate(warm_generations) if g.cached_tokens > 0]
    assert hits, "no request hit: nothing to compare"
    for i, warm in hits:
        decode_written = reads_decode_written_kv(warm, warm_generations[:i])
        result = same_up_to_numeric_ties(warm, _cold(url, warm), DECODE_KV_GAP[SWA_KIND] if decode_written else 0.0)
        assert result, f"hit of {warm.cached_tokens} tokens changed the output: {result.detail}"
    outputs = {tuple(g.output_ids) for g in warm_generations}
    assert len(outputs) > 1, "different prompts gave the same output"


def test_swa_server_uses_marconi(swa_server):
    from http_api import marconi_figures

    figures = marconi_figures(swa_server.url)
    assert figures["marconi_eviction_policy"] == "marconi-swa", figures
    assert figures["marconi_sliding_window"] in (SLIDING_WINDOW - 1, SLIDING_WINDOW)


def test_swa_alpha_is_tuned_online_and_its_gauges_are_served(tuned_swa_server):
    """`--marconi-alpha auto` (the default): window shadows score every alpha of the grid in the
    background; the SWA gauges are on /metrics beside SGLang's."""
    import time

    from http_api import generate, marconi_figures, marconi_gauges

    from sglang_marconi.policy.tuning.shadow_tuner import choice_label
    from sglang_marconi.serving.config import MarconiServingConfig
    from sglang_marconi.serving.metrics import SWA_GAUGES

    for i in range(4):
        generate(tuned_swa_server.url, tokens(900 + i, 40))
    figures = marconi_figures(tuned_swa_server.url)
    assert figures["marconi_tuning_failures"] == 0
    assert set(figures["marconi_shadow_scores"]) == {choice_label(a) for a in MarconiServingConfig().alpha_grid}
    deadline = time.monotonic() + 30  # published at most once a second, and when idle
    while not set(SWA_GAUGES) <= set(gauges := marconi_gauges(tuned_swa_server.url)):
        assert time.monotonic() < deadline, sorted(set(SWA_GAUGES) - set(gauges))
        time.sleep(0.5)
    assert gauges["marconi_requests"] >= 4 and gauges["marconi_sliding_window"] == figures["marconi_sliding_window"]


def test_shared_system_prompt_longer_than_window_hits_from_third_request(swa_server):
    from http_api import flush_cache, generate

    url = swa_server.url
    flush_cache(url)
    system = tokens(1, 3 * SLIDING_WINDOW + 5)
    # Each user's question starts with a different word, so requests branch right after `system`.
    runs = [generate(url, system + [10 + i] + tokens(100 + i, 12)) for i in range(4)]
    # 1st: empty cache. 2nd: the full KV of `system` is there, but the window before its end was
    # freed as the 1st request slid past it (a hit needs that window's KV): at most the prefix up
    # to the 1st request's first chunk, cached while its window was live. The 2nd inserts its
    # prefix up to the branch point while that window is live: from the 3rd on, the whole prompt.
    assert runs[0].cached_tokens == 0
    assert runs[1].cached_tokens in (0, CHUNK)
    assert [r.cached_tokens for r in runs[2:]] == [len(system), len(system)]
    assert_warm_equals_cold(url, runs)


def _multi_turn_chat(url) -> list:
    from http_api import flush_cache, generate

    flush_cache(url)
    history = tokens(2, 50)
    turns = []
    for turn in range(3):
        g = generate(url, history, max_new_tokens=8)
        turns.append(g)
        history = history + g.output_ids + tokens(200 + turn, 20)
    return turns


def test_multi_turn_chat_hits_its_previous_turn(swa_server, upstream_swa_server):
    from http_api import reads_decode_written_kv

    turns = _multi_turn_chat(swa_server.url)
    for previous, g in zip(turns, turns[1:]):
        # Everything the previous turn computed KV for: its prompt and output, less the last
        # sampled token (the window before it is the one a finished request keeps).
        assert g.cached_tokens == len(previous.input_ids) + len(previous.output_ids) - 1
    # These hits read KV written by decode steps, which SGLang's CPU engine computes with other
    # arithmetic than a prefill: logprobs move by up to the measured gap (`numeric_gap.py`, on
    # upstream's cache; with no SWA pool at all too), so a near tie may flip a token. Tokens are
    # held equal up to such a flip (`same_up_to_numeric_ties`); hits on prefill-written KV are
    # held to equality (the other tests here).
    assert all(reads_decode_written_kv(g, turns[:i]) for i, g in enumerate(turns) if i)
    assert_warm_equals_cold(swa_server.url, turns)
    # The control: upstream's SWA cache on the same conversation, under the same comparison.
    upstream_turns = _multi_turn_chat(upstream_swa_server.url)
    assert any(reads_decode_written_kv(g, upstream_turns[:i]) for i, g in enumerate(upstream_turns) if i), \
        [g.cached_tokens for g in upstream_turns]
    assert_warm_equals_cold(upstream_swa_server.url, upstream_turns)


def test_under_swa_pressure_hits_never_cross_a_broken_window(swa_server):
    from http_api import flush_cache, generate, marconi_figures

    url = swa_server.url
    flush_cache(url)
    before = marconi_figures(url)
    shared = tokens(3, 4 * SLIDING_WINDOW)
    runs = []

    def ask(input_ids):
        runs.append(generate(url, input_ids, max_new_tokens=6))
        return runs[-1]

    for i in range(3):  # a branch point at len(shared), with its window
        ask(shared + [20 + i] + tokens(300 + i, 10))
    # A prefix of `shared` cut mid-way: its full KV is cached, its window is not (slid past).
    cut = ask(shared[:3 * SLIDING_WINDOW] + [40] + tokens(400, 10))
    for i in range(10):  # unrelated traffic: more SWA KV than the pool holds
        ask(tokens(500 + i, 90))
    for i in range(3):  # back to the shared prefix, and to the cut
        ask(shared + [60 + i] + tokens(600 + i, 10))
    ask(shared[:3 * SLIDING_WINDOW] + [41] + tokens(700, 10))

    figures = marconi_figures(url)
    evicted = sum(figures[f"marconi_evictions_{k}"] - before[f"marconi_evictions_{k}"]
                  for k in ("stale", "window", "leaf", "fallback"))
    assert evicted > 0, f"no SWA eviction: no pressure ({figures})"
    # A hit cut short by a window that is not there: the full KV of 3 windows matched, but the
    # window before that point was freed as the first request slid past it; the hit stops where
    # a whole window is live (the end of that request's first prefill chunk, or nothing). The
    # exactness check below covers it.
    assert common_prefix(cut.input_ids, runs[0].input_ids) == 3 * SLIDING_WINDOW
    assert cut.cached_tokens in (0, CHUNK)
    # After the pressure the same cut again: the window at the chunk boundary is in no branch's
    # window (Marconi frees such stale windows first), so the hit is that point or nothing,
    # never the 3 windows of full KV the tree still holds.
    assert runs[-1].cached_tokens in (0, CHUNK)
    for i, g in enumerate(runs):  # a hit never exceeds what an earlier request shared
        shared_before = max((common_prefix(g.input_ids, e.input_ids) for e in runs[:i]), default=0)
        assert g.cached_tokens <= shared_before
    assert_warm_equals_cold(url, runs)
    # SGLang's own pool accounting (checked whenever the scheduler idles) found every full-KV and
    # SWA slot free, cached or held by a request: no page leaked by Marconi's tombstones.
    assert "leak detected" not in swa_server.log_path.read_text(errors="replace")


# Replies longer than a window: a finished request's leaf is then the window before its end. (A
# reply of a few tokens makes a leaf of those few tokens, whose FLOPs, counted from the branch
# point above, per byte of its tiny edge outrank any window: the rule's measure, not this test's.)
REPLY = 40


def _shared_prompt_after_flood(url) -> tuple[list, object]:
    """Three users continue a long shared prompt, then 20 short unrelated requests (more SWA KV
    than the pool holds) go through; returns every response and a new user's response on the
    shared prompt after the flood."""
    from http_api import flush_cache, generate

    flush_cache(url)
    shared = tokens(5, 4 * SLIDING_WINDOW)
    runs = [generate(url, shared + [20 + i] + tokens(800 + i, 100), max_new_tokens=REPLY) for i in range(3)]
    runs += [generate(url, tokens(900 + i, 40), max_new_tokens=REPLY) for i in range(20)]
    after = generate(url, shared + [70] + tokens(990, 10), max_new_tokens=6)
    return runs, after


def test_shared_prompt_survives_a_flood_that_upstream_loses_it_to(swa_server, upstream_swa_server):
    from http_api import marconi_figures

    shared = 4 * SLIDING_WINDOW
    before = marconi_figures(swa_server.url)
    # The two servers are independent: upstream's sequence runs beside ours.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        upstream_sequence = pool.submit(_shared_prompt_after_flood, upstream_swa_server.url)
        runs, after = _shared_prompt_after_flood(swa_server.url)
        up_runs, up_after = upstream_sequence.result()
    figures = marconi_figures(swa_server.url)
    evicted = sum(figures[f"marconi_evictions_{k}"] - before[f"marconi_evictions_{k}"]
                  for k in ("stale", "window", "leaf", "fallback"))
    assert evicted > 0, f"no SWA eviction: no pressure ({figures})"
    assert runs[2].cached_tokens == shared  # the branch point's window was in the tree before the flood
    # Ours: the shared prompt's window (FLOPs saved per byte: a long prefix for a few tokens of
    # SWA KV) outranks the flood's leaves, which go instead.
    assert after.cached_tokens == shared, [r.cached_tokens for r in runs + [after]]
    assert_warm_equals_cold(swa_server.url, runs + [after])
    # Upstream, the same sequence: its LRU walk frees the oldest SWA KV first, the shared
    # prompt's window among it, so the new user recomputes it (a hit at most up to a point
    # whose window some request left behind).
    assert up_runs[2].cached_tokens == shared
    assert up_after.cached_tokens < shared, [r.cached_tokens for r in up_runs + [up_after]]
    assert "leak detected" not in swa_server.log_path.read_text(errors="replace")
