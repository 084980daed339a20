"""The robustness suite: the traffic a tuned eviction choice is judged on, in two parts.

- `dev`: what the decision rule was tuned on.
- `held-out`: never looked at while tuning (other seeds, other slices and halves, another token
  mode, other adversarial seeds); reported separately.

Each part holds
- the Mooncake conversation trace (`../shared/data/mooncake`, read in place) whole, in random
  halves (sessions split by a salted hash) and in time-shifted slices of ~4,000 requests (about the
  size of a production trace one has not seen), each at several capacities;
- every synthetic kind at 5 seeds and 3 capacities;
- traces made to mislead a sampler (`adversarial`): a few huge agent sessions among thousands of
  small ones, a workload that shifts halfway to traffic where recency wins, and a trace whose
  hash-sampled sessions (salt 0, the tuner's) are systematically unlike the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from sglang_marconi.policy.tuning.sampling import session_in_sample
from sglang_marconi.sim.synthetic import generate
from sglang_marconi.sim.traces import MooncakeTrace, load_trace
from sglang_marconi.sim.workload import ListWorkload, Request, Workload

MOONCAKE = Path(__file__).resolve().parents[3] / "shared/data/mooncake/conversation_trace.jsonl"
SLICE = 4000  # requests per time-shifted slice
GROUPS = ("dev", "held-out")


@dataclass(frozen=True)
class SuiteCell:
    group: str  # "dev" (tuned on) or "held-out"
    family: str  # "mooncake", "mooncake-half", "mooncake-slice", "synthetic:KIND", "adversarial:KIND"
    workload: str  # a name unique in the suite (the cache key of its fixed-choice replays)
    capacity_gb: float
    build: Callable[[], Workload]


# ---------------------------------------------------------------- Mooncake subsets


_LOADED: dict[tuple[str, str], MooncakeTrace] = {}


def mooncake(tokens: str = "conversation", path: Path = MOONCAKE) -> MooncakeTrace:
    key = (str(path), tokens)
    if key not in _LOADED:
        trace = load_trace(path, tokens)
        if tokens != "conversation":  # the name keys fixed-choice replays: one per token mode
            trace.name = f"{trace.name}[{tokens}]"
        _LOADED[key] = trace
    return _LOADED[key]


def mooncake_half(trace: MooncakeTrace, salt: int, part: int) -> MooncakeTrace:
    """Sessions whose salted hash falls below one half (part 0) or the others (part 1)."""
    return trace.subset(lambda i, s: session_in_sample(s, 0.5, salt) == (part == 0),
                           f"{trace.name}[half salt={salt} part={part}]")


def mooncake_slice(trace: MooncakeTrace, start: int, count: int = SLICE) -> MooncakeTrace:
    """`count` consecutive requests from the `start`-th, replayed from a cold cache."""
    return trace.subset(lambda i, s: start <= i < start + count,
                           f"{trace.name}[slice {start}:{start + count}]")


# ---------------------------------------------------------------- adversarial traces


def merge(name: str, parts: list[tuple[str, Workload, float]]) -> ListWorkload:
    """Requests of several workloads in one arrival order; each part's sessions renamed
    PREFIX/session and its arrivals shifted by its offset (seconds)."""
    requests = []
    for prefix, workload, offset in parts:
        for r in workload:
            requests.append(Request(f"{prefix}/{r.session_id}", r.turn, r.arrival_s + offset,
                                    r.input_tokens, r.output_tokens))
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep part order
    return ListWorkload(name, requests)


def one_shot_documents(count: int, seed: int, rate: float, median: int = 12_000, vocab: int = 32_000) -> ListWorkload:
    """`count` single-request sessions with long inputs that are never read again: a value-first
    eviction keeps them (long, FLOP-efficient prefixes) and loses what recency would have kept."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, count))
    reqs = []
    for i in range(count):
        n_in = int(np.clip(rng.lognormal(np.log(median), 0.5), 2_000, 60_000))
        tokens = rng.integers(0, vocab, size=n_in + 16, dtype=np.int64)
        reqs.append(Request(f"doc-{i}", 0, float(t[i]), tokens[:n_in], tokens[n_in:]))
    return ListWorkload(f"one-shot-documents:seed={seed},count={count}", reqs)


def huge_sessions(seed: int) -> ListWorkload:
    """Thousands of one-request sessions on shared system prompts, plus three huge agent
    trajectories (inputs up to ~100k tokens, ~45% of the input tokens from 0.1% of the sessions):
    what separates the choices comes from a handful of sessions, which a per-request confidence
    would count as hundreds of independent observations."""
    crowd = generate("system-prompt", seed=seed, sessions=3000, session_rate=5.0)
    giants = generate("swe-agent", seed=seed + 1000, sessions=3, session_rate=0.01, turn_gap_s=10.0, scale=1.6)
    return merge(f"adversarial:huge-sessions:seed={seed}", [("crowd", crowd, 0.0), ("giant", giants, 0.0)])


def shift_halfway(seed: int) -> ListWorkload:
    """Contended multi-turn chat, where value-first eviction wins, then from halfway single
    questions on shared prompts among long one-shot documents, where recency wins (a value-first
    cache keeps the documents and loses the prompts)."""
    chat = generate("lmsys", seed=seed, sessions=160, session_rate=0.5)
    half = max(r.arrival_s for r in chat) / 2
    span = max(r.arrival_s for r in chat) - half
    crowd = generate("system-prompt", seed=seed + 1, sessions=1000, session_rate=1000 / span)
    docs = one_shot_documents(300, seed + 2, rate=300 / span)
    return merge(f"adversarial:shift-halfway:seed={seed}",
                 [("chat", chat, 0.0), ("crowd", crowd, half), ("docs", docs, half)])


def misleading_sample(seed: int, rate: float = 0.2) -> ListWorkload:
    """A trace whose sessions in the tuner's hash sample (salt 0, below `rate`) are multi-turn
    chats, where value-first eviction wins, while all the others (six sessions in seven) are
    single questions on shared prompts and long one-shot documents, where recency wins: a
    sampled shadow sees a workload that is only part of what the live cache serves."""
    chat = generate("lmsys", seed=seed, sessions=600, session_rate=1.0)
    span = max(r.arrival_s for r in chat)
    crowd = generate("system-prompt", seed=seed + 1, sessions=3000, session_rate=3000 / span)
    docs = one_shot_documents(900, seed + 2, rate=900 / span, median=8_000)
    sampled, other = _ids_by_sample(rate, seed)
    requests = []
    for w, ids in ((chat, sampled), (crowd, other), (docs, other)):
        names = {s: next(ids) for s in dict.fromkeys(w.session_ids())}
        requests += [Request(names[r.session_id], r.turn, r.arrival_s, r.input_tokens, r.output_tokens) for r in w]
    requests.sort(key=lambda r: r.arrival_s)
    return ListWorkload(f"adversarial:misleading-sample:seed={seed},rate={rate:g}", requests)


def _ids_by_sample(rate: float, seed: int):
    """Two endless streams of session ids: those the tuner's sample (salt 0, `rate`) keeps, the others."""
    def stream(inside: bool):
        i = 0
        while True:
            sid = f"m{seed}-{i}"
            i += 1
            if session_in_sample(sid, rate) == inside:
                yield sid
    return stream(True), stream(False)


ADVERSARIAL = {"huge-sessions": huge_sessions, "shift-halfway": shift_halfway, "misleading-sample": misleading_sample}


# ---------------------------------------------------------------- the suite


# capacities (GB, paper-7b) from contended to ample, per family
SYNTHETIC_CAPACITIES = {"swe-agent": (5, 10, 20), "lmsys": (5, 10, 20), "sharegpt": (1, 2, 5),
                        "system-prompt": (0.2, 0.5, 1)}
ADVERSARIAL_CAPACITIES = {"huge-sessions": (2, 5, 10), "shift-halfway": (5, 10, 20),
                          "misleading-sample": (60, 150, 300)}
MOONCAKE_CAPACITIES = (100, 400, 1000)
SLICE_CAPACITIES = (50, 100, 400, 1000)  # a slice at 50 GB is tuned at sample rate 1
SEEDS = {"dev": (1, 2, 3, 4, 5), "held-out": (11, 12, 13, 14, 15)}
ADVERSARIAL_SEEDS = {"dev": (1,), "held-out": (2, 3)}
HALF_SALTS = {"dev": (1,), "held-out": (2,)}
SLICE_STARTS = {"dev": (0, 4000, 8000), "held-out": (2000, 6000)}


def suite(groups=GROUPS, *, mooncake_path: Path = MOONCAKE, quick: bool = False) -> list[SuiteCell]:
    """The cells of `groups`. `quick`: the first seed of each synthetic kind, the first slice and
    half, one adversarial seed, every capacity."""
    cells: list[SuiteCell] = []
    have_mooncake = mooncake_path.exists()
    for group in groups:
        fams: list[tuple[str, str, Callable[[], Workload], tuple]] = []
        if have_mooncake:
            if group == "dev":
                fams.append(("mooncake", "mooncake", lambda: mooncake(path=mooncake_path), MOONCAKE_CAPACITIES))
            else:  # the literal-blocks token mode, never tuned on
                fams.append(("mooncake", "mooncake-blocks", lambda: mooncake("blocks", mooncake_path),
                             MOONCAKE_CAPACITIES))
            for salt in HALF_SALTS[group]:
                for part in (0, 1)[: 1 if quick else 2]:
                    fams.append(("mooncake-half", f"mooncake[half salt={salt} part={part}]",
                                 lambda s=salt, p=part: mooncake_half(mooncake(path=mooncake_path), s, p),
                                 MOONCAKE_CAPACITIES))
            for start in SLICE_STARTS[group][: 1 if quick else None]:
                fams.append(("mooncake-slice", f"mooncake[slice {start}:{start + SLICE}]",
                             lambda s=start: mooncake_slice(mooncake(path=mooncake_path), s), SLICE_CAPACITIES))
        for kind, caps in SYNTHETIC_CAPACITIES.items():
            for seed in SEEDS[group][: 1 if quick else None]:
                spec = f"synthetic:{kind}:seed={seed}"
                fams.append((f"synthetic:{kind}", spec, lambda k=kind, s=seed: generate(k, seed=s), caps))
        for kind, make in ADVERSARIAL.items():
            for seed in ADVERSARIAL_SEEDS[group][: 1 if quick else None]:
                fams.append((f"adversarial:{kind}", f"adversarial:{kind}:seed={seed}",
                             lambda m=make, s=seed: m(s), ADVERSARIAL_CAPACITIES[kind]))
        for family, name, build, caps in fams:
            memo = _Memo(build)
            cells += [SuiteCell(group, family, name, float(gb), memo) for gb in caps]
    return cells


class _Memo:
    """Builds a workload once, on first use (the cells of one workload share it)."""

    def __init__(self, build: Callable[[], Workload]):
        self._build, self._workload = build, None

    def __call__(self) -> Workload:
        if self._workload is None:
            self._workload = self._build()
        return self._workload

    def release(self) -> None:
        self._workload = None
