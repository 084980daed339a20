"""Trace files: loading (Mooncake and the Marconi authors' JSONL), saving, and CLI workload specs.

Formats, detected from the fields of the first non-empty line:

* Mooncake: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one id per
  512-token block). Tokens are rebuilt by `mooncake_tokens.MooncakeTokenizer`: block id h
  expands to tokens h*512 + arange(512), the last block cut so the input has exactly
  `input_length` tokens, and (mode "conversation", the default) a request that continues an
  earlier turn starts its new blocks with that turn's partial tail and output. Output tokens are 2**40 + i*2**20 + arange(n)
  for the i-th request (arrival order), so they never collide with any input token.
  The trace has no session ids: block 0 is a system prompt shared by every request of the
  conversation trace (12,031 of 12,031), so the session is named after the first private block,
  str(hash_ids[1]) (hash_ids[0] for one-block inputs); turn = number of earlier requests of that
  session. On the conversation trace this gives 7,373 sessions: 5,114 single-request, 1,311 of
  two, the longest 43; 3,947 of the 4,658 follow-up requests extend their predecessor's blocks.
* Authors' format: `session_id`, `turn_id`, `ts` (s), `input_tokens` (list of ints),
  `output_tokens` (list of ints, or an int count expanded to unique tokens as above).

Either format may carry OpenAI's cache hints per request: optional fields `prompt_cache_key` (a
string) and `prompt_cache_retention` (`in-memory` or `24h`), checked as the server checks them
(`policy/rules/cache_hints.py`) and replayed by `sim/hinted.py`.

Only the small per-request fields stay in memory; tokens are rebuilt on each iteration (the
authors' format re-reads its lines). Requests are replayed in arrival order (stable sort).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from sglang_marconi.policy.errors import MarconiError, TraceError
from sglang_marconi.policy.rules.cache_hints import HintError, parse_hint
from sglang_marconi.sim.mooncake_tokens import MODES as MOONCAKE_TOKEN_MODES
from sglang_marconi.sim.mooncake_tokens import MooncakeTokenizer
from sglang_marconi.sim.units import parse_params
from sglang_marconi.sim.workload import Request, Workload

DEFAULT_WORKLOAD = "synthetic:swe-agent"  # the embedded workload the CLIs run when given none

BLOCK = 512
OUTPUT_BASE = 2**40  # every output token is >= this; every expanded input token is below it
OUTPUT_STRIDE = 2**20  # output tokens of request i: OUTPUT_BASE + i*OUTPUT_STRIDE + arange(n)
_MAX_HASH_ID = OUTPUT_BASE // BLOCK

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
AUTHORS_FIELDS = ("session_id", "turn_id", "ts", "input_tokens", "output_tokens")
HINT_FIELDS = ("prompt_cache_key", "prompt_cache_retention")  # optional in either format


def output_tokens_for(index: int, count: int) -> np.ndarray:
    """Deterministic output tokens of request `index`, disjoint from all expanded input tokens."""
    return OUTPUT_BASE + index * OUTPUT_STRIDE + np.arange(count, dtype=np.int64)


# ---------------------------------------------------------------- field validation


class _Line:
    """Where a record came from, for error messages."""

    def __init__(self, path: Path, lineno: int):
        self.path, self.lineno = path, lineno

    def error(self, what: str) -> TraceError:
        return TraceError(f"{self.path}:{self.lineno}: {what}")

    def parse(self, raw: bytes | str) -> dict[str, Any]:
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self.error(f"bad JSON ({e})") from None
        if not isinstance(obj, dict):
            raise self.error(f"expected a JSON object, got {type(obj).__name__}")
        return obj

    def field(self, obj: dict, name: str) -> Any:
        if name not in obj:
            raise self.error(f"missing field {name!r} (fields: {sorted(obj)})")
        return obj[name]

    def int_field(self, obj: dict, name: str, minimum: int = 0) -> int:
        v = self.field(obj, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(f"field {name!r} must be an integer, got {v!r}")
        if v < minimum:
            if v == 0 and name == "input_length":
                raise self.error("empty input: field 'input_length' is 0")
            raise self.error(f"field {name!r} must be >= {minimum}, got {v}")
        return v

    def number_field(self, obj: dict, name: str) -> float:
        v = self.field(obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(f"field {name!r} must be a finite number, got {v!r}")
        return float(v)

    def hint(self, obj: dict) -> tuple[str | None, str | None]:
        """The record's cache hint fields (both None without a hint), as a client sent them."""
        key, retention = obj.get(HINT_FIELDS[0]), obj.get(HINT_FIELDS[1])
        try:
            hint = parse_hint(key, retention)
        except HintError as e:
            raise self.error(str(e)) from None
        return (None, None) if hint is None else (hint.key, hint.retention)

    def int_list(self, obj: dict, name: str, upper: int | None = None) -> np.ndarray:
        v = self.field(obj, name)
        if not isinstance(v, list):
            raise self.error(f"field {name!r} must be a list of integers, got {type(v).__name__}")
        if any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            bad = next(x for x in v if isinstance(x, bool) or not isinstance(x, int))
            raise self.error(f"field {name!r} must hold only integers, found {bad!r}")
        try:
            arr = np.array(v, dtype=np.int64)
        except OverflowError:
            raise self.error(f"field {name!r} has an integer outside int64") from None
        if arr.size and arr.min() < 0:
            raise self.error(f"field {name!r} has a negative value {int(arr.min())}")
        if upper is not None and arr.size and arr.max() >= upper:
            raise self.error(f"field {name!r} has a value {int(arr.max())} >= {upper}")
        return arr


# ---------------------------------------------------------------- reading lines


def _lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(1-based line number, byte offset, stripped content) of every non-empty line."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            stripped = raw.strip()
            if stripped:
                yield lineno, offset, stripped
            offset += len(raw)


def _check_file(path: Path) -> None:
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    if not path.is_file():
        raise TraceError(f"{path}: not a regular file")


# ---------------------------------------------------------------- Mooncake


class MooncakeTrace(Workload):
    """A Mooncake trace; hash ids stay in memory (small), tokens are rebuilt per iteration
    (`tokens`: a `MooncakeTokenizer` mode)."""

    def __init__(self, path: Path, records: list[tuple[float, int, int, np.ndarray]], tokens: str = "conversation",
                 hints: list[tuple[str | None, str | None]] | None = None):
        if tokens not in MOONCAKE_TOKEN_MODES:
            raise MarconiError(f"Mooncake token mode {tokens!r}: expected one of {list(MOONCAKE_TOKEN_MODES)}")
        self.name, self.path, self.tokens = path.stem, path, tokens
        order = sorted(range(len(records)), key=lambda i: records[i][0])
        self._records = [records[i] for i in order]
        # (prompt_cache_key, prompt_cache_retention) per record, in arrival order; None: no hints at all
        self._hints = None if hints is None or not any(k for k, _ in hints) else [hints[i] for i in order]
        self._sessions = [_mooncake_session(r[3]) for r in self._records]
        self._turns, seen = [], {}
        for s in self._sessions:
            self._turns.append(seen.get(s, 0))
            seen[s] = self._turns[-1] + 1

    def __len__(self) -> int:
        return len(self._records)

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def request_lengths(self) -> np.ndarray:
        return np.array([(in_len, out_len) for _, in_len, out_len, _ in self._records], dtype=np.int64).reshape(-1, 2)

    def block_hashes(self) -> tuple[int, list[tuple[list[int], int]]]:
        """The trace's own hash ids and input lengths, whatever `tokens` mode rebuilds tokens."""
        return BLOCK, [(ids.tolist(), in_len) for _, in_len, _, ids in self._records]

    def __iter__(self) -> Iterator[Request]:
        return self.scaled(BLOCK)

    def subset(self, keep, name: str) -> MooncakeTrace:
        """The requests that `keep(index in arrival order, session)` accepts, as a trace of their
        own named `name`: tokens are rebuilt from its requests only (a turn whose predecessor
        was left out does not continue it)."""
        kept = [i for i, s in enumerate(self._sessions) if keep(i, s)]
        sub = MooncakeTrace(self.path, [self._records[i] for i in kept], self.tokens,
                            None if self._hints is None else [self._hints[i] for i in kept])
        sub.name = name
        return sub

    def scaled(self, block_tokens: int, limit: int | None = None) -> Iterator[Request]:
        """The requests (the first `limit`) with each 512-token hash block mapped to
        `block_tokens` tokens: input and output lengths scaled by block_tokens/512 (input: ceil, so
        a partial last block keeps >= 1 token; output: round, at least 1). For replays on small
        machines; `block_tokens=512` is the trace as it is."""
        scale = block_tokens / BLOCK
        tokenizer = MooncakeTokenizer(self.tokens, block_tokens)
        for i, (ts, in_len, out_len, ids) in enumerate(self._records[:limit]):
            if block_tokens != BLOCK:
                in_len, out_len = math.ceil(in_len * scale), max(1, round(out_len * scale))
            outputs = output_tokens_for(i, out_len)
            key, retention = (None, None) if self._hints is None else self._hints[i]
            yield Request(
                session_id=self._sessions[i],
                turn=self._turns[i],
                arrival_s=ts / 1000.0,
                input_tokens=tokenizer.input_tokens(ids, in_len, outputs),
                output_tokens=outputs,
                prompt_cache_key=key,
                prompt_cache_retention=retention,
            )


def _mooncake_session(hash_ids: np.ndarray) -> str:
    return str(int(hash_ids[1] if hash_ids.size > 1 else hash_ids[0]))


def _mooncake_record(line: _Line, obj: dict) -> tuple[float, int, int, np.ndarray]:
    ts = line.number_field(obj, "timestamp")
    in_len = line.int_field(obj, "input_length", minimum=1)
    out_len = line.int_field(obj, "output_length", minimum=0)
    if out_len >= OUTPUT_STRIDE:
        raise line.error(f"field 'output_length' {out_len} is too large (max {OUTPUT_STRIDE - 1})")
    ids = line.int_list(obj, "hash_ids", upper=_MAX_HASH_ID)
    if ids.size != -(-in_len // BLOCK):
        raise line.error(
            f"{ids.size} hash_ids for input_length {in_len}: expected "
            f"ceil({in_len}/{BLOCK}) = {-(-in_len // BLOCK)}"
        )
    return ts, in_len, out_len, ids


# ---------------------------------------------------------------- authors' format


class JsonlTrace(Workload):
    """A trace in the authors' format; each iteration re-reads the file line by line."""

    def __init__(self, path: Path, index: list[tuple[float, int, int, str]]):
        # index: (ts, byte offset, line number, session id) per record
        self.name, self.path = path.stem, path
        self._index = sorted(index, key=lambda r: r[0])

    def __len__(self) -> int:
        return len(self._index)

    def session_ids(self) -> list[str]:
        return [r[3] for r in self._index]

    def __iter__(self) -> Iterator[Request]:
        with open(self.path, "rb") as f:
            for i, (_, offset, lineno, _) in enumerate(self._index):
                f.seek(offset)
                yield _authors_request(_Line(self.path, lineno), f.readline(), i)


def _authors_request(line: _Line, raw: bytes, index: int) -> Request:
    obj = line.parse(raw)
    session = line.field(obj, "session_id")
    if isinstance(session, bool) or not isinstance(session, (str, int)):
        raise line.error(f"field 'session_id' must be a string or integer, got {session!r}")
    turn = line.int_field(obj, "turn_id")
    ts = line.number_field(obj, "ts")
    inputs = line.int_list(obj, "input_tokens")
    if inputs.size == 0:
        raise line.error("empty input: field 'input_tokens' is []")
    out = line.field(obj, "output_tokens")
    if isinstance(out, int) and not isinstance(out, bool):
        outputs = output_tokens_for(index, line.int_field(obj, "output_tokens"))
    else:
        outputs = line.int_list(obj, "output_tokens")
    key, retention = line.hint(obj)
    return Request(str(session), turn, ts, inputs, outputs, key, retention)


# ---------------------------------------------------------------- entry points


def load_trace(path: str | Path, mooncake_tokens: str = "conversation") -> Workload:
    """Load a Mooncake or authors'-format JSONL trace; malformed input raises TraceError.
    `mooncake_tokens`: how a Mooncake trace's block ids become tokens (`MooncakeTokenizer`)."""
    path = Path(path)
    _check_file(path)
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise TraceError(f"{path}: empty trace file (no non-empty lines)")
    obj = _Line(path, first[0]).parse(first[2])
    keys = set(obj)
    if keys >= set(MOONCAKE_FIELDS):
        records, hints = [], []
        for lineno, _, raw in [first, *lines]:
            line = _Line(path, lineno)
            obj = line.parse(raw)
            records.append(_mooncake_record(line, obj))
            hints.append(line.hint(obj))
        return MooncakeTrace(path, records, mooncake_tokens, hints)
    if keys >= set(AUTHORS_FIELDS):
        index = []
        for lineno, offset, raw in [first, *lines]:
            req = _authors_request(_Line(path, lineno), raw, len(index))
            index.append((req.arrival_s, offset, lineno, req.session_id))
        return JsonlTrace(path, index)
    raise TraceError(
        f"{path}:{first[0]}: unknown trace format, fields seen: {sorted(keys)}; expected "
        f"Mooncake {list(MOONCAKE_FIELDS)} or authors' {list(AUTHORS_FIELDS)}"
    )


def save_trace(workload: Workload, path: str | Path) -> Path:
    """Write `workload` in the authors' JSONL format (token lists written out in full)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in workload:
            rec = {
                "session_id": r.session_id,
                "turn_id": r.turn,
                "ts": r.arrival_s,
                "input_tokens": r.input_tokens.tolist(),
                "output_tokens": r.output_tokens.tolist(),
            }
            if r.prompt_cache_key is not None:
                rec["prompt_cache_key"] = r.prompt_cache_key
                rec["prompt_cache_retention"] = r.prompt_cache_retention
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return path


_SYNTHETIC_PARAMS = {
    "seed": int,
    "sessions": int,
    "session_rate": float,
    "turn_gap_s": float,
    "vocab": int,
    "scale": float,
}


# `stress:KIND[:key=value,...]`: the generators of `sim/stress.py` and the parameters each takes
_STRESS_PARAMS = {
    "chain-fanout": {"n": int, "chunk": int, "output_tokens": int, "seed": int},
    "agent-backtrack": {"sessions": int, "steps": int, "backtrack": float, "system": int, "task": int,
                        "max_input": int, "seed": int},
    "reasoning-chat": {"sessions": int, "turns": int, "system": int, "seed": int},
}


def load_workload(spec: str, mooncake_tokens: str = "conversation") -> Workload:
    """A CLI workload spec: a trace path, `synthetic:KIND`, `synthetic:KIND:key=value,...`, or
    `stress:KIND[:key=value,...]` (`sim/stress.py`: chain-fanout, agent-backtrack, reasoning-chat)."""
    if spec.startswith("stress:"):
        return _stress_workload(spec)
    if not spec.startswith("synthetic:"):
        return load_trace(spec, mooncake_tokens)
    from sglang_marconi.sim.synthetic import generate

    kind, _, params = spec[len("synthetic:") :].partition(":")
    return generate(kind, **parse_params(f"workload spec {spec!r}", params, _SYNTHETIC_PARAMS))


def _stress_workload(spec: str) -> Workload:
    from sglang_marconi.sim import stress

    kind, _, params = spec[len("stress:") :].partition(":")
    if kind not in _STRESS_PARAMS:
        raise MarconiError(f"workload spec {spec!r}: unknown stress kind {kind!r}; known: {list(_STRESS_PARAMS)}")
    kwargs = parse_params(f"workload spec {spec!r}", params, _STRESS_PARAMS[kind])
    make = {"chain-fanout": stress.chain_fanout, "agent-backtrack": stress.agent_backtrack,
            "reasoning-chat": stress.reasoning_chat}[kind]
    if kind == "chain-fanout":
        kwargs.setdefault("n", 600)
    try:
        return make(**kwargs)
    except ValueError as exc:
        raise MarconiError(f"workload spec {spec!r}: {exc}") from None
