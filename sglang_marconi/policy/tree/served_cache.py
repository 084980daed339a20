"""The served cache, modeled: SGLang 0.5.23's `UnifiedRadixCache` (FULL + MAMBA components) with the
`marconi` backend, driven one request at a time through the scheduler's calls. Engine-free.

`HybridPrefixCache` is Marconi as the paper states it (one byte budget, a compressed tree, every
admission at a request's end). The server differs in ways that change which prefixes stay
reusable under eviction, so this model follows SGLang's own mechanics, call for call. It is a
configuration of the tree core: `core.PoolTree` (a `TreeCore`) holds the tree's mechanics (the
uncompressed tree, SGLang's recency counter, the two locks, the candidate sets and the eviction
walk under each pressure); this module brings the pools, the running request's flow (chunks, the
two Mamba strategies' tracking and admission, probation) and the value candidates are ranked by.

- Two pools: KV token slots (`kv_tokens`) and Mamba state slots (`mamba_slots`), each evicted
  under its own pressure. The request in flight holds what it allocated: its new KV (prefill
  chunk by chunk, then decode) and its Mamba slot(s) (1 in no_buffer mode; 1 + 2 ping-pong
  tracking slots in extra_buffer mode with overlap scheduling), so eviction happens when the
  request allocates, not when it finishes.
- Locks: a running request locks its reused prefix (the FULL KV of the path to the node it hit,
  and that node's state), not what it only overlaps; after each insert the lock moves to the node
  the insert ended on.
- The tree is SGLang's: a match splits the edge where the input leaves it; split points, tombstoned
  states and stateless leaves stay as nodes (a deleted leaf frees only its own edge).
- Recency is SGLang's counter (`get_and_increase_time_counter`), advanced exactly where SGLang
  advances it: two ticks per new node, a tick per split, per node an insert walks, per match; a
  match stamps the node hit and its ancestors (KV recency), a state's recency is when it was last
  committed or reused (Mamba recency, `serving/tree_index.py`).
- Victims (`serving/components.py`): under KV pressure the unlocked leaves (stateless ones with
  value 0), deleted whole; under Mamba pressure probationary states first (oldest), then unlocked
  states on nodes with at most one child (a leaf deleted whole, else the state tombstoned), else
  SGLang's least recently used unlocked state (`policy/rules/candidates.py`). The choice `lru` is
  SGLang's LRU: the oldest leaf, and under Mamba pressure the least recently used unlocked state on
  any node. Values (`policy/rules/value.py`): FLOPs saved back to the node's anchor (the nearest
  ancestor that holds a state, has several children or is the root) per byte freed; SegLen: that
  replay length. They are ranked as `CandidateIndex.lowest` ranks them (`policy/rules/score.py`), as
  in the server. The choice `coverage` (SGLang #38000's rule, `policy/rules/eviction/coverage.py`)
  ranks states by the positions each covers (ties to the least recent), leaves by recency alone.
- Admission (`serving/admission.py`, the rules in `policy/rules/branch_grid.py`): the branch state where
  two-pass prefill ends a chunk (no_buffer) or where extra_buffer snapshots it, the final state
  (extra_buffer: the last tracked one, the insert truncated there), and with probation the state at
  the end of the input, kept only in free room or room freed from other probationary states; and
  backtrack states (`policy/rules/backtrack_states.py`, `ServedPools.backtrack_states`): up to B
  more at chunk ends of a long replay, on probation too; in extra_buffer a match does not resume at
  one of them less than a snapshot step before where its input leaves the tree (`bars_resume`).
  In extra_buffer a request that resumed at an input-end state keeps its own as a regular state
  and its final state on probation (`policy/rules/input_end_resume.py`; `PoolNode.input_end`).

`serve` returns the hit SGLang reports (`req.prefix_len` after the match). `ServedPools.scaled`
shrinks the pools for a tuner's sampled shadows. `check_invariants` asserts the two ledgers and the
tree agree, and that between requests nothing is held or locked. The scheduler's calls modeled are those of `tests/serving/sglang_cpu.py` (one match per
request, page size 1); `scripts/check_sim_vs_served.py` compares the two request by request.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules import branch_grid, input_end_resume
from sglang_marconi.policy.rules import value as value_rule
from sglang_marconi.policy.rules.backtrack_states import BacktrackMarks, backtrack_rule_of, default_setting
from sglang_marconi.policy.rules.continuation import ContinuationRecord
from sglang_marconi.policy.rules.eviction.coverage import coverage_value, lowest_coverage_of
from sglang_marconi.policy.rules.eviction.depth import depth_rule_of
from sglang_marconi.policy.tree.core import PoolTree
from sglang_marconi.policy.tree.radix_tree import PoolNode, as_token_array
from sglang_marconi.policy.tree.small_candidates import SmallCandidateIndex

NO_BUFFER, EXTRA_BUFFER = "no_buffer", "extra_buffer"
STRATEGIES = (NO_BUFFER, EXTRA_BUFFER)
LRU = "lru"  # the shadow tuner's name for SGLang's LRU (policy/tuning/shadow_tuner.py)
COVERAGE = "coverage"  # its name for SGLang #38000's rule (`eviction/coverage.py`)
_holds_state = operator.attrgetter("has_state")
_end_of = operator.attrgetter("end")
_id_of = operator.attrgetter("id")


@dataclass(frozen=True)
class ServedPools:
    """What the live cache was given, as SGLang sizes it."""

    kv_tokens: int  # the KV pool's token slots
    mamba_slots: int  # the Mamba pool's state slots (request slots and cached states alike)
    strategy: str = NO_BUFFER  # --mamba-radix-cache-strategy
    chunk_size: int | None = None  # --chunked-prefill-size (None: one extend per prompt)
    snapshot_step: int = 64  # extra_buffer: mamba_cache_chunk_size, the prefill snapshot grid
    decode_snapshot_step: int = 256  # extra_buffer: mamba_track_grid, decode snapshots
    tracking_slots: int = 2  # extra_buffer: ping-pong track slots per running request (overlap on)
    backtrack_states: int | None = None  # extra states per request (`rules/backtrack_states.py`; None: its default)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise MarconiError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("kv_tokens", "mamba_slots", "snapshot_step", "decode_snapshot_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise MarconiError(f"{name} must be a positive integer, got {value!r}")
        backtrack_rule_of(self.backtrack_setting)  # a bad count raises here
        if self.chunk_size is not None and (not isinstance(self.chunk_size, (int, np.integer)) or self.chunk_size < 1):
            raise MarconiError(f"chunk_size must be a positive integer or None, got {self.chunk_size!r}")
        if self.mamba_slots < self.request_slots + 1:
            raise MarconiError(f"mamba_slots={self.mamba_slots}: a running request holds {self.request_slots} "
                               f"and a state needs one more")

    @property
    def extra_buffer(self) -> bool:
        return self.strategy == EXTRA_BUFFER

    @property
    def request_slots(self) -> int:
        """Mamba slots a running request holds."""
        return 1 + (self.tracking_slots if self.extra_buffer else 0)

    @property
    def backtrack_setting(self):
        """The backtrack states in force: the one given, else the rule's default for the strategy."""
        return default_setting(self.extra_buffer) if self.backtrack_states is None else self.backtrack_states

    def scaled(self, rate: float) -> ServedPools:
        """The pools at `rate` of their size (a tuner's sampled shadows)."""
        if rate >= 1:
            return self
        return ServedPools(max(1, int(self.kv_tokens * rate)),
                           max(self.request_slots + 1, round(self.mamba_slots * rate)), self.strategy,
                           self.chunk_size, self.snapshot_step, self.decode_snapshot_step, self.tracking_slots,
                           self.backtrack_states)


@dataclass
class ServedCounters:
    evictions_leaf: int = 0
    evictions_single_child: int = 0
    evictions_fallback: int = 0
    evictions_probationary: int = 0
    branch_states_admitted: int = 0
    final_states_admitted: int = 0
    probationary_admitted: int = 0
    backtrack_admitted: int = 0
    input_end_states_kept: int = 0  # regular, by `rules/input_end_resume.py`
    skipped_no_slot: int = 0


@dataclass(frozen=True)
class ServedOutcome:
    hit_tokens: int  # the prefix reused (SGLang's req.prefix_len after the match)
    overlap_tokens: int  # the full-KV match
    states_admitted: int


@dataclass
class _Request:
    """One running request's bookkeeping (SGLang's `req.kv` and `req.marconi`)."""

    n_in: int
    prefix_len: int  # tokens whose KV the request has (the match, then each extend)
    resumed_at: int  # the state its match reused
    protected: int  # req.kv.cache_protected_len: the prefix the tree owns
    branch: int | None
    lock: PoolNode | None = None
    slots: int = 0  # Mamba slots held
    last_track: int | None = None  # extra_buffer: the latest snapshot's position
    probation_node: PoolNode | None = None
    admitted: int = 0
    backtrack_taken: int = 0  # backtrack states offered to the tree (`rules/backtrack_states.py`)
    offered: int = 0  # states its checkpoints offered to the tree (inserted, new or not)
    resumed_input_end: bool = False  # its match reused an input-end state (`rules/input_end_resume.py`)


@dataclass
class ServedEvent:
    """One eviction, for diagnosing a disagreement (`ServedCache.events`)."""

    request: int
    pressure: str  # "kv" or "mamba"
    kind: str  # "leaf", "single_child", "probationary", "fallback"
    start: int
    end: int


class ServedCache(PoolTree):
    """See the module docstring. `choice`: "lru", an alpha (FLOP-aware), "seglen:W", "coverage"
    (`eviction/coverage.py`), or "depth:B" / "depth:auto" (`eviction/depth.py`, over the record this
    cache feeds: `continuation`)."""

    def __init__(self, profile, pools: ServedPools, choice=0.0, *, probation: bool = True, record: bool = False):
        if int(profile.ssm_state_bytes) <= 0:
            raise MarconiError(f"{profile.name} has no SSM state: the served Mamba cache does not apply")
        self.pools = pools
        self._extra_buffer = pools.extra_buffer  # read per chunk
        self._configure_pools(profile, pools.kv_tokens, pools.mamba_slots, probation=probation,
                              counters=ServedCounters())
        self.served = 0
        # extra states at chunk ends, on probation (needs probation: they live in its registry)
        rule = backtrack_rule_of(pools.backtrack_setting) if probation else None
        self.backtrack = rule if rule is not None and rule.applies(pools.mamba_slots, pools.request_slots) else None
        self.backtrack_marks = BacktrackMarks()  # which probationary states are backtrack states
        # a turn that resumed at an input-end state keeps its own, its final state on probation
        self.input_end_rule = input_end_resume.applies(pools.extra_buffer, probation)
        self.events: list[ServedEvent] | None = [] if record else None
        # Finished sequences, as far as each request's last insert kept it (`rules/continuation.py`):
        # kept from the first depth choice on, fed once per request at its release.
        self.continuation: ContinuationRecord | None = None
        self.set_choice(choice)

    # -- the rule in force -------------------------------------------------------------------
    def set_choice(self, choice) -> None:
        self.depth_rule = depth_rule_of(choice, self.continuation)
        if self.depth_rule is not None:
            # the record of finished sequences outlives a switch of rule (it is the stream's)
            self.continuation = self.depth_rule.record
            self.kind, self.weight = "depth", 0.0
        elif choice == LRU:
            self.kind, self.weight = "lru", 0.0
        elif choice == COVERAGE:  # fewest positions covered first, ties by recency: no weight
            self.kind, self.weight = "coverage", 0.0
        elif isinstance(choice, str) and choice.startswith("seglen:"):
            self.kind, self.weight = "seglen", float(choice.partition(":")[2])
        else:
            self.kind, self.weight = "flops", float(choice)
        self.lru_states = self.kind == LRU
        self.choice = choice

    def _lowest_of(self, nodes: list, recency: list, values: list):
        """The victim among the candidates: the depth rule's (`eviction/depth.py`), coverage's
        (`eviction/coverage.py`, ranked only under state pressure), else the weighted score's."""
        if self.depth_rule is None:
            if self.kind == "coverage":
                return lowest_coverage_of(nodes, values, recency, _id_of)
            return super()._lowest_of(nodes, recency, values)
        index = SmallCandidateIndex(tie_key=SmallCandidateIndex.node_id)
        for node, stamp in zip(nodes, recency):
            index.add(node, stamp, 0.0)
        return self.depth_rule.choose(index)

    @property
    def _ranks_recency_alone(self) -> bool:
        return self.depth_rule is None and not self.weight and self.kind != "coverage"

    @property
    def _kv_ranks_recency_alone(self) -> bool:
        return self._ranks_recency_alone or self.kind == "coverage"  # coverage: recency alone over the leaves

    @property
    def _reads_values(self) -> bool:
        return self.depth_rule is None  # the depth rule ranks by recency and the record

    def _candidate_value(self, node, leaf: bool) -> float:
        """FLOPs saved back to the node's anchor per byte freed (`policy/rules/value.py`), with
        SegLen that replay length, with coverage the positions its state covers (the depth rule
        reads none: `_reads_values`)."""
        if self.kind == "coverage":
            return coverage_value(node)  # over the tree core's nodes: its own readers
        start, end = value_rule.anchor_end(node, self.tree.root, _holds_state, _end_of), node.end
        if self.kind == "seglen":
            return float(end - start)
        return value_rule.flops_saved_per_byte(self.flops(start, end), self.ssm_state_bytes,
                                               self.kv_bytes_per_token * (end - start) if leaf else 0)

    def _record(self, pressure: str, kind: str, node) -> None:
        if self.events is not None:
            self.events.append(ServedEvent(self.served, pressure, kind, node.start, node.end))

    # -- ledgers -----------------------------------------------------------------------------
    @property
    def tree_kv(self) -> int:
        return self.kv_tokens

    @property
    def tree_states(self) -> int:
        return self.ssm_states

    @property
    def kv_used(self) -> int:
        """Tree KV + what the running request holds."""
        return self.kv_tokens + self.held_kv

    @property
    def mamba_used(self) -> int:
        """Tree states + the running request's slots + a state being inserted."""
        return self.ssm_states + self.held_states

    @property
    def mamba_free(self) -> int:
        return self.state_free

    # -- one request ---------------------------------------------------------------------------
    def serve(self, input_tokens, output_tokens) -> ServedOutcome:
        """One request: match, prefill (chunked, cut for the branch), first token, decode, release.
        `output_tokens` are every decoded token; the cache keeps input + output[:-1] (the last one
        was never fed back)."""
        inp = as_token_array(input_tokens)
        out = np.asarray(output_tokens, dtype=np.int64)
        seq = np.concatenate((inp, out[:-1])) if len(out) > 1 else inp
        return self.serve_kept(seq, len(inp))

    def serve_kept(self, seq: np.ndarray, n_in: int) -> ServedOutcome:
        """`serve` of a request given as what the cache keeps of it: input + output[:-1] (`seq`,
        what the runtime feeds the tuner) and the input's length."""
        n_out = len(seq) - n_in + 1
        pools = self.pools
        extra = self._extra_buffer
        step = pools.snapshot_step if extra else None
        # Req.init_next_round_input: match input[:n_in - 1], copy-on-write the state hit
        best, full_hit = self._match_reused(seq[: n_in - 1], self._barred if self.backtrack_marks else None)
        hit = best.end
        req = _Request(n_in, hit, hit, hit, branch_grid.branch_position(full_hit, hit))
        req.resumed_input_end = self.input_end_rule and best.has_state and best.input_end
        if best.has_state:
            if self.state_free < 1:
                self.lock_reused(best)
                self._free_up(states=1)
                self.unlock_reused(best)
            self._alloc_slots(req, 1)
        # prefill, chunk by chunk
        first = True
        while True:
            end = n_in if pools.chunk_size is None else min(req.prefix_len + pools.chunk_size, n_in)
            end = branch_grid.chunk_end(req.branch, req.prefix_len, end, step, n_in)
            self._extend(req, end, best if first else None)
            first = False
            if extra:
                self._track_extend(req, end)
            if end == n_in:
                break
            self._checkpoint(req, seq, end, finished=False)
            req.prefix_len = end
        if n_out > 1:  # the first token; a request that goes on checkpoints its input
            self._checkpoint(req, seq, n_in, finished=False)
            req.prefix_len = n_in
            self._alloc_kv(req, n_out - 1)  # decode (allocated at once: the same victims)
            if extra:
                grid = pools.decode_snapshot_step
                boundary = (n_in // grid + 1) * grid
                if boundary <= n_in + n_out - 1:
                    req.last_track = (n_in + n_out - 1) // grid * grid
        # release_kv_cache(checkpoint=True)
        kept = self._checkpoint(req, seq, len(seq), finished=True)
        if self.continuation is not None:
            self.continuation.finish(seq, kept)
        self.held_kv = 0  # what the tree did not take is freed
        if req.lock is not None:
            self.unlock_reused(req.lock)
            req.lock = None
        self.served += 1
        return ServedOutcome(hit, full_hit, req.admitted)

    def _barred(self, walk) -> set:
        """The backtrack states on `walk`'s path a match may not resume at (`BacktrackMarks.bars`)."""
        step = self.pools.snapshot_step if self._extra_buffer else None
        kv_match = self.tree.page_aligned(walk.overlap)
        return {node for node in walk.path
                if self.backtrack_marks.bars(node, node.end, kv_match, step, self._probation)}

    def _extend(self, req: _Request, end: int, lock: PoolNode | None) -> None:
        if lock is not None:  # the first extend locks the prefix the match reused
            req.lock = lock
            self.lock_reused(lock)
            needed = (0 if req.slots else 1) + (self.pools.tracking_slots if self.pools.extra_buffer else 0)
            if needed:
                if self.state_free < needed:
                    self._free_up(states=needed - self.state_free)
                if self.state_free < needed:
                    raise MarconiError("out of Mamba slots for a running request (SGLang: alloc_req_slots fails)")
                self._alloc_slots(req, needed)
        self._alloc_kv(req, end - req.prefix_len)

    def _alloc_slots(self, req: _Request, k: int) -> None:
        assert self.state_free >= k
        self.held_states += k
        req.slots += k

    def _alloc_kv(self, req: _Request, n: int) -> None:
        if n <= 0:
            return
        free = self.kv_free
        if free < n:
            self._free_up(kv=n - free)
            free = self.kv_free
            if free < n:
                raise MarconiError(f"out of KV slots: {n} needed, {free} free after eviction "
                                   f"(SGLang: alloc_token_slots fails)")
        self.held_kv += n

    def _track_extend(self, req: _Request, end: int) -> None:
        """ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend, with Marconi's steering."""
        step = self.pools.snapshot_step
        start = req.prefix_len
        length = end - start
        if length < step:
            return
        position = start + length // step * step
        branch = req.branch
        steered = branch_grid.tracked_position(branch, start, end, step)
        if steered is not None:
            branch = steered
        if branch is not None and start < branch < end and (branch - start) % step == 0:
            position = branch
        req.last_track = position

    # -- checkpoints (SGLang's checkpoint_into_tree + Marconi's admission) ------------------------
    def _checkpoint(self, req: _Request, seq: np.ndarray, token_len: int, finished: bool) -> int:
        """Returns the tokens the insert kept (0: none inserted)."""
        pools = self.pools
        extra = self._extra_buffer
        c = self.counters
        probationary = backtrack = False
        if finished:
            probationary = input_end_resume.final_on_probation(req.resumed_input_end)
            if extra:
                cache_len = req.last_track or 0
            else:
                cache_len = token_len
            if cache_len:
                c.final_states_admitted += 1
            elif req.probation_node is not None:
                node, req.probation_node = req.probation_node, None
                if node.has_state and self._probation.confirm(node):
                    c.final_states_admitted += 1
            pending = 0  # the request's own slot is donated: no new slot
        else:
            position = req.last_track if extra else token_len
            step = pools.snapshot_step if extra else None
            admits = branch_grid.admits_branch_state(req.branch, position, token_len, step)
            input_end_kept = not admits and input_end_resume.keeps_input_end_regular(
                req.resumed_input_end, token_len, req.n_in, position)
            admits = admits or input_end_kept
            probationary = (not admits and self.probation and position is not None and position > 0
                            and token_len == req.n_in and self._reserve_slot(probation_only=True))
            backtrack = (not admits and not probationary and token_len < req.n_in and self.backtrack is not None
                         and not branch_grid.snapshot_carries_to_input_end(token_len, req.n_in, step)
                         and self.backtrack.admits(position, req.protected, req.resumed_at, req.n_in,
                                                   req.backtrack_taken, req.offered, pools.chunk_size, self.flops)
                         and self._reserve_slot(probation_only=True))
            probationary = probationary or backtrack
            if not admits and not probationary:
                return 0  # nothing inserted; Marconi's cleanup keeps the tracked state
            if admits and not extra and not self._reserve_slot():
                c.skipped_no_slot += 1
                req.last_track = None
                return 0
            cache_len = position if extra else token_len
            if not cache_len:
                req.last_track = None
                return 0
            if self.state_free < 1:  # MambaComponent._alloc_mamba_slot
                self._free_up(states=1)
            if self.state_free < 1:
                raise MarconiError("out of Mamba slots for a checkpoint (SGLang: _alloc_mamba_slot asserts)")
            self.held_states += 1
            pending = 1
            req.offered += 1
            if probationary:
                c.probationary_admitted += 1  # backtrack states included
            elif input_end_kept:
                c.input_end_states_kept += 1
            else:
                c.branch_states_admitted += 1
            if backtrack:
                req.backtrack_taken += 1
                c.backtrack_admitted += 1
        length = min(token_len, cache_len)
        if length <= 0:
            self._release_request_slots(req, finished, inserted=False)
            return 0
        target, exists, _ = self._insert_state(seq[:length], probationary)
        # KV: of [protected, length), the part the tree held already was a duplicate (freed), the
        # rest is the tree's now; a new state's slot (pending, or the request's own) is the tree's
        self.held_kv -= length - req.protected
        if not exists:
            self.held_states -= 1
        if req.lock is not None:
            self.unlock_reused(req.lock)
        req.lock = target
        self.lock_reused(target)
        req.protected = length
        if probationary and not exists:
            req.probation_node = target
            if self.backtrack is not None:
                self.backtrack_marks.mark(target, backtrack, self._probation)
        if not exists:
            req.admitted += 1
            target.input_end = input_end_resume.marks_input_end(finished, token_len, req.n_in)
        if finished:
            self._release_request_slots(req, finished, inserted=not exists)
        else:
            if exists:
                self.held_states -= pending
            req.last_track = None
        return length

    def _release_request_slots(self, req: _Request, finished: bool, inserted: bool) -> None:
        """The request's Mamba slots go back; with `inserted`, one of them became the tree's state."""
        if not finished:
            req.last_track = None
            return
        self.held_states -= req.slots - (1 if inserted else 0)
        req.slots = 0

    def _reserve_slot(self, probation_only: bool = False) -> bool:
        """MarconiAdmission._marconi_reserve_slot."""
        if self.state_free >= 1:
            return True
        if probation_only and not self._probation:
            return False
        self._free_up(states=1, probation_only=probation_only)
        return self.state_free >= 1

    def peek_hit(self, input_tokens) -> int:
        """The hit `serve` would report for this input, changing nothing."""
        key = as_token_array(input_tokens)[: len(input_tokens) - 1]
        if not len(key):
            return 0
        walk = self.tree.walk(key)
        barred = self._barred(walk) if self.backtrack_marks else ()
        hit = 0
        for node in walk.path:
            if node.has_state and node not in barred:
                hit = node.end
        return hit

    def may_evict(self, n_in: int, n_kept: int) -> bool:
        """Whether serving a request of `n_in` input tokens that keeps `n_kept` could evict: it
        allocates at most its kept tokens + 1 KV slots and its own slots + 2 Mamba slots (a branch
        state and a probationary one)."""
        return self.kv_free < n_kept + 1 or self.state_free < self.pools.request_slots + 2

    # -- copies and checks -----------------------------------------------------------------------
    def copy(self, choice=None) -> ServedCache:
        """An independent copy (a tuner's shadows fork from one), optionally under another choice."""
        # the profile and the FLOPs memo (a function of the profile) are shared, not copied
        clone = copy.deepcopy(self, {id(self.profile): self.profile, id(self.flops): self.flops})
        if choice is not None:
            clone.set_choice(choice)
        return clone

    def _same_rest(self, other: ServedCache, twin: dict) -> bool:
        """`same_contents` of two models of SGLang's cache: beyond the tree, the same pools and
        choice, the same backtrack states on probation, the same input-end states
        (`rules/input_end_resume.py`) and, under a depth choice, the same record."""
        if self.pools != other.pools or self.choice != other.choice or not super()._same_rest(other, twin):
            return False
        probation = self._probation
        marked = {twin[n.id].id for n in self.backtrack_marks.nodes() if n in probation}
        if marked != {n.id for n in other.backtrack_marks.nodes() if n in other._probation}:
            return False
        if any(n.input_end != twin[n.id].input_end for n in self.tree.nodes() if n.has_state):
            return False
        return self.depth_rule is None or self.continuation.same_as(other.continuation)

    def states_on_path(self, tokens) -> list[int]:
        """Depths along `tokens` where this cache holds a state (diagnosis)."""
        return [node.end for node in self._whole_edges(as_token_array(tokens)) if node.has_state]

    def check_invariants(self) -> None:
        """The tree, its candidate sets and the two ledgers agree, and between requests nothing is
        held or locked."""
        super().check_invariants()
        assert self.held_kv == 0 and self.held_states == 0, (self.held_kv, self.held_states)
        for node in self.tree.nodes():
            assert node.lock_count == 0 and node.state_lock == 0, f"locked while idle: {node!r}"
