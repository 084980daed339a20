"""A bounded, metadata-only record of finished sequences: how deep in a conversation each one is,
and how often sequences at each depth were continued. No session id, no KV: tokens only.

A finished sequence (a request's input + output, as far as the cache admits it) is recorded under
the hash of its first floor(L / block_tokens) blocks (`prefix_hashes`: a chained hash of token
blocks, the same function wherever it runs, so every rank and the simulator agree bit for bit).
Its depth is one more than the depth of the longest recorded sequence it extends (a recorded
sequence of L' tokens whose block-prefix hash matches, whose length L' is below this sequence's
and whose last token agrees at position L' - 1), 0 if it extends none. That earlier sequence is
marked continued, once; per depth the record keeps decayed counts of sequences recorded and of
those continued (`rates`), which a self-calibrating rule reads.

Candidates of an eviction are looked up by their end (`depth_at(end, last_token)`): the depth of
the recorded sequence that ends exactly there, 0 if none (an evicted record, a branch point), and 0
once it is older than the record's continuation horizon. The horizon is the `horizon_quantile`
(0.9 by default) of how long continuations took: per sequence first continued, the number of
sequences finished between it and its continuation, in a decayed histogram of half-octave bins
(`horizon`, settled with the rates). A sequence not continued within the time in which nine in ten
continuations come is mostly abandoned, so its depth stops protecting it: protection
(1 + depth)^B times longer than a first turn's would otherwise keep deep but dead conversations
where the cache is ample enough to hold them that long.

Bounds: at most `max_sequences` records, the least recently recorded or extended dropped first
(`BYTES_PER_SEQUENCE` each at most; `tests/test_depth_eviction.py` measures it). Per finished sequence:
one vectorized pass over its tokens and one dictionary lookup per block.

A reader that looks up many candidates at a time (a victim choice) remembers their rows between reads
(`RecordedDepths`); the record tells it which ends changed in a log of the last `ENDS_LOG_KEPT`
(about half a megabyte at most, beside the per-sequence bound).
"""

from __future__ import annotations

import copy
import math
import operator
from collections import OrderedDict

import numpy as np

from sglang_marconi.policy.errors import MarconiError

MAX_DEPTH = 15  # depths above this count as this one in the per-depth rates
SETTLE_EVERY = 64  # finished sequences between the settled copies of the rates (`settled_rates`)
HORIZON_MIN_GAPS = 100.0  # decayed continuations needed before the horizon leaves infinity
GAP_BINS = 128  # half-octave bins of continuation gaps (in sequences finished): up to 2**64
# Python's memory per record (both dictionary entries and the record itself), measured on CPython
# 3.11 (`tests/test_depth_eviction.py` checks it stays within this).
BYTES_PER_SEQUENCE = 400
ENDS_LOG_KEPT = 4096  # changed ends kept for `RecordedDepths` readers; one further behind re-reads all

_MASK = (1 << 64) - 1
_MULTIPLIER = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64
_INVERSE = pow(_MULTIPLIER, -1, 1 << 64)
_WEIGHT_SEED = 0x5EED_C0DE


def _weights(block_tokens: int) -> np.ndarray:
    """Fixed odd per-position weights of a block's polynomial hash (the same in every process)."""
    return np.random.Generator(np.random.PCG64(_WEIGHT_SEED + block_tokens)).integers(
        0, 1 << 63, size=block_tokens, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


class _Powers:
    """MULTIPLIER**k and its inverse**k modulo 2**64, k = 0, 1, ..., grown on demand."""

    def __init__(self):
        self.up = np.ones(1, dtype=np.uint64)
        self.down = np.ones(1, dtype=np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.up) < n:
            size = max(n, 2 * len(self.up))
            up, down, u, d = [1], [1], 1, 1
            for _ in range(size - 1):
                u, d = (u * _MULTIPLIER) & _MASK, (d * _INVERSE) & _MASK
                up.append(u)
                down.append(d)
            self.up, self.down = np.array(up, dtype=np.uint64), np.array(down, dtype=np.uint64)
        return self.up[:n], self.down[:n]


_POWERS = _Powers()


def prefix_hashes(tokens, block_tokens: int) -> np.ndarray:
    """h[k-1] = hash of tokens[:k x block_tokens], k = 1 .. len // block_tokens, as uint64:
    h_k = sum over j <= k of b_j x M**(k - j) (mod 2**64), b_j the j-th block's weighted sum plus j."""
    tokens = np.asarray(tokens)
    blocks = len(tokens) // block_tokens
    if blocks == 0:
        return np.empty(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        grid = tokens[: blocks * block_tokens].astype(np.int64).view(np.uint64).reshape(blocks, block_tokens)
        block_sums = (grid * _weights_cached(block_tokens)).sum(axis=1, dtype=np.uint64)
        block_sums += np.arange(1, blocks + 1, dtype=np.uint64)
        up, down = _POWERS.get(blocks + 1)
        return np.cumsum(block_sums * down[1:], dtype=np.uint64) * up[1:]


_WEIGHTS: dict[int, np.ndarray] = {}


def _weights_cached(block_tokens: int) -> np.ndarray:
    w = _WEIGHTS.get(block_tokens)
    if w is None:
        w = _WEIGHTS[block_tokens] = _weights(block_tokens)
    return w


def gap_bin(gap: int) -> int:
    """The histogram bin of a continuation gap of `gap` >= 1 sequences: floor(2 log2 gap), so bin b
    holds gaps in [2**(b / 2), 2**((b + 1) / 2))."""
    return min(int(2.0 * math.log2(max(gap, 1))), GAP_BINS - 1)


def horizon_of(gaps: np.ndarray, quantile: float | None) -> float:
    """The upper edge of the bin where the decayed gap counts reach `quantile` of their total;
    infinity with no quantile or fewer than HORIZON_MIN_GAPS (decayed) continuations."""
    total = float(gaps.sum())
    if quantile is None or total < HORIZON_MIN_GAPS:
        return math.inf
    b = int(np.searchsorted(np.cumsum(gaps), quantile * total))
    return 2.0 ** ((min(b, GAP_BINS - 1) + 1) / 2.0)


class _Sequence:
    __slots__ = ("length", "last_token", "depth", "continued", "finished_at")

    def __init__(self, length: int, last_token: int, depth: int, finished_at: int):
        self.length, self.last_token, self.depth, self.continued = length, last_token, depth, False
        self.finished_at = finished_at  # the record's `finished` count when it was recorded


class ContinuationRecord:
    """See the module docstring. `finish(tokens)` once per finished sequence, in stream order."""

    def __init__(self, block_tokens: int = 64, max_sequences: int = 1 << 16, half_life: float = 20000.0,
                 horizon_quantile: float | None = 0.9):
        """`horizon_quantile`: the share of continuations the horizon must cover (in (0, 1]); None:
        depths never expire."""
        if horizon_quantile is not None and (isinstance(horizon_quantile, bool) or not isinstance(
                horizon_quantile, (int, float)) or not 0 < horizon_quantile <= 1):
            raise MarconiError(f"horizon_quantile must be a number in (0, 1] or None, got {horizon_quantile!r}")
        for name, value in (("block_tokens", block_tokens), ("max_sequences", max_sequences)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MarconiError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(half_life, bool) or not isinstance(half_life, (int, float)) or not half_life > 0 \
                or math.isinf(half_life):
            raise MarconiError(f"half_life must be a finite number > 0 (sequences), got {half_life!r}")
        self.block_tokens = block_tokens
        self.max_sequences = max_sequences
        self._decay = 0.5 ** (1.0 / half_life)
        self._by_prefix: OrderedDict[int, _Sequence] = OrderedDict()  # block-prefix hash -> its latest sequence
        self._by_end: dict[tuple[int, int], tuple[int, int]] = {}  # (length, last token) -> (depth, finished at)
        self._ends_log: list[tuple[int, int]] = []  # ends set or dropped in `_by_end`, in order (`ends_changed_since`)
        self._ends_logged_before = 0  # how many changes were logged before `_ends_log[0]`
        self.recorded = np.zeros(MAX_DEPTH + 1)  # decayed counts per depth
        self.continued = np.zeros(MAX_DEPTH + 1)
        self.finished = 0  # sequences recorded, ever
        self.settled_rates = (self.recorded.copy(), self.continued.copy())  # as of the last multiple of SETTLE_EVERY
        self.horizon_quantile = horizon_quantile
        self.gaps = np.zeros(GAP_BINS)  # counts of continuation gaps, bin = floor(2 log2 gap), decayed at settlements
        self.horizon = math.inf  # sequences finished after which a depth expires, as of the last settlement
        self._memo = (None, None)  # (tokens object, its hashes): one sequence hashed once for all readers

    def __len__(self) -> int:
        return len(self._by_prefix)

    def _hashes(self, tokens) -> list[int]:
        seen, hashes = self._memo
        if seen is tokens:
            return hashes
        hashes = prefix_hashes(tokens, self.block_tokens).tolist()  # Python ints: cheaper to look up one by one
        self._memo = (tokens, hashes)
        return hashes

    def depth_of(self, tokens, n: int | None = None) -> int:
        """The depth `finish` would give tokens[:n] now (no change to the record)."""
        found = self._extended(tokens, len(tokens) if n is None else n)
        return 0 if found is None else found[1].depth + 1

    def _extended(self, tokens, n: int):
        """The longest recorded sequence that tokens[:n] extends: (its key, its record), or None."""
        hashes = self._hashes(tokens)
        by_prefix = self._by_prefix
        for k in range(min(len(hashes), n // self.block_tokens), 0, -1):
            seq = by_prefix.get(hashes[k - 1])
            if seq is not None and seq.length < n and int(tokens[seq.length - 1]) == seq.last_token:
                return hashes[k - 1], seq
        return None

    def finish(self, tokens, n: int | None = None) -> int:
        """Record the finished sequence tokens[:n] (all of them by default); returns its depth."""
        n = len(tokens) if n is None else int(n)
        if n <= 0:
            return 0
        found = self._extended(tokens, n)
        depth = 0
        if found is not None:
            key, parent = found
            depth = parent.depth + 1
            self._by_prefix.move_to_end(key)
            if not parent.continued:
                parent.continued = True
                self.continued[min(parent.depth, MAX_DEPTH)] += 1.0
                self.gaps[gap_bin(self.finished - parent.finished_at)] += 1.0
        self.recorded *= self._decay
        self.continued *= self._decay
        self.recorded[min(depth, MAX_DEPTH)] += 1.0
        self.finished += 1
        if self.finished % SETTLE_EVERY == 0:
            self.settled_rates = (self.recorded.copy(), self.continued.copy())
            self.gaps *= self._decay ** SETTLE_EVERY  # decayed per settlement: one pass, not one per sequence
            self.horizon = horizon_of(self.gaps, self.horizon_quantile)
        last = int(tokens[n - 1])
        blocks = n // self.block_tokens
        if blocks:
            key = self._hashes(tokens)[blocks - 1]
            old = self._by_prefix.pop(key, None)
            if old is not None:
                self._forget_end(old)
            self._by_prefix[key] = _Sequence(n, last, depth, self.finished)
            self._set_end((n, last), (depth, self.finished))
            while len(self._by_prefix) > self.max_sequences:
                self._forget_end(self._by_prefix.popitem(last=False)[1])
        else:  # shorter than a block: nothing can be found to extend it, but its end has a depth
            self._set_end((n, last), (depth, self.finished))
            if len(self._by_end) > 2 * self.max_sequences:
                end = next(iter(self._by_end))
                del self._by_end[end]
                self._log_end(end)
        return depth

    def _set_end(self, end: tuple[int, int], row: tuple[int, int]) -> None:
        self._by_end[end] = row
        self._log_end(end)

    def _forget_end(self, seq: _Sequence) -> None:
        end = (seq.length, seq.last_token)
        if self._by_end.get(end) == (seq.depth, seq.finished_at):
            del self._by_end[end]
            self._log_end(end)

    def _log_end(self, end: tuple[int, int]) -> None:
        log = self._ends_log
        log.append(end)
        if len(log) > ENDS_LOG_KEPT:
            self._ends_logged_before += len(log)
            log.clear()

    def ends_changed_since(self, position: int) -> tuple[list | None, int]:
        """The ends whose row was set or dropped since `position` (a count of changes, as this
        returned last time; 0 at the start), or None if they are no longer all known; and the
        position now."""
        log, before = self._ends_log, self._ends_logged_before
        now = before + len(log)
        return (None if position < before else log[position - before:]), now

    def depth_at(self, end: int, last_token: int) -> int:
        """The depth of the recorded sequence ending at `end` with `last_token`; 0 if none, or if it
        was recorded more than `horizon` sequences ago."""
        found = self._by_end.get((end, last_token))
        if found is None or self.expired(found[1]):
            return 0
        return found[0]

    def expired(self, finished_at):
        """Whether a row recorded when `finished_at` sequences had finished (a number, or an array of
        them) is older than the horizon: its depth reads 0."""
        return self.finished - finished_at > self.horizon

    def rates(self) -> tuple[np.ndarray, np.ndarray]:
        """Per depth (0 .. MAX_DEPTH): decayed counts of sequences recorded and of those continued
        (now; `settled_rates`: as of the last multiple of SETTLE_EVERY sequences, what a rule that
        must not depend on when it asks reads)."""
        return self.recorded.copy(), self.continued.copy()

    def same_as(self, other: ContinuationRecord) -> bool:
        """Whether `other` holds the same record, in the same order (what is forgotten first), so
        that both answer alike from here on. O(sequences recorded)."""
        if self is other:
            return True
        return ((self.block_tokens, self.max_sequences, self._decay, self.finished, self.horizon_quantile, self.horizon)
                == (other.block_tokens, other.max_sequences, other._decay, other.finished, other.horizon_quantile,
                    other.horizon)
                and np.array_equal(self.recorded, other.recorded) and np.array_equal(self.continued, other.continued)
                and np.array_equal(self.gaps, other.gaps)
                and all(map(np.array_equal, self.settled_rates, other.settled_rates))
                and list(self._by_end.items()) == list(other._by_end.items())
                and len(self._by_prefix) == len(other._by_prefix)
                and all(k == j and (s.length, s.last_token, s.depth, s.continued, s.finished_at)
                        == (t.length, t.last_token, t.depth, t.continued, t.finished_at)
                        for (k, s), (j, t) in zip(self._by_prefix.items(), other._by_prefix.items())))

    def copy(self) -> ContinuationRecord:
        other = copy.copy(self)
        other._by_prefix = OrderedDict((k, copy.copy(v)) for k, v in self._by_prefix.items())
        other._by_end = dict(self._by_end)
        other.recorded, other.continued, other.gaps = self.recorded.copy(), self.continued.copy(), self.gaps.copy()
        other.settled_rates = tuple(a.copy() for a in self.settled_rates)
        other._memo = (None, None)
        other._ends_log, other._ends_logged_before = [], 0
        return other


class RecordedDepths:
    """The depths `ContinuationRecord.depth_at` gives a changing set of nodes, as one array per
    read, remembered per node between reads: a node's end and last token never change while it
    lives, so its remembered row (depth, finished at) goes stale only when the record sets or
    drops that end (`ends_changed_since`); expiry past the horizon is applied to all rows at
    once. Per read: one dictionary lookup per node, one record lookup per node not seen since
    its end changed. Nodes are known by their `id` (unique among a cache's nodes, never reused:
    the candidates' tie key), so that no node is kept alive. Memory: the nodes read, forgotten
    wholesale once they exceed a few times the nodes of one read."""

    def __init__(self, record: ContinuationRecord, end_of):
        """`end_of(node)`: (end, last token) of a node."""
        self.record, self.end_of = record, end_of
        self._reset(record.ends_changed_since(0)[1])

    def _reset(self, position: int) -> None:
        self._depth: dict[int, int] = {}  # node id -> the depth of its end's row (0 where its end is not recorded)
        self._at: dict[int, int] = {}  # node id -> when that row was recorded (finished count; 0 for none)
        self._ids_at: dict[tuple[int, int], list[int]] = {}  # end -> the nodes whose row was read from it
        self._position = position

    def __call__(self, nodes, population: int | None = None) -> np.ndarray:
        """Each node's `depth_at(*end_of(node))` now, as floats in the order given. `population`:
        how many nodes the caller reads from (all of `nodes` by default), which bounds what is
        remembered."""
        record = self.record
        changed, position = record.ends_changed_since(self._position)
        if changed is None or len(self._depth) > 4 * (len(nodes) if population is None else population) + 1024:
            self._reset(position)
        else:
            self._position = position
            depth_of, at, ids_at = self._depth, self._at, self._ids_at
            for end in changed:
                for node_id in ids_at.pop(end, ()):
                    del depth_of[node_id], at[node_id]
        ids = list(map(_node_id, nodes))
        depths = list(map(self._depth.get, ids))
        if None in depths:
            self._read(nodes, ids, depths)
        depth = np.array(depths, dtype=float)
        if math.isinf(record.horizon):
            return depth
        finished_at = np.fromiter(map(self._at.get, ids), dtype=float, count=len(ids))
        return np.where(record.expired(finished_at), 0.0, depth)

    def _read(self, nodes, ids: list[int], depths: list) -> None:
        by_end, end_of, depth_of, at, ids_at = (self.record._by_end, self.end_of, self._depth, self._at,
                                                self._ids_at)
        for i, depth in enumerate(depths):
            if depth is None:
                node_id = ids[i]
                end = end_of(nodes[i])
                row_depth, at[node_id] = by_end.get(end, (0, 0))
                depths[i] = depth_of[node_id] = row_depth
                ids_at.setdefault(end, []).append(node_id)


_node_id = operator.attrgetter("id")
