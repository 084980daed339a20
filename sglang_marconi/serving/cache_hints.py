"""Client cache hints on the server: OpenAI's `prompt_cache_key` / `prompt_cache_retention` from the
HTTP request to the scheduler's `Req`, and the rule (`policy/rules/cache_hints.py`) applied to
SGLang's tree at each release. SGLang 0.5.23's request models drop both fields; no SGLang file is
changed to carry them.

The route:
1. Intake, in the HTTP server process: an ASGI middleware on SGLang's FastAPI app
   (`PromptCacheHintIntake`, added as `sglang.srt.entrypoints.http_server` is imported) reads the
   JSON body of POST `/generate`, `/v1/chat/completions` and `/v1/completions` when it mentions
   `prompt_cache_`, checks the two fields (HTTP 400, one line naming the bad value), removes them
   and passes the hint on as one action of SGLang's per-request KV-hint envelope (`kv_hints`,
   which SGLang carries untouched to the scheduler's `Req.kv_hints`; consumers ignore action types
   they do not implement): for `/generate` in the body's own `kv_hints`; for the OpenAI routes,
   whose request models have no `kv_hints`, through the ASGI scope's state to the
   `GenerateReqInput` that `_convert_to_internal_request` builds. A body without the fields goes
   through untouched.
2. The scheduler: `MarconiUnifiedRadixCache.on_release` hands every finished request to
   `ServedHints.on_release`: the ledger records SGLang's time counter, and a hinted request's
   credit goes to `req.last_node`, the node its final insert ended on (its KV recency,
   `last_access_time`, and its state's, `_marconi_state_time`), with the index told of both.
   Clients may also send the action in `kv_hints` themselves on `/generate`.

Rank-invariant: the hint rides the request to every rank, the ledger is a function of the
release stream and of SGLang's counter (identical on every rank). A rank that fell back to
upstream (`faults.py`) applies no credit. Imports SGLang lazily.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import logging
import sys

from sglang_marconi.policy.rules.cache_hints import (
    DEFAULT_HINTED_SHARE, CacheHint, HintError, HintLedger, parse_hint,
)

log = logging.getLogger("sglang_marconi")

KEY_FIELD, RETENTION_FIELD = "prompt_cache_key", "prompt_cache_retention"
ACTION_TYPE = "sglang_marconi.prompt_cache"
ACTION_VERSION = "1"
GENERATE_PATH = "/generate"
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")
_SCOPE_STATE_NAME = "marconi_prompt_cache_hint"
_HTTP_SERVER = "sglang.srt.entrypoints.http_server"
_COUNTER_MODULE = "sglang.srt.mem_cache.unified_cache.components.base"
_MARKER = "_marconi_cache_hints"


# -- the envelope ------------------------------------------------------------------------------------
def hint_action(hint: CacheHint) -> dict:
    return {"action_id": "prompt_cache", "action_type": ACTION_TYPE, "action_version": ACTION_VERSION,
            "payload": {KEY_FIELD: hint.key, RETENTION_FIELD: hint.retention}}


def with_hint_action(kv_hints, hint: CacheHint):
    """`kv_hints` (None, one envelope, or a batch's list of them) with the hint's action added."""
    if isinstance(kv_hints, list):
        return [with_hint_action(one, hint) for one in kv_hints]
    if kv_hints is None:
        return {"protocol_version": "1", "message_id": "", "actions": [hint_action(hint)]}
    if isinstance(kv_hints, dict):
        return {**kv_hints, "actions": [*(kv_hints.get("actions") or []), hint_action(hint)]}
    import msgspec  # an envelope SGLang already decoded

    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    envelope = msgspec.to_builtins(kv_hints)
    return decode_kv_hints_envelope({**envelope, "actions": [*envelope.get("actions", []), hint_action(hint)]})


def hint_of(req) -> CacheHint | None:
    """The hint a scheduler `Req` carries, or None (no envelope, no action of ours, or a payload the
    rule cannot take: such a request is served unhinted)."""
    envelope = getattr(req, "kv_hints", None)
    for action in getattr(envelope, "actions", None) or ():
        if getattr(action, "action_type", None) == ACTION_TYPE:
            payload = action.payload if isinstance(action.payload, dict) else {}
            try:
                return parse_hint(payload.get(KEY_FIELD), payload.get(RETENTION_FIELD))
            except HintError:
                return None
    return None


# -- intake (HTTP server process) --------------------------------------------------------------------
def take_hint(body: dict) -> CacheHint | None:
    """Remove the two fields from a request body and return its hint (HintError if invalid)."""
    return parse_hint(body.pop(KEY_FIELD, None), body.pop(RETENTION_FIELD, None))


class PromptCacheHintIntake:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path")
        if scope.get("type") != "http" or scope.get("method") != "POST" or (
                path != GENERATE_PATH and path not in OPENAI_PATHS):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return await self.app(scope, _replay([b"".join(chunks)], receive, message), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if b"prompt_cache_" in body:
            try:
                obj = json.loads(body)
            except ValueError:
                obj = None  # SGLang reports a body it cannot parse
            if isinstance(obj, dict) and (KEY_FIELD in obj or RETENTION_FIELD in obj):
                try:
                    hint = take_hint(obj)
                except HintError as exc:
                    return await _bad_request(send, path, str(exc))
                if hint is not None:
                    if path == GENERATE_PATH:
                        obj["kv_hints"] = with_hint_action(obj.get("kv_hints"), hint)
                    else:
                        scope.setdefault("state", {})[_SCOPE_STATE_NAME] = hint
                body = json.dumps(obj).encode()
                scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
                         + [(b"content-length", str(len(body)).encode())]}
        return await self.app(scope, _replay([body], receive), send)


def _replay(bodies: list[bytes], receive, then=None):
    pending = list(bodies)

    async def replayed():
        if pending:
            return {"type": "http.request", "body": pending.pop(0), "more_body": False}
        if then is not None:
            return then
        return await receive()

    return replayed


async def _bad_request(send, path: str, message: str) -> None:
    if path == GENERATE_PATH:  # SGLang's /generate error body
        content = {"error": message}
    else:  # OpenAI's error object, as SGLang's OpenAI routes answer
        content = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _attach_to_internal_request(convert):
    """`_convert_to_internal_request` of an OpenAI route, with the intake's hint put on the
    `GenerateReqInput` it builds."""

    @functools.wraps(convert)
    def convert_with_hint(self, request, raw_request=None, *args, **kwargs):
        adapted, processed = convert(self, request, raw_request, *args, **kwargs)
        scope = getattr(raw_request, "scope", None)
        hint = (scope.get("state") or {}).get(_SCOPE_STATE_NAME) if isinstance(scope, dict) else None
        if hint is not None and hasattr(adapted, "kv_hints"):
            adapted.kv_hints = with_hint_action(adapted.kv_hints, hint)
        return adapted, processed

    setattr(convert_with_hint, _MARKER, True)
    return convert_with_hint


def install_intake(http_server) -> None:
    """Add the middleware to SGLang's app and the hint to the OpenAI routes' conversion (once)."""
    app = http_server.app
    if getattr(app, _MARKER, False):
        return
    app.add_middleware(PromptCacheHintIntake)
    setattr(app, _MARKER, True)
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

    for cls in (OpenAIServingChat, OpenAIServingCompletion):
        convert = cls.__dict__["_convert_to_internal_request"]
        if not getattr(convert, _MARKER, False):
            cls._convert_to_internal_request = _attach_to_internal_request(convert)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once `name` has been imported (the HTTP server process only imports it)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader, then):
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            self.then(module)
        except Exception as exc:  # noqa: BLE001 - the server runs without hints rather than not at all
            log.warning("Marconi: prompt_cache_key / prompt_cache_retention not read (%s: %s)",
                        type(exc).__name__, exc)


def register_intake() -> None:
    """Install the intake now if SGLang's HTTP server module is loaded, else as it is imported."""
    module = sys.modules.get(_HTTP_SERVER)
    if module is not None:
        install_intake(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_HTTP_SERVER, install_intake))


# -- the scheduler -----------------------------------------------------------------------------------
def sglang_clock() -> float:
    """SGLang's recency counter now (the next value `get_and_increase_time_counter` hands out)."""
    return float(sys.modules[_COUNTER_MODULE]._LAST_ACCESS_TIME_COUNTER_FLOAT)


class SGLangNodeStamps:
    """SGLang's tree nodes as the rule sees them (`HintAdapter`)."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def _index(self):
        return self.cache.marconi.index

    @staticmethod
    def stamps(node) -> tuple[float, float]:
        from sglang_marconi.serving.tree_index import state_time

        return float(node.last_access_time), float(state_time(node))

    def set_stamps(self, node, kv: float, state: float) -> None:
        from sglang_marconi.serving.tree_index import record_state_use

        node.last_access_time = kv
        if getattr(node, "_marconi_state_time", None) is not None:
            record_state_use(node, state)
        index = self._index
        if index is not None:
            index.stamp(node)
            index.state_used(node)
            index.touched(node)

    def alive(self, node) -> bool:
        return self.cache.tree_core._node_arena.get(node.id) is node


class ServedHints:
    """The ledger of one served cache (`cache.marconi.hints`)."""

    def __init__(self, cache, pools, *, share: float = DEFAULT_HINTED_SHARE, horizon: int | None = None):
        self.adapter = SGLangNodeStamps(cache)
        self.ledger = HintLedger(self.adapter, pools[0], pools[1], share=share, horizon=horizon)
        self.broken: str | None = None

    def on_release(self, cache, req) -> None:
        """A finished request released into the tree."""
        if self.broken is not None or cache.marconi.faults.fallen_back is not None:
            return
        try:
            hint = hint_of(req)
            if hint is None:
                self.ledger.release(sglang_clock())
                return
            node = self._end_node(cache, req)
            end = 0 if node is None else self._end(node)
            has_state = node is not None and self._has_state(cache, node)
            self.ledger.release(sglang_clock(), hint, node, end, int(has_state),
                                hit=int(getattr(req, "cached_tokens", 0) or 0), end=end)
        except Exception as exc:  # noqa: BLE001 - hints stop; the tree is SGLang's and unharmed
            self.broken = f"{type(exc).__name__}: {exc}"
            log.warning("Marconi: cache hints stop on this cache (%s)", self.broken)
            faults = cache.marconi.faults
            if faults.group_size > 1:
                # stamps this release already moved may differ from the other ranks': the group stops
                faults.unrecoverable("cache hints", exc)

    @staticmethod
    def _end_node(cache, req):
        node_id = getattr(req, "last_node", None)
        node = cache.tree_core._node_arena.get(node_id) if node_id is not None else None
        return None if node is None or node is cache.tree_core.root_node else node

    @staticmethod
    def _end(node) -> int:
        from sglang_marconi.serving.tree_index import node_end

        return int(node_end(node))

    @staticmethod
    def _has_state(cache, node) -> bool:
        return node.component_data[cache.marconi.index._mamba_type].value is not None


def attach_hints(cache, config) -> ServedHints | None:
    """Give a Marconi-built cache its hint ledger, unless `--marconi-hinted-share 0`."""
    share = getattr(config, "hinted_share", DEFAULT_HINTED_SHARE)
    if not share:
        return None
    allocator = cache.token_to_kv_pool_allocator
    mamba_pool = getattr(cache.req_to_token_pool, "mamba_pool", None)
    pools = (int(allocator.size), None if mamba_pool is None else int(mamba_pool.size))
    hints = ServedHints(cache, pools, share=share, horizon=getattr(config, "hint_horizon", None))
    cache.marconi.hints = hints
    return hints
