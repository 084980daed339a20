"""Requests and workloads: what every simulated policy consumes.

A `Workload` is a re-iterable, sized stream of `Request`s in arrival order. Trace-backed
workloads (see `traces.py`) rebuild each request's tokens on the fly, so iterating never holds
more than one request's tokens at a time; synthetic ones (`synthetic.py`) keep one token
buffer per session and hand out views into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.tuning.sampling import check_rate, session_in_sample

__all__ = ["Request", "Workload", "ListWorkload", "sample_sessions", "session_in_sample"]


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: ndarray fields cannot be compared/hashed
class Request:
    session_id: str  # conversation/agent session; used for hash-sampling sessions
    turn: int
    arrival_s: float
    input_tokens: np.ndarray  # 1-D int64, len >= 1
    output_tokens: np.ndarray  # 1-D int64, may be empty
    # OpenAI's cache hints, as a client sent them (`policy/rules/cache_hints.py`); None: no hint
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens"):
            arr = np.asarray(getattr(self, name), dtype=np.int64)
            if arr.ndim != 1:
                raise MarconiError(f"Request {name} must be 1-D, got shape {arr.shape}")
            object.__setattr__(self, name, arr)
        if self.input_tokens.size == 0:
            raise MarconiError(f"Request {self.session_id!r} turn {self.turn} has empty input_tokens")

    @property
    def input_len(self) -> int:
        return int(self.input_tokens.size)

    @property
    def output_len(self) -> int:
        return int(self.output_tokens.size)

    def full_sequence(self) -> np.ndarray:
        """Input followed by output, as one new array."""
        return np.concatenate((self.input_tokens, self.output_tokens))


class Workload:
    """A named, sized, re-iterable stream of requests in arrival order."""

    name: str

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def session_ids(self) -> list[str]:
        """Session id of each request, in order. Subclasses override this with a cheap version."""
        return [r.session_id for r in self]

    def request_lengths(self) -> np.ndarray:
        """(input length, output length) of each request, shape (n, 2). Subclasses override this
        with a version that rebuilds no tokens."""
        return np.array([(r.input_len, r.output_len) for r in self], dtype=np.int64).reshape(-1, 2)

    def block_hashes(self) -> tuple[int, list[tuple[list[int], int]]] | None:
        """For traces that carry block hash ids (Mooncake): (block size in tokens, one
        (hash ids, input length) per request in arrival order); None for token-only workloads."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}: {len(self)} requests>"


class ListWorkload(Workload):
    """A workload over requests already in memory (tests, small hand-made workloads)."""

    def __init__(self, name: str, requests: Iterable[Request]):
        self.name = name
        self._requests = list(requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def session_ids(self) -> list[str]:
        return [r.session_id for r in self._requests]


class _FilteredWorkload(Workload):
    def __init__(self, base: Workload, name: str, keep: Callable[[str], bool]):
        self.name, self._base, self._keep = name, base, keep
        self._len = sum(1 for s in base.session_ids() if keep(s))

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._base if self._keep(r.session_id))

    def __len__(self) -> int:
        return self._len

    def session_ids(self) -> list[str]:
        return [s for s in self._base.session_ids() if self._keep(s)]


def sample_sessions(workload: Workload, rate: float, salt: int = 0) -> Workload:
    """The requests of `workload` whose session is in the hash sample (rate 1 returns it as is)."""
    if check_rate(rate) >= 1.0:
        return workload
    return _FilteredWorkload(
        workload,
        f"{workload.name}@sessions={rate:g},salt={salt}",
        lambda s: session_in_sample(s, rate, salt),
    )
