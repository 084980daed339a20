"""The served route of OpenAI's cache hints without a server (`serving/cache_hints.py`): the ASGI
intake on a stand-in app, the envelope SGLang decodes, and the hint the scheduler reads back."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("sglang")

from sglang_marconi.policy.rules.cache_hints import CacheHint  # noqa: E402
from sglang_marconi.serving import cache_hints  # noqa: E402
from sglang_marconi.serving.cache_hints import PromptCacheHintIntake, hint_of, with_hint_action  # noqa: E402


class App:
    """An ASGI app that records what reached it."""

    def __init__(self):
        self.seen = None

    async def __call__(self, scope, receive, send):
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.seen = (scope, b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _call(path: str, body, method: str = "POST", parts: int = 1):
    app = App()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    size = -(-len(raw) // parts)
    messages = [{"type": "http.request", "body": raw[i * size:(i + 1) * size], "more_body": i < parts - 1}
                for i in range(parts)]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-length", str(len(raw)).encode())]}
    asyncio.run(PromptCacheHintIntake(app)(scope, receive, send))
    status = sent[0]["status"]
    return app, status, b"".join(m.get("body", b"") for m in sent[1:])


def test_generate_gets_the_hint_as_a_kv_hints_action_sglang_decodes():
    from sglang.srt.managers.io_struct import GenerateReqInput

    app, status, _ = _call("/generate", {"input_ids": [1, 2, 3], "prompt_cache_key": "conv-9",
                                         "prompt_cache_retention": "24h"}, parts=3)
    assert status == 200
    scope, body = app.seen
    obj = json.loads(body)
    assert "prompt_cache_key" not in obj and "prompt_cache_retention" not in obj
    assert dict(scope["headers"])[b"content-length"] == str(len(body)).encode()
    req = GenerateReqInput(input_ids=[1, 2, 3], kv_hints=obj["kv_hints"])
    req.normalize_batch_and_arguments()

    class Req:
        kv_hints = req.kv_hints

    assert hint_of(Req) == CacheHint("conv-9", "24h")


def test_openai_routes_carry_the_hint_in_the_scope_and_bodies_without_hints_pass_untouched():
    app, status, _ = _call("/v1/chat/completions", {"messages": [], "prompt_cache_key": "k"})
    scope, body = app.seen
    assert status == 200 and "prompt_cache_key" not in json.loads(body)
    assert scope["state"][cache_hints._SCOPE_STATE_NAME] == CacheHint("k", "in-memory")
    for path, raw in (("/v1/completions", b'{"prompt": "say prompt_cache_ twice"}'), ("/health", b"x"),
                      ("/generate", b"not json prompt_cache_key")):
        app, status, _ = _call(path, raw)
        assert status == 200 and app.seen[1] == raw and "state" not in app.seen[0]


@pytest.mark.parametrize("path, body, named", [
    ("/generate", {"prompt_cache_key": "k", "prompt_cache_retention": "1w"}, "'1w'"),
    ("/v1/completions", {"prompt_cache_key": ["a"]}, "['a']"),
    ("/v1/chat/completions", {"prompt_cache_retention": "24h"}, "without a prompt_cache_key"),
])
def test_a_bad_value_is_answered_400_in_one_line_naming_it(path, body, named):
    app, status, payload = _call(path, body)
    assert status == 400 and app.seen is None
    message = json.loads(payload)
    text = message["error"] if path == "/generate" else message["message"]
    assert named in text and "\n" not in text


def test_the_action_joins_an_envelope_the_client_sent():
    envelope = {"protocol_version": "1", "message_id": "m", "actions": [
        {"action_id": "x", "action_type": "storage.prefetch", "action_version": "1", "payload": {}}]}
    merged = with_hint_action(envelope, CacheHint("k"))
    assert [a["action_type"] for a in merged["actions"]] == ["storage.prefetch", cache_hints.ACTION_TYPE]
    batch = with_hint_action([None, envelope], CacheHint("k"))
    assert len(batch) == 2 and all(a["actions"][-1]["action_type"] == cache_hints.ACTION_TYPE for a in batch)


def test_a_request_whose_action_carries_a_bad_payload_is_served_unhinted():
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    class Req:
        kv_hints = decode_kv_hints_envelope({"protocol_version": "1", "message_id": "", "actions": [
            {"action_id": "p", "action_type": cache_hints.ACTION_TYPE, "action_version": "1",
             "payload": {"prompt_cache_key": "k", "prompt_cache_retention": "never"}}]})

    assert hint_of(Req) is None
    assert hint_of(object()) is None
