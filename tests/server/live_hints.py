"""OpenAI's cache hints through a real SGLang server on this CPU, run on a server another module
already starts (`test_live_server.py`'s gated-delta no_buffer server of our launcher: 8192 KV
tokens, 24 Mamba slots, 128-token prefill chunks, the default `--marconi-alpha auto`), as that
server's first test: `prompt_cache_key` / `prompt_cache_retention` are accepted on
`/v1/chat/completions`, `/v1/completions` and `/generate`, bad values are answered 400 with one line
naming them, and a keyed conversation keeps its prefix through unhinted traffic that evicts an
unkeyed one (`policy/rules/cache_hints.py`, `serving/cache_hints.py`).

Why that is guaranteed there:
- The rule credits only once returning conversations are seen losing their prefix: 8 keyed
  conversations (one batched call) whose second turns come after a cache flush lose it and open
  that gate (the evidence is the stream's; the flush does not forget it).
- After another flush, three short conversations, two keyed and one not, then a flood of 3
  unhinted requests of 2,800 tokens: more than the KV pool, so the flood evicts by rank, and few
  requests hold states (at most 12 of the 24 slots): no Mamba pressure, under which probationary
  states go first in admission order whatever their recency.
- The tuner keeps LRU on this stream from a fresh server (its shadows see no gain in leaving it;
  a late verdict only delays a switch), so the rank is recency: the unkeyed end, older than the
  flood, goes first. The keyed ends were credited (their few tokens and 2 states, within half of
  each pool) by the clock advance of every release before them, the gate's 16 turns, which is
  far more than the flood and the two requests after the first keyed one advance it (measured on
  SGLang's cache on CPU: about 200 ticks against 30 plus 14), so they rank younger than every
  flood leaf and outlive it.
With `--marconi-hinted-share 0` (hints unused) the keyed conversations are evicted like the unkeyed
one; without the intake the bad values are served: either way this fails.
"""

from __future__ import annotations

import random

import requests

from http_api import TIMEOUT_S, marconi_figures
from tiny_models import VOCAB_SIZE

TURN_TOKENS = 48  # a conversation's first turn
FLOOD_TOKENS, FLOOD_REQUESTS = 2800, 3  # more than the KV pool (8192), in few requests
GATE_CONVERSATIONS = 8  # cache_hints._RETURNS_NEEDED


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=TIMEOUT_S)


def _generate(server, ids: list[int], **hints) -> tuple[list[int], int]:
    r = _post(server, "/generate", {"input_ids": ids, **hints, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["output_ids"], body["meta_info"]["cached_tokens"]


def _complete(server, ids: list[int], **hints) -> tuple[list[int], int]:
    """Through `/v1/completions`; the hit as the server counted it (the responses' cached_tokens
    summed in /server_info: the usage reports it only with --enable-cache-report)."""
    before = marconi_figures(server.url)["marconi_hit_tokens"]
    r = _post(server, "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 4, "temperature": 0,
                                          "ignore_eos": True, "return_token_ids": True, **hints})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], marconi_figures(server.url)["marconi_hit_tokens"] - before


def _generate_batch(server, batch: list[list[int]], keys: list[str]) -> list[tuple[list[int], int]]:
    """One batched `/generate`, each request with its key in SGLang's `kv_hints` envelope (the action
    the intake makes of `prompt_cache_key`, which clients may also send themselves)."""
    from sglang_marconi.policy.rules.cache_hints import CacheHint
    from sglang_marconi.serving.cache_hints import with_hint_action

    r = _post(server, "/generate", {"input_ids": batch, "kv_hints": [with_hint_action(None, CacheHint(k)) for k in keys],
                                    "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return [(b["output_ids"], b["meta_info"]["cached_tokens"]) for b in r.json()]


def check_hints(server) -> None:
    """The whole check; it flushes the cache before its conversations and after them."""
    from http_api import flush_cache

    rng = random.Random(7)

    def fresh(n: int = TURN_TOKENS) -> list[int]:
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

    # -- hints accepted on the chat route (completions and /generate below) ---------------------------
    r = _post(server, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello"}],
                                               "max_tokens": 2, "prompt_cache_key": "chat-1",
                                               "prompt_cache_retention": "24h"})
    assert r.status_code == 200, r.text

    # -- keyed conversations that lose their prefix: the evidence the rule waits for ------------------
    flush_cache(server.url)
    keys = [f"gate-{i}" for i in range(GATE_CONVERSATIONS)]
    gate = [fresh() for _ in keys]
    gate = [ids + out for ids, (out, _) in zip(gate, _generate_batch(server, gate, keys))]
    flush_cache(server.url)
    returns = _generate_batch(server, [ids + fresh(16) for ids in gate], keys)
    assert all(cached < len(ids) for ids, (_, cached) in zip(gate, returns)), [c for _, c in returns]
    flush_cache(server.url)

    # -- three conversations, then a flood larger than the KV pool --------------------------------------
    first = {name: fresh() for name in ("keyed-openai", "keyed-generate", "unkeyed")}
    out = {
        "keyed-openai": _complete(server, first["keyed-openai"], prompt_cache_key="conv-openai")[0],
        "keyed-generate": _generate(server, first["keyed-generate"], prompt_cache_key="conv-generate",
                                    prompt_cache_retention="24h")[0],
        "unkeyed": _generate(server, first["unkeyed"])[0],
    }
    for _ in range(FLOOD_REQUESTS):
        _generate(server, fresh(FLOOD_TOKENS))

    second = {name: first[name] + out[name] + fresh(16) for name in first}
    cached = {
        "unkeyed": _generate(server, second["unkeyed"])[1],
        "keyed-openai": _complete(server, second["keyed-openai"], prompt_cache_key="conv-openai")[1],
        "keyed-generate": _generate(server, second["keyed-generate"], prompt_cache_key="conv-generate")[1],
    }
    flush_cache(server.url)
    assert cached["unkeyed"] < TURN_TOKENS, cached  # the flood evicted what no hint kept
    assert cached["keyed-openai"] >= TURN_TOKENS, cached
    assert cached["keyed-generate"] >= TURN_TOKENS, cached
