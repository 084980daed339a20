"""The no-caching baseline: every input token is prefilled."""

from __future__ import annotations

from sglang_marconi.sim.policy_api import Outcome, PolicyStats
from sglang_marconi.sim.workload import Request


class NoCache:
    """Caches nothing: hit 0 on every request, all statistics zero."""

    name = "none"

    def serve(self, request: Request) -> Outcome:
        return Outcome(input_tokens=int(request.input_len), hit_tokens=0)

    def stats(self) -> PolicyStats:
        return PolicyStats()
