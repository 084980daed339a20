"""OpenAI's cache hints through a real SGLang server on this CPU (one server, a tiny gated-delta
hybrid): `prompt_cache_key` / `prompt_cache_retention` are accepted on `/v1/chat/completions`,
`/v1/completions` and `/generate`, bad values are answered 400 with one line naming them, and a
keyed conversation keeps its prefix through unhinted traffic that evicts an unkeyed one of the
same shape (`policy/rules/cache_hints.py`, `serving/cache_hints.py`).

Why that is guaranteed here: the KV pool holds 1,000 tokens and a flood is 6 unhinted requests of
200 new tokens, more than the pool, so whatever ranks oldest goes. The rule credits only once
returning conversations are seen losing their prefix: 8 keyed short conversations whose second
turns come after a first flood (they lose it) open that gate. Then two keyed conversations and an
unkeyed one leave 200-token first turns; the keyed ends are credited (their charges, 2 x 204 tokens
plus the last gate conversation's, fit in half the pool) by the clock advance of every release so
far, which includes a flood of the same size as the second one, so they rank younger than every
leaf of the second flood, and the unkeyed end ranks older than all of them. With
`--marconi-hinted-share 0` (hints unused) the keyed conversations are evicted like the unkeyed one
and the test fails.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("sglang")

import requests  # noqa: E402

from http_api import TIMEOUT_S  # noqa: E402
from tiny_models import VOCAB_SIZE  # noqa: E402

POOL_TOKENS = 1000
FLAGS = ("--max-total-tokens", str(POOL_TOKENS), "--max-mamba-cache-size", "40", "--chunked-prefill-size", "512",
         "--marconi-alpha", "0", "--enable-cache-report")
TURN_TOKENS = 200
FLOOD_REQUESTS = 6
GATE_CONVERSATIONS = 8  # cache_hints._RETURNS_NEEDED


@pytest.fixture(scope="module")
def server(tiny_model, launch):
    return launch(tiny_model("gated-delta"), extra_args=FLAGS)


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=TIMEOUT_S)


def _generate(server, ids: list[int], **hints) -> tuple[list[int], int]:
    r = _post(server, "/generate", {"input_ids": ids, **hints, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["output_ids"], body["meta_info"]["cached_tokens"]


def _complete(server, ids: list[int], **hints) -> tuple[list[int], int]:
    r = _post(server, "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 4, "temperature": 0,
                                          "ignore_eos": True, "return_token_ids": True, **hints})
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    return body["choices"][0]["token_ids"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_hints_accepted_bad_values_refused_and_a_keyed_conversation_kept(server):
    rng = random.Random(7)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, VOCAB_SIZE) for _ in range(n)]

    # -- bad values: 400, one line naming the value ------------------------------------------------
    bad = [
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello"}],
                                  "max_tokens": 2, "prompt_cache_key": "c", "prompt_cache_retention": "48h"}, "'48h'"),
        ("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 2, "prompt_cache_key": 17}, "17"),
        ("/generate", {"input_ids": fresh(8), "prompt_cache_key": "c", "prompt_cache_retention": "forever",
                       "sampling_params": {"max_new_tokens": 2}}, "'forever'"),
    ]
    for path, body, named in bad:
        r = _post(server, path, body)
        assert r.status_code == 400, (path, r.status_code, r.text)
        text = r.json().get("message") or r.json().get("error")
        assert named in text and "\n" not in text, (path, text)

    # -- hints accepted on every route -----------------------------------------------------------------
    r = _post(server, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello"}],
                                               "max_tokens": 2, "prompt_cache_key": "chat-1",
                                               "prompt_cache_retention": "24h"})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/completions", {"model": "m", "prompt": "hello world", "max_tokens": 2,
                                          "prompt_cache_key": "completion-1", "prompt_cache_retention": "in-memory"})
    assert r.status_code == 200, r.text

    def flood():
        for _ in range(FLOOD_REQUESTS):
            _generate(server, fresh(TURN_TOKENS))

    # -- keyed conversations that lose their prefix: the evidence the rule waits for ------------------
    gate = [fresh(16) for _ in range(GATE_CONVERSATIONS)]
    gate = [ids + _generate(server, ids, prompt_cache_key=f"gate-{i}")[0] for i, ids in enumerate(gate)]
    flood()
    for i, ids in enumerate(gate):
        assert _generate(server, ids + fresh(16), prompt_cache_key=f"gate-{i}")[1] < len(ids)

    # -- three conversations, then a flood that fills the pool twice over -----------------------------
    first = {name: fresh(TURN_TOKENS) for name in ("keyed-openai", "keyed-generate", "unkeyed")}
    out = {
        "keyed-openai": _complete(server, first["keyed-openai"], prompt_cache_key="conv-openai")[0],
        "keyed-generate": _generate(server, first["keyed-generate"], prompt_cache_key="conv-generate",
                                    prompt_cache_retention="24h")[0],
        "unkeyed": _generate(server, first["unkeyed"])[0],
    }
    flood()

    second = {name: first[name] + out[name] + fresh(16) for name in first}
    cached = {
        "unkeyed": _generate(server, second["unkeyed"])[1],
        "keyed-openai": _complete(server, second["keyed-openai"], prompt_cache_key="conv-openai")[1],
        "keyed-generate": _generate(server, second["keyed-generate"], prompt_cache_key="conv-generate")[1],
    }
    assert cached["unkeyed"] < TURN_TOKENS, cached  # the flood evicted what no hint kept
    assert cached["keyed-openai"] >= TURN_TOKENS, cached
    assert cached["keyed-generate"] >= TURN_TOKENS, cached
