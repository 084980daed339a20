"""Depth-aware eviction: evict the candidate with the largest age / (1 + depth)^B.

On conversation traffic most reuse is a next turn extending its previous turn's whole sequence,
and a sequence deep in a conversation (one that extends earlier turns) is more likely to be
continued than a first turn. A candidate's depth is that of the finished sequence ending exactly
at it (`policy/rules/continuation.py`: a bounded record keyed by hashes of token blocks, no
session id), 0 for none, and 0 once that sequence is older than the record's continuation horizon
(the time in which nine in ten continuations come); its age is how far its recency lies behind
the most recent candidate's, plus one tick. B = 0 is LRU over the same candidates (Marconi's:
unlocked nodes with at most one child; a hit refreshes only the node hit).

`CalibratedDepthEviction` learns B from the record: the per-depth share of recorded sequences that
were continued. Unless deeper sequences are continued significantly more often than first ones
(`fitted_exponent`), B is 0 and the rule is LRU; otherwise B is the slope of the log-odds of
being continued over log(1 + depth).

Depths are read when a victim is chosen, so the choice is a function of the candidates, their
ends and the record alone. The record is fed once per finished sequence: by the policy itself
(`observe_request`, the cache's per-request hook) when it owns it, or by whoever shares it among
several caches of one stream (`shared_record`: the tuner, which feeds it once per request).
"""

from __future__ import annotations

import math

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules import score
from sglang_marconi.policy.rules.continuation import ContinuationRecord, RecordedDepths
from sglang_marconi.policy.rules.eviction.base import EvictionPolicy

MIN_RECORDS = 200.0  # decayed sequences needed at depth 0 and at depths >= 1 before B can leave 0
SIGNIFICANCE_Z = 2.0  # deeper sequences must be continued more often by this many standard errors
MAX_EXPONENT = 16.0
SHRINK = 10.0  # pseudo-sequences pulling each depth's rate toward the pooled rate
SCAN_FIRST = 16  # candidates whose depths a victim choice reads first, at least (then 4x as many at a time)
DIRECT_READ = 32  # up to this many candidates, a victim choice reads every depth from the record


def check_exponent(exponent) -> float:
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not 0 <= exponent <= MAX_EXPONENT:
        raise MarconiError(f"depth exponent must be a number in [0, {MAX_EXPONENT:g}], got {exponent!r}")
    return float(exponent)


def core_node_end(node) -> tuple[int, int]:
    """(end, last token) of a policy-core node: a referenced edge (`ShadowNode`) or a copied one."""
    src = getattr(node, "src", None)
    return node.end, int(src[node.end - 1] if src is not None else node.tokens[-1])


def deepest_oldest(candidates, depths, exponent: float, first_read: int = SCAN_FIRST):
    """The candidate with the largest (age + 1) / (1 + depth)^exponent, age measured back from the
    most recent candidate; exact ties to the smallest tie key (`score.lowest_slot`). `depths`: each
    candidate's depth, as an array in slot order, or as a function of an array of slots, read only
    for the candidates that could still be the victim (`_lowest_keep_scanned`, `first_read` of them
    first)."""
    n = len(candidates)
    recency = candidates.recencies()
    if not exponent:
        return candidates.items[score.lowest_slot(recency, candidates.least_key)]
    age = recency.max() - recency + 1.0
    log_age = np.log(age)
    if callable(depths) and exponent > 0:
        return candidates.items[_lowest_keep_scanned(candidates, depths, exponent, log_age, first_read)]
    if callable(depths):
        depths = depths(np.arange(n))
    keep = exponent * np.log1p(depths) - log_age  # the victim has the lowest
    return candidates.items[score.lowest_slot(keep, candidates.least_key)]


def _lowest_keep_scanned(candidates, depths_of, exponent: float, log_age: np.ndarray, first_read: int) -> int:
    """The slot `deepest_oldest` picks, with depths read oldest first and only while they can
    matter: a candidate's keep score, B log(1 + depth) - log(age), is at least -log(age) (B > 0),
    so a candidate whose -log(age) exceeds the lowest keep found can be neither the victim nor
    tied with it. Each round reads the oldest of those not excluded yet (4x as many as the last
    round: the depth rule keeps deep candidates longest, so the oldest are often deep), until none
    is left. Each score is computed with the same operations as over the whole array, so the
    victim and its ties are the same, bit for bit."""
    floor = -log_age
    unread = np.ones(len(floor), dtype=bool)
    best, size = math.inf, max(1, first_read)
    seen, kept = [], []
    while True:
        pending = np.flatnonzero(unread & (floor <= best))
        if not len(pending):
            break
        if len(pending) > size:
            pending = pending[np.argpartition(floor[pending], size - 1)[:size]]
        keep = exponent * np.log1p(depths_of(pending)) - log_age[pending]
        unread[pending] = False
        seen.append(pending)
        kept.append(keep)
        best = min(best, float(keep.min()))
        size *= 4
    slots = np.concatenate(seen)
    tied = np.sort(slots[np.concatenate(kept) == best])
    return int(tied[0]) if len(tied) == 1 else int(candidates.least_key(tied))


def fitted_exponent(recorded: np.ndarray, continued: np.ndarray) -> float:
    """B from per-depth counts of sequences recorded and continued: 0 unless depths >= 1 are
    continued more often than depth 0 by SIGNIFICANCE_Z standard errors (each side with at least
    MIN_RECORDS); else the weighted least-squares slope of the log-odds of being continued over
    log(1 + depth), the rates shrunk toward the pooled one, within [0, MAX_EXPONENT]. (Among old
    candidates, whose remaining chance of a continuation is small, the chance scales with the
    odds: a deeper one that is (1 + depth)^B times older is as likely to be continued.)"""
    n0, c0 = float(recorded[0]), float(continued[0])
    n1, c1 = float(recorded[1:].sum()), float(continued[1:].sum())
    if n0 < MIN_RECORDS or n1 < MIN_RECORDS:
        return 0.0
    pooled = (c0 + c1) / (n0 + n1)
    spread = math.sqrt(pooled * (1.0 - pooled) * (1.0 / n0 + 1.0 / n1))
    if not spread or (c1 / n1 - c0 / n0) / spread < SIGNIFICANCE_Z:
        return 0.0
    seen = recorded >= 1.0
    x = np.log1p(np.flatnonzero(seen).astype(float))
    rate = np.clip((continued[seen] + SHRINK * pooled) / (recorded[seen] + SHRINK), 1e-3, 1 - 1e-3)
    y, w = np.log(rate / (1.0 - rate)), recorded[seen]
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    denominator = float(np.sum(w * (x - xm) ** 2))
    slope = float(np.sum(w * (x - xm) * (y - ym))) / denominator if denominator > 0 else 0.0
    return min(max(slope, 0.0), MAX_EXPONENT)


class DepthEviction(EvictionPolicy):
    name = "depth"
    evicts_single_child_nodes = True
    refresh_matched_path = False

    def __init__(self, exponent: float = 1.0, record: ContinuationRecord | None = None, *,
                 shared_record: bool = False, node_end=core_node_end):
        """`record`: the record of finished sequences (a new one if None); `shared_record`: someone
        else feeds it (this policy only reads it). `node_end(node)`: (end, last token) of a node
        of the tree this policy ranks (the policy core's nodes by default; another tree's nodes
        need their own)."""
        self.exponent = check_exponent(exponent)
        self.record = record if record is not None else ContinuationRecord()
        self.feeds_record = not shared_record
        self.node_end = node_end
        self._depths: RecordedDepths | None = None  # remembered between victim choices
        self._first_read = SCAN_FIRST  # depths a victim choice reads in its first round
        self.depths_read = 0

    def observe_request(self, cache, request, n: int) -> None:
        """A request finished with its first n tokens cached (`request`: a token array, or a
        `SharedMatch` whose `seq` holds them): record it, unless the record is fed elsewhere."""
        if self.feeds_record:
            self.record.finish(getattr(request, "seq", request), n)

    def current_exponent(self) -> float:
        return self.exponent

    @property
    def alpha(self) -> float:
        """B, where choice histories record a rule's weight."""
        return self.exponent

    def depths(self, candidates):
        """The depths (`ContinuationRecord.depth_at` at their ends) of the candidates in an array
        of slots, as a function of that array; `self.depths_read` counts the candidates read."""
        reader = self._depths
        if reader is None or reader.record is not self.record:
            reader = self._depths = RecordedDepths(self.record, self.node_end)
        items, n = candidates.items, len(candidates)
        self.depths_read = 0

        def depths_of(slots: np.ndarray) -> np.ndarray:
            self.depths_read += len(slots)
            return reader([items[i] for i in slots.tolist()], n)
        return depths_of

    def choose(self, candidates):
        exponent = self.current_exponent()
        if not exponent:
            return deepest_oldest(candidates, None, exponent)
        n = len(candidates)
        if n <= DIRECT_READ:  # a handful: reading each depth costs less than remembering them
            depth_at, node_end = self.record.depth_at, self.node_end
            depths = np.fromiter((depth_at(*node_end(node)) for node in candidates.items), dtype=float, count=n)
            return deepest_oldest(candidates, depths, exponent)
        # as many depths first as the last choice needed: the oldest candidates change little
        victim = deepest_oldest(candidates, self.depths(candidates), exponent, self._first_read)
        self._first_read = max(SCAN_FIRST, self.depths_read)
        return victim


class CalibratedDepthEviction(DepthEviction):
    name = "depth-auto"

    def __init__(self, record: ContinuationRecord | None = None, *, shared_record: bool = False,
                 node_end=core_node_end):
        super().__init__(0.0, record, shared_record=shared_record, node_end=node_end)
        self._fitted_from = None  # the settled rates B was fitted from

    def current_exponent(self) -> float:
        """B fitted from the record's settled rates (`ContinuationRecord.settled_rates`: the same
        whenever it is asked between two settlements, so a function of the stream alone)."""
        settled = self.record.settled_rates
        if settled is not self._fitted_from:
            self._fitted_from = settled
            self.exponent = fitted_exponent(*settled)
        return self.exponent


def depth_rule_of(choice, record: ContinuationRecord | None, node_end=core_node_end) -> DepthEviction | None:
    """The rule a choice names ("depth:B", or "depth:auto" for B learned), reading `record` (a new
    one if None), which its caller feeds (`shared_record`); None for a choice that names no depth
    rule. `node_end` as in `DepthEviction`."""
    if not isinstance(choice, str) or choice.partition(":")[0] != "depth":
        return None
    value = choice.partition(":")[2]
    if value == "auto":
        return CalibratedDepthEviction(record, shared_record=True, node_end=node_end)
    try:
        exponent = float(value)
    except ValueError:
        raise MarconiError(f"depth choice {choice!r}: expected depth:B (a number) or depth:auto") from None
    return DepthEviction(check_exponent(exponent), record, shared_record=True, node_end=node_end)
