"""What each request of a trace could hit under Marconi's admission, and what holding it costs:
the data of the offline bound (`belady.py`).

One pass over the trace keeps a radix tree of every earlier request's input + output (never
evicted). For request r it records

- its *pieces*: the edges of that tree along its input, up to the longest prefix it could reuse
  (at most input length - 1 tokens, as every cache leaves one token to prefill), each with its
  KV bytes and the index of the latest earlier request whose sequence passed through the edge;
- its *hit options*: the positions on that path where an earlier request could have left an SSM
  state (below), each with the number of leading pieces a hit there needs (its KV) and the hit's
  value, in tokens and in prefill FLOPs saved.

Why these intervals: a cache holds an item (the KV of an edge, or the state at a position) only
since it last entered the cache, and an item enters only when a request's sequence passes through
it (admission caches a served sequence's KV and states on it). So if r hits with an item, the item
was held at every arrival after the latest earlier request passing through it, up to r; and two
requests that both need an item need it over disjoint arrival ranges (the earlier one passes
through it, so the later one's range starts after it). The state at a position is passed through
exactly when the edge ending there is, so a state's range is its edge's.

Where a state can be produced (a superset of Marconi's admission, whatever the eviction did): at
the end of a request's sequence; at its branch checkpoint, which is where its input leaves the
cache's tree, capped at input length - 1 and floored to the checkpoint grid, and the cache's tree
only ever holds prefixes of earlier sequences cut at positions this tree also has a boundary at,
so every boundary along the input (and the input's overlap with this tree) is recorded, capped
and floored; with probation, at the end of its input. A hit option needs a state produced by
an earlier request at that position. A model without SSM layers needs no state: any node end along
the path and the longest reusable prefix are options.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.tree.radix_tree import Node, RadixTree
from sglang_marconi.sim.workload import Workload


@dataclass(frozen=True)
class HitOptions:
    """Flat arrays, grouped by request in arrival order (pieces in path order within a request)."""

    input_tokens: np.ndarray  # per request
    sequence_tokens: np.ndarray  # per request: input + output
    admitted_bytes_at_most: np.ndarray  # per request: the most its admission can need the cache to hold at once
    kv_bytes_per_token: int
    ssm_state_bytes: int
    piece_request: np.ndarray  # per piece: the request that needs it
    piece_since: np.ndarray  # per piece: latest earlier request passing through it (held from the next arrival)
    piece_bytes: np.ndarray  # per piece: KV bytes
    option_request: np.ndarray  # per option: its request (non-decreasing)
    option_end_piece: np.ndarray  # per option: global index one past its last needed piece
    option_hit_tokens: np.ndarray  # per option: tokens reused
    option_flops_saved: np.ndarray  # per option: prefill FLOPs saved
    request_first_piece: np.ndarray  # per request: global index of its first piece

    @property
    def requests(self) -> int:
        return int(self.input_tokens.size)

    @property
    def forced_bytes(self) -> np.ndarray:
        """Per request: what its admission leaves in the cache until the next admission (its
        sequence's KV and end state), if it was admitted."""
        return self.kv_bytes_per_token * self.sequence_tokens + self.ssm_state_bytes

    @property
    def option_state_is_end_of_since(self) -> np.ndarray:
        """Per option: its state sits at the end of the sequence of the latest request passing it."""
        since = self.piece_since[self.option_end_piece - 1]
        return self.sequence_tokens[since] == self.option_hit_tokens


class _Timeline:
    """Per tree node: the latest request that passed through its edge, the latest that could have
    left a state at its end, and the end of the longest sequence through it (keyed by node id; a
    split's tail keeps its id and its end)."""

    def __init__(self):
        self.tree = RadixTree()
        self.passed: dict[int, int] = {}
        self.state: dict[int, int] = {}
        self.deepest: dict[int, int] = {}

    def split(self, node: Node, k: int) -> Node:
        head = self.tree.split(node, k)
        # every sequence through the tail went through the head
        self.passed[head.id], self.deepest[head.id] = self.passed[node.id], self.deepest[node.id]
        return head  # no state was ever left at the new boundary

    def lockable_tail(self, seq: np.ndarray) -> int:
        """Tokens beyond where `seq` leaves a cache's tree that the cache may lock with it: an
        admission locks the whole edge it leaves mid-way, an earlier sequence's tail. A cache's
        tree holds prefixes of earlier sequences, so it leaves an edge where an earlier sequence
        diverges from `seq`: at a boundary of this tree along `seq`, or where `seq` leaves this tree;
        the tail runs at most to the end of the longest sequence through there."""
        walk = self.tree.walk(seq)
        tails = [self.deepest[x.id] - x.end for x in walk.path]
        if walk.partial is not None:
            tails.append(self.deepest[walk.partial.id] - walk.overlap)
        return max(tails, default=0)

    def node_at(self, seq: np.ndarray, pos: int) -> Node:
        walk = self.tree.walk(seq[:pos])
        return self.split(walk.partial, walk.partial_len) if walk.partial else walk.last

    def insert(self, seq: np.ndarray, index: int) -> None:
        walk = self.tree.walk(seq)
        # a boundary where the sequence stops or leaves an edge: each edge is passed through whole or not at all
        parent = self.split(walk.partial, walk.partial_len) if walk.partial else (walk.last or self.tree.root)
        if walk.overlap < len(seq):
            leaf = self.tree.add_leaf(parent, seq[walk.overlap:])
            self.passed[leaf.id], self.deepest[leaf.id] = index, len(seq)
        node = self.tree.walk(seq).last
        while node is not self.tree.root:
            self.passed[node.id] = index
            self.deepest[node.id] = max(self.deepest[node.id], len(seq))
            node = node.parent


def hit_options(workload: Workload, profile, *, checkpoint_grid: int = 1, probation: bool = False) -> HitOptions:
    """Every request's pieces and hit options (see the module docstring)."""
    kv, ssm = int(profile.kv_bytes_per_token), int(profile.ssm_state_bytes)
    attention_only = ssm == 0
    line = _Timeline()
    flops = profile.prefill_flops
    inputs, sequences, worst, first_piece = [], [], [], []
    p_req, p_since, p_bytes = [], [], []
    o_req, o_end, o_hit, o_flops = [], [], [], []
    for r, request in enumerate(workload):
        inp, seq = request.input_tokens, request.full_sequence()
        n_in = len(inp)
        limit = n_in - 1
        inputs.append(n_in)
        sequences.append(len(seq))
        first_piece.append(len(p_req))
        walk = line.tree.walk(inp)
        cap = min(walk.overlap, limit)
        boundaries = []
        for node in [*walk.path, walk.partial]:
            if node is None or node.start >= cap:
                break
            end = min(node.end, cap)
            p_req.append(r)
            p_since.append(line.passed[node.id])
            p_bytes.append(kv * (end - node.start))
            boundaries.append(end)
            if end == node.end and (attention_only or node.id in line.state) or attention_only and end == cap:
                o_req.append(r)
                o_end.append(len(p_req))
                o_hit.append(end)
                o_flops.append(flops(0, n_in) - flops(end, n_in))
        # States this request may leave (its branch checkpoint wherever the cache's tree ends, its end, probation's)
        grid = checkpoint_grid
        produced = {b - b % grid for b in boundaries} | {len(seq)}
        if probation:
            produced.add(n_in)
        tail = line.lockable_tail(seq)
        line.insert(seq, r)
        for pos in produced:
            if pos > 0:
                line.state[line.node_at(seq, pos).id] = r
        # What admitting r can need room beside: its path's KV and states (the cache's states sit at
        # boundaries of this tree, at most one per node), and a locked tail with its state.
        worst.append(kv * (len(seq) + tail) + ssm * (len(line.tree.walk(seq).path) + (tail > 0)))
    as_int = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return HitOptions(
        input_tokens=as_int(inputs), sequence_tokens=as_int(sequences), admitted_bytes_at_most=as_int(worst),
        kv_bytes_per_token=kv, ssm_state_bytes=ssm,
        piece_request=as_int(p_req), piece_since=as_int(p_since), piece_bytes=np.asarray(p_bytes, dtype=np.float64),
        option_request=as_int(o_req), option_end_piece=as_int(o_end), option_hit_tokens=as_int(o_hit),
        option_flops_saved=np.asarray(o_flops, dtype=np.float64), request_first_piece=as_int(first_piece),
    )
