"""MODELED per-worker load: a FIFO prefill queue per worker, driven by the trace's arrival times.

A request routed to a worker at its arrival time waits for the prefill work queued before it,
then takes its own uncached prefill FLOPs / the GPU's assumed sustained FLOP/s (`ttft_model`).
Its modeled TTFT is that wait plus its own prefill. Decode is not modeled: a request stops
counting as in flight once its prefill is done. Like `ttft_model`, this is NOT a measurement:
it turns the FLOPs a hit saves, and the work a router piles on one worker, into seconds.
"""

from __future__ import annotations

from collections import deque

from sglang_marconi.sim.ttft_model import get_gpu_profile


class PrefillQueues:
    def __init__(self, workers: int, gpu: str):
        self.flops_per_s = get_gpu_profile(gpu).effective_flops
        self.busy_until = [0.0] * workers
        self._finishes = [deque() for _ in range(workers)]  # FIFO: finish times ascending
        self.prefill_flops = [0.0] * workers  # uncached prefill work each worker did
        self.requests = [0] * workers

    def advance(self, now: float) -> None:
        """Retire every request whose prefill finished by `now`."""
        for q in self._finishes:
            while q and q[0] <= now:
                q.popleft()

    def in_flight(self) -> list[int]:
        return [len(q) for q in self._finishes]

    def outstanding_s(self, now: float) -> list[float]:
        return [max(0.0, b - now) for b in self.busy_until]

    def submit(self, worker: int, now: float, flops: float) -> float:
        """Queue `flops` of prefill on `worker` at `now`; returns the request's modeled TTFT."""
        finish = max(now, self.busy_until[worker]) + flops / self.flops_per_s
        self.busy_until[worker] = finish
        self._finishes[worker].append(finish)
        self.prefill_flops[worker] += flops
        self.requests[worker] += 1
        return finish - now
