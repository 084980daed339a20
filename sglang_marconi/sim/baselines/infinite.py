"""The infinite-cache bound: every request reuses the longest prefix it shares with any earlier
request's input or output, as if every token's KV and every position's SSM state were kept."""

from __future__ import annotations

from sglang_marconi.policy.tree.radix_tree import RadixTree
from sglang_marconi.sim.policy_api import Outcome, PolicyStats
from sglang_marconi.sim.workload import Request


class InfiniteCache:
    name = "infinite"

    def __init__(self):
        self.tree = RadixTree()
        self.tokens = 0

    def serve(self, request: Request) -> Outcome:
        walk = self.tree.walk(request.input_tokens)
        hit = min(walk.overlap, request.input_len - 1)
        seq = request.full_sequence()
        walk = self.tree.walk(seq)
        if walk.overlap < len(seq):
            parent = self.tree.split(walk.partial, walk.partial_len) if walk.partial else (walk.last or self.tree.root)
            self.tree.add_leaf(parent, seq[walk.overlap :])
            self.tokens += len(seq) - walk.overlap
        return Outcome(request.input_len, hit, walk.overlap)

    def stats(self) -> PolicyStats:
        return PolicyStats(kv_tokens_cached=self.tokens)
