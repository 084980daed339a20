"""A workload k times as long: k time-shifted copies of a trace, for the linear-cost benchmark.

Copy j (0-based) arrives j x (the trace's span + its mean gap) later, names its sessions
`SID#j` and adds j x 2**44 to every token (Mooncake's expanded tokens are < 2**40 and its
output tokens < 2**41), so no copy shares a prefix with another: the cache work per request is
the original's, and any growth of cost per request is the simulator's own.
"""

from __future__ import annotations

from typing import Iterator

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.workload import Request, Workload

TOKEN_STRIDE = 2**44


class ShiftedCopies(Workload):
    def __init__(self, base: Workload, copies: int):
        if isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= 64:
            raise MarconiError(f"copies must be an integer in [1, 64], got {copies!r}")
        self.base, self.copies = base, copies
        self.name = base.name if copies == 1 else f"{base.name}x{copies}"
        self._len = len(base)
        first = last = None
        for r in base:  # one pass for the span (rebuilds the tokens once)
            first = r.arrival_s if first is None else first
            last = r.arrival_s
        span = (last - first) if first is not None else 0.0
        self.shift_s = span + (span / max(1, self._len - 1))

    def __len__(self) -> int:
        return self._len * self.copies

    def __iter__(self) -> Iterator[Request]:
        for j in range(self.copies):
            for r in self.base:
                if j == 0:
                    yield r
                else:
                    yield Request(f"{r.session_id}#{j}", r.turn, r.arrival_s + j * self.shift_s,
                                  r.input_tokens + j * TOKEN_STRIDE, r.output_tokens + j * TOKEN_STRIDE)

    def session_ids(self) -> list[str]:
        base = self.base.session_ids()
        return [s if j == 0 else f"{s}#{j}" for j in range(self.copies) for s in base]

    def block_hashes(self):
        native = self.base.block_hashes()
        if native is None:
            return None
        size, requests = native
        # ids of copy j: (j, id), distinct from every id of another copy
        return size, [(ids if j == 0 else [(j, h) for h in ids], n) for j in range(self.copies) for ids, n in requests]
