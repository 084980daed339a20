"""Seeded synthetic workloads shaped like the Marconi paper's (§5), for tests and demos.

Every session is a chain of turns: turn k's input = turn k-1's input + its output + new
user (or observation) tokens, which is what makes input+output prefixes reusable. Tokens are
uniform over [0, vocab). Lengths are lognormal (median m, log-sd s) clipped to [lo, hi], all
multiplied by `scale`; a session stops early rather than let its input pass `max_input`.

Session starts are a Poisson process at `session_rate` sessions/s; each later turn arrives
turn_gap_s * (0.5 + Exp(mean 0.5)) after the previous one (mean turn_gap_s, never below half).

| kind          | turns  | first input      | new tokens/turn       | output           | max input | gap  |
|---------------|--------|------------------|-----------------------|------------------|-----------|------|
| lmsys         | 10-20  | m 150, [8,1500]  | m 60, [4,600]         | m 300, [16,1200] | 10k       | 30 s |
| sharegpt      | 10-16  | m 60, [4,600]    | m 25, [2,300]         | m 60, [4,400]    | 4k        | 20 s |
| swe-agent     | 20-60  | prompt + m 400   | obs. m 500 s 1.0, [30,4000] | m 60, [8,400] | 64k   | 7.5 s|
| system-prompt | 1      | prompt + m 50    | -                     | m 120, [4,800]   | -         | -    |

swe-agent: one shared system prompt of 2000-3000 tokens starts every trajectory, then a task
description; inputs grow from ~3k to tens of thousands. system-prompt: 3 prompts of 1000-2000
tokens with Zipf popularity (1/rank), each request one session with a unique question.
Defaults (sessions, session_rate/s): lmsys 100, 1.0; sharegpt 100, 1.0; swe-agent 20, 0.5;
system-prompt 500, 5.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.workload import Request, Workload

Dist = tuple[float, float, int, int]  # lognormal median, log-sd, clip lo, clip hi


@dataclass(frozen=True)
class _Shape:
    turns: tuple[int, int]
    first: Dist
    step: Dist
    output: Dist
    max_input: int
    sessions: int
    session_rate: float
    turn_gap_s: float
    prompts: tuple[int, int, int] | None = None  # shared prompts: count, min len, max len


_SHAPES = {
    "lmsys": _Shape((10, 20), (150, 0.8, 8, 1500), (60, 0.9, 4, 600), (300, 0.6, 16, 1200),
                    10_000, 100, 1.0, 30.0),
    "sharegpt": _Shape((10, 16), (60, 0.8, 4, 600), (25, 0.8, 2, 300), (60, 0.7, 4, 400),
                       4_000, 100, 1.0, 20.0),
    "swe-agent": _Shape((20, 60), (400, 0.5, 100, 1500), (500, 1.0, 30, 4000), (60, 0.6, 8, 400),
                        64_000, 20, 0.5, 7.5, prompts=(1, 2000, 3000)),
    "system-prompt": _Shape((1, 1), (50, 0.8, 4, 500), (1, 0.0, 1, 1), (120, 0.7, 4, 800),
                            10**9, 500, 5.0, 1.0, prompts=(3, 1000, 2000)),
}
SYNTHETIC_KINDS = tuple(_SHAPES)


class SyntheticWorkload(Workload):
    """One token buffer per session; requests are read-only views into it."""

    def __init__(self, name: str, kind: str, buffers: list[np.ndarray],
                 turns: list[tuple[float, int, int, int, int]]):
        # turns: (arrival_s, session index, turn, input len, output len), in arrival order
        self.name, self.kind, self._buffers, self._turns = name, kind, buffers, turns

    def __len__(self) -> int:
        return len(self._turns)

    def session_ids(self) -> list[str]:
        return [self._sid(t[1]) for t in self._turns]

    def request_lengths(self) -> np.ndarray:
        return np.array([(t[3], t[4]) for t in self._turns], dtype=np.int64).reshape(-1, 2)

    def _sid(self, session: int) -> str:
        return f"{self.kind}-{session}"

    def __iter__(self) -> Iterator[Request]:
        for arrival, s, turn, n_in, n_out in self._turns:
            buf = self._buffers[s]
            yield Request(self._sid(s), turn, arrival, buf[:n_in], buf[n_in:n_in + n_out])


def _positive(name: str, value, integer: bool = False, allow_zero: bool = False):
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or \
            value < 0 or (value == 0 and not allow_zero):
        need = "a positive integer" if integer else ("a number >= 0" if allow_zero else "a positive number")
        raise MarconiError(f"synthetic workload parameter {name!r} must be {need}, got {value!r}")
    return value


def generate(kind: str, *, seed: int = 0, sessions: int | None = None,
             session_rate: float | None = None, turn_gap_s: float | None = None,
             vocab: int = 32000, scale: float = 1.0) -> Workload:
    """A seeded synthetic workload of `kind` (see SYNTHETIC_KINDS); None means the kind's default."""
    if kind not in _SHAPES:
        raise MarconiError(f"unknown synthetic workload kind {kind!r}; known kinds: {list(SYNTHETIC_KINDS)}")
    shape = _SHAPES[kind]
    sessions = _positive("sessions", shape.sessions if sessions is None else sessions, integer=True)
    session_rate = _positive("session_rate", shape.session_rate if session_rate is None else session_rate)
    turn_gap_s = _positive("turn_gap_s", shape.turn_gap_s if turn_gap_s is None else turn_gap_s,
                           allow_zero=True)
    _positive("vocab", vocab, integer=True)
    _positive("scale", scale)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise MarconiError(f"synthetic workload parameter 'seed' must be an integer, got {seed!r}")

    rng = np.random.default_rng(seed)

    def length(d: Dist) -> int:
        median, sigma, lo, hi = d
        x = float(np.clip(rng.lognormal(math.log(median), sigma), lo, hi)) if sigma else median
        return max(1, round(x * scale))

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, vocab, size=n, dtype=np.int64)

    prompts: list[np.ndarray] = []
    popularity = None
    if shape.prompts:
        count, lo, hi = shape.prompts
        prompts = [tokens(max(1, round(rng.integers(lo, hi + 1) * scale))) for _ in range(count)]
        popularity = 1.0 / np.arange(1, count + 1)
        popularity /= popularity.sum()
    max_input = max(1, round(shape.max_input * scale))

    starts = np.concatenate(([0.0], np.cumsum(rng.exponential(1.0 / session_rate, sessions - 1))))
    buffers, turns = [], []
    for s in range(sessions):
        chunks = [prompts[rng.choice(len(prompts), p=popularity)]] if prompts else []
        chunks.append(tokens(length(shape.first)))
        n_in = sum(len(c) for c in chunks)  # the first turn is never cut
        arrival = float(starts[s])
        for turn in range(int(rng.integers(shape.turns[0], shape.turns[1] + 1))):
            if turn:
                step = tokens(length(shape.step))
                if n_in + n_out + len(step) > max_input:
                    break
                chunks.append(step)
                n_in += n_out + len(step)
                arrival += turn_gap_s * (0.5 + rng.exponential(0.5))
            n_out = length(shape.output)
            chunks.append(tokens(n_out))
            turns.append((arrival, s, turn, n_in, n_out))
        buf = np.concatenate(chunks)[: n_in + n_out]
        buf.flags.writeable = False
        buffers.append(buf)
    turns.sort(key=lambda t: (t[0], t[1], t[2]))
    name = (f"synthetic:{kind}:seed={seed},sessions={sessions},session_rate={session_rate:g},"
            f"turn_gap_s={turn_gap_s:g},scale={scale:g}" + (f",vocab={vocab}" if vocab != 32000 else ""))
    return SyntheticWorkload(name, kind, buffers, turns)


def default_workload(seed: int = 0) -> Workload:
    """A modest swe-agent-like workload (10 trajectories, ~400 requests) for the demo."""
    return generate("swe-agent", seed=seed, sessions=10)
