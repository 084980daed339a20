"""The served cache, modeled: SGLang 0.5.23's `UnifiedRadixCache` (FULL + MAMBA components) with the
`marconi` backend, driven one request at a time through the scheduler's calls. Engine-free.

`HybridPrefixCache` is Marconi as the paper states it (one byte budget, a compressed tree, every
admission at a request's end). The server differs in ways that change which prefixes stay
reusable under eviction, so this model follows SGLang's own mechanics, call for call:

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
  replay length. `CandidateIndex.lowest` ranks them (`policy/rules/score.py`), as in the server.
- Admission (`serving/admission.py`, the rules in `policy/rules/branch_grid.py`): the branch state where
  two-pass prefill ends a chunk (no_buffer) or where extra_buffer snapshots it, the final state
  (extra_buffer: the last tracked one, the insert truncated there), and with probation the state at
  the end of the input, kept only in free room or room freed from other probationary states.

`serve` returns the hit SGLang reports (`req.prefix_len` after the match). `ServedPools.scaled`
shrinks the pools for a tuner's sampled shadows. `check_invariants` asserts the two ledgers and the
tree agree. The scheduler's calls modeled are those of `tests/serving/sglang_cpu.py` (one match per
request, page size 1); `scripts/check_sim_vs_served.py` compares the two request by request.
"""

from __future__ import annotations

import copy
import operator
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules import branch_grid, candidates
from sglang_marconi.policy.rules import value as value_rule
from sglang_marconi.policy.rules.probation import ProbationRegistry
from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.tree.radix_tree import as_token_array

NO_BUFFER, EXTRA_BUFFER = "no_buffer", "extra_buffer"
STRATEGIES = (NO_BUFFER, EXTRA_BUFFER)
LRU = "lru"  # the shadow tuner's name for SGLang's LRU (policy/tuning/shadow_tuner.py)
_STAMP_STEP = 0.00001  # a match stamps ancestors this much older, level by level (SGLang's)
_holds_state = operator.attrgetter("state")
_end_of = operator.attrgetter("end")
_node_id = operator.attrgetter("id")


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

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise MarconiError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("kv_tokens", "mamba_slots", "snapshot_step", "decode_snapshot_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise MarconiError(f"{name} must be a positive integer, got {value!r}")
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

    def scaled(self, rate: float) -> ServedPools:
        """The pools at `rate` of their size (a tuner's sampled shadows)."""
        if rate >= 1:
            return self
        return ServedPools(max(1, int(self.kv_tokens * rate)),
                           max(self.request_slots + 1, round(self.mamba_slots * rate)), self.strategy,
                           self.chunk_size, self.snapshot_step, self.decode_snapshot_step, self.tracking_slots)


@dataclass
class ServedCounters:
    evictions_leaf: int = 0
    evictions_single_child: int = 0
    evictions_fallback: int = 0
    evictions_probationary: int = 0
    branch_states_admitted: int = 0
    final_states_admitted: int = 0
    probationary_admitted: int = 0
    skipped_no_slot: int = 0


@dataclass(frozen=True)
class ServedOutcome:
    hit_tokens: int  # the prefix reused (SGLang's req.prefix_len after the match)
    overlap_tokens: int  # the full-KV match
    states_admitted: int


class _Node:
    __slots__ = ("id", "parent", "children", "tokens", "end", "state", "full_lock", "mamba_lock",
                 "last_access", "state_time")

    def __init__(self, node_id: int, parent, tokens: np.ndarray, end: int, stamp: float):
        self.id = node_id
        self.parent = parent
        self.children: dict = {}
        self.tokens = tokens
        self.end = end
        self.state = False
        self.full_lock = 0
        self.mamba_lock = 0
        self.last_access = stamp
        self.state_time: float | None = None

    @property
    def start(self) -> int:
        return self.end - len(self.tokens)

    def __repr__(self) -> str:
        return f"Node(id={self.id}, [{self.start},{self.end}), state={self.state}, children={len(self.children)})"


@dataclass
class _Request:
    """One running request's bookkeeping (SGLang's `req.kv` and `req.marconi`)."""

    n_in: int
    prefix_len: int  # tokens whose KV the request has (the match, then each extend)
    protected: int  # req.kv.cache_protected_len: the prefix the tree owns
    branch: int | None
    lock: _Node | None = None
    private_kv: int = 0  # KV slots allocated and not (yet) the tree's
    slots: int = 0  # Mamba slots held
    last_track: int | None = None  # extra_buffer: the latest snapshot's position
    probation_node: _Node | None = None
    admitted: int = 0


@dataclass
class ServedEvent:
    """One eviction, for diagnosing a disagreement (`ServedCache.events`)."""

    request: int
    pressure: str  # "kv" or "mamba"
    kind: str  # "leaf", "single_child", "probationary", "fallback"
    start: int
    end: int


class ServedCache:
    """See the module docstring. `choice`: "lru", an alpha (FLOP-aware) or "seglen:W"."""

    def __init__(self, profile, pools: ServedPools, choice=0.0, *, probation: bool = True, record: bool = False):
        self.profile = profile
        self.pools = pools
        self.probation = probation
        self.kv_bytes_per_token = int(profile.kv_bytes_per_token)
        self.ssm_state_bytes = int(profile.ssm_state_bytes)
        if self.ssm_state_bytes <= 0:
            raise MarconiError(f"{profile.name} has no SSM state: the served Mamba cache does not apply")
        self.counters = ServedCounters()
        self._clock = 0.0
        self._next_id = 0
        self.root = self._new_node(None, np.empty(0, dtype=np.int64), 0)
        self.kv_used = 0  # tree KV + what the running request holds
        self.tree_kv = 0
        self.mamba_used = 0  # tree states + the running request's slots + a state being inserted
        self.tree_states = 0
        self._mamba_lru: OrderedDict[int, _Node] = OrderedDict()  # stated nodes, least recent first
        self._childless: dict[int, _Node] = {}  # nodes without children (leaves, locked or not)
        self._probation = ProbationRegistry()
        self._flops: dict[tuple[int, int], float] = {}
        self.served = 0
        self.events: list[ServedEvent] | None = [] if record else None
        self.set_choice(choice)

    # -- the rule in force -------------------------------------------------------------------
    def set_choice(self, choice) -> None:
        if choice == LRU:
            self.kind, self.weight = "lru", 0.0
        elif isinstance(choice, str) and choice.startswith("seglen:"):
            self.kind, self.weight = "seglen", float(choice.partition(":")[2])
        else:
            self.kind, self.weight = "flops", float(choice)
        self.choice = choice

    # -- ledgers -----------------------------------------------------------------------------
    @property
    def kv_free(self) -> int:
        return self.pools.kv_tokens - self.kv_used

    @property
    def mamba_free(self) -> int:
        return self.pools.mamba_slots - self.mamba_used

    @property
    def kv_tokens(self) -> int:
        return self.tree_kv

    @property
    def ssm_states(self) -> int:
        return self.tree_states

    def _tick(self) -> float:
        t = self._clock
        self._clock += 1.0
        return t

    def _new_node(self, parent, tokens, end) -> _Node:
        node = _Node(self._next_id, parent, tokens, end, 0.0)
        self._next_id += 1
        node.last_access = self._tick()  # UnifiedTreeNode: last_access_time, then creation_time
        self._tick()
        return node

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
        step = pools.snapshot_step if pools.extra_buffer else None
        # Req.init_next_round_input: match input[:n_in - 1], copy-on-write the state hit
        best, full_hit = self._match(seq[: n_in - 1])
        hit = best.end
        req = _Request(n_in, hit, hit, branch_grid.branch_position(full_hit, hit))
        if best.state:
            if self.mamba_free < 1:
                self._lock(best)
                self._evict(mamba=1)
                self._unlock(best)
            self._alloc_slots(req, 1)
        # prefill, chunk by chunk
        first = True
        while True:
            end = n_in if pools.chunk_size is None else min(req.prefix_len + pools.chunk_size, n_in)
            end = branch_grid.chunk_end(req.branch, req.prefix_len, end, step)
            self._extend(req, end, best if first else None)
            first = False
            if pools.extra_buffer:
                self._track_extend(req, end)
            if end == n_in:
                break
            self._checkpoint(req, seq, end, finished=False)
            req.prefix_len = end
        if n_out > 1:  # the first token; a request that goes on checkpoints its input
            self._checkpoint(req, seq, n_in, finished=False)
            req.prefix_len = n_in
            self._alloc_kv(req, n_out - 1)  # decode (allocated at once: the same victims)
            if pools.extra_buffer:
                grid = pools.decode_snapshot_step
                boundary = (n_in // grid + 1) * grid
                if boundary <= n_in + n_out - 1:
                    req.last_track = (n_in + n_out - 1) // grid * grid
        # release_kv_cache(checkpoint=True)
        self._checkpoint(req, seq, len(seq), finished=True)
        self.kv_used -= req.private_kv
        req.private_kv = 0
        if req.lock is not None:
            self._unlock(req.lock)
            req.lock = None
        self.served += 1
        return ServedOutcome(hit, full_hit, req.admitted)

    def _extend(self, req: _Request, end: int, lock: _Node | None) -> None:
        if lock is not None:  # the first extend locks the prefix the match reused
            req.lock = lock
            self._lock(lock)
            needed = (0 if req.slots else 1) + (self.pools.tracking_slots if self.pools.extra_buffer else 0)
            if needed:
                if self.mamba_free < needed:
                    self._evict(mamba=needed - self.mamba_free)
                if self.mamba_free < needed:
                    raise MarconiError("out of Mamba slots for a running request (SGLang: alloc_req_slots fails)")
                self._alloc_slots(req, needed)
        self._alloc_kv(req, end - req.prefix_len)

    def _alloc_slots(self, req: _Request, k: int) -> None:
        assert self.mamba_free >= k
        self.mamba_used += k
        req.slots += k

    def _alloc_kv(self, req: _Request, n: int) -> None:
        if n <= 0:
            return
        if self.kv_free < n:
            self._evict(kv=n - self.kv_free)
        if self.kv_free < n:
            raise MarconiError(f"out of KV slots: {n} needed, {self.kv_free} free after eviction "
                               f"(SGLang: alloc_token_slots fails)")
        self.kv_used += n
        req.private_kv += n

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
    def _checkpoint(self, req: _Request, seq: np.ndarray, token_len: int, finished: bool) -> None:
        pools = self.pools
        extra = pools.extra_buffer
        c = self.counters
        probationary = False
        if finished:
            if extra:
                cache_len = req.last_track or 0
            else:
                cache_len = token_len
            if cache_len:
                c.final_states_admitted += 1
            elif req.probation_node is not None:
                node, req.probation_node = req.probation_node, None
                if node.state and self._probation.confirm(node):
                    c.final_states_admitted += 1
            pending = 0  # the request's own slot is donated: no new slot
        else:
            position = req.last_track if extra else token_len
            step = pools.snapshot_step if extra else None
            admits = branch_grid.admits_branch_state(req.branch, position, token_len, step)
            probationary = (not admits and self.probation and position is not None and position > 0
                            and token_len == req.n_in and self._reserve_slot(probation_only=True))
            if not admits and not probationary:
                return  # nothing inserted; Marconi's cleanup keeps the tracked state
            if admits and not extra and not self._reserve_slot():
                c.skipped_no_slot += 1
                req.last_track = None
                return
            cache_len = position if extra else token_len
            if not cache_len:
                req.last_track = None
                return
            if self.mamba_free < 1:  # MambaComponent._alloc_mamba_slot
                self._evict(mamba=1)
            if self.mamba_free < 1:
                raise MarconiError("out of Mamba slots for a checkpoint (SGLang: _alloc_mamba_slot asserts)")
            self.mamba_used += 1
            pending = 1
            if probationary:
                c.probationary_admitted += 1
            else:
                c.branch_states_admitted += 1
        length = min(token_len, cache_len)
        if length <= 0:
            self._release_request_slots(req, finished, inserted=False)
            return
        target, exists, overlap_end = self._insert(seq[:length], probationary)
        # KV: [protected, overlap_end) were duplicates of the tree's (freed); the rest is the tree's now
        self.kv_used -= overlap_end - req.protected
        req.private_kv -= length - req.protected
        self.tree_kv += length - overlap_end
        if req.lock is not None:
            self._unlock(req.lock)
        req.lock = target
        self._lock(target)
        req.protected = length
        if probationary and not exists:
            req.probation_node = target
        if not exists:
            req.admitted += 1
        if finished:
            self._release_request_slots(req, finished, inserted=not exists)
        else:
            if exists:
                self.mamba_used -= pending
            req.last_track = None

    def _release_request_slots(self, req: _Request, finished: bool, inserted: bool) -> None:
        """The request's Mamba slots go back; with `inserted`, one of them became the tree's state."""
        if not finished:
            req.last_track = None
            return
        self.mamba_used -= req.slots - (1 if inserted else 0)
        req.slots = 0

    def _reserve_slot(self, probation_only: bool = False) -> bool:
        """MarconiAdmission._marconi_reserve_slot."""
        if self.mamba_free >= 1:
            return True
        if probation_only and not self._probation:
            return False
        self._evict(mamba=1, probation_only=probation_only)
        return self.mamba_free >= 1

    # -- the tree --------------------------------------------------------------------------------
    @staticmethod
    def _common(edge: np.ndarray, seq: np.ndarray, pos: int) -> int:
        lim = min(len(edge), len(seq) - pos)
        eq = edge[:lim] == seq[pos: pos + lim]
        return lim if eq.all() else int(eq.argmin())

    def _match(self, key: np.ndarray) -> tuple[_Node, int]:
        """UnifiedTreeCore.match_prefix (+ Marconi's exact branch): (node hit, full-KV match)."""
        node, pos, best = self.root, 0, self.root
        if not len(key):
            return best, 0  # SGLang's empty match result: nothing walked, nothing stamped
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            m = self._common(child.tokens, key, pos)
            pos += m
            if m < len(child.tokens):
                node = self._split(child, m)
                break
            node = child
            if node.state:
                best = node
        if best.state:  # MATCH_END: the state reused is refreshed (and confirmed)
            self._mamba_lru.move_to_end(best.id)
            best.state_time = self._tick()
            self._probation.confirm(best)
        stamp = self._tick()
        n = best
        while n is not None:
            n.last_access = stamp
            stamp -= _STAMP_STEP
            n = n.parent
        return best, pos

    def _split(self, child: _Node, k: int) -> _Node:
        parent = child.parent
        head = self._new_node(parent, child.tokens[:k], child.start + k)
        head.full_lock = child.full_lock
        parent.children[int(child.tokens[0])] = head
        child.tokens = child.tokens[k:]
        child.parent = head
        head.children[int(child.tokens[0])] = child
        child.last_access = self._tick()
        return head

    def _insert(self, key: np.ndarray, probationary: bool) -> tuple[_Node, bool, int]:
        """UnifiedTreeCore insert with a Mamba state at its end: (node, state existed, overlap)."""
        self._tick()  # begin_insert touches the root
        node, pos = self.root, 0
        n = len(key)
        while pos < n:
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            child.last_access = self._tick()
            m = self._common(child.tokens, key, pos)
            if m < len(child.tokens):
                child = self._split(child, m)
            node, pos = child, pos + m
        overlap = pos
        if pos < n:
            leaf = self._new_node(node, key[pos:].copy(), n)
            node.children[int(key[pos])] = leaf
            self._childless.pop(node.id, None)
            self._childless[leaf.id] = leaf
            node, new_leaf = leaf, True
        else:
            new_leaf = False
        exists = node.state
        if not new_leaf:
            node.last_access = self._tick()
        if not exists:
            node.state = True
            self.tree_states += 1
        self._mamba_lru[node.id] = node
        self._mamba_lru.move_to_end(node.id)
        node.state_time = self._tick()
        if not probationary:
            self._probation.confirm(node)
        elif not exists:
            self._probation.add(node)
        return node, exists, overlap

    def _lock(self, node: _Node) -> None:
        if node is self.root:
            return
        node.mamba_lock += 1
        n = node
        while n is not self.root:
            n.full_lock += 1
            n = n.parent

    def _unlock(self, node: _Node) -> None:
        if node is self.root:
            return
        assert node.mamba_lock > 0
        node.mamba_lock -= 1
        n = node
        while n is not self.root:
            assert n.full_lock > 0
            n.full_lock -= 1
            n = n.parent

    def _is_leaf(self, node: _Node) -> bool:
        """SGLang's evictable device leaf."""
        return node is not self.root and not node.children and not node.full_lock and not node.mamba_lock

    # -- eviction --------------------------------------------------------------------------------
    def _evict(self, kv: int = 0, mamba: int = 0, probation_only: bool = False) -> None:
        """UnifiedRadixCache.evict_for_alloc: walk until the pool has `kv` more free KV slots
        (FULL walk) or `mamba` more free state slots (MAMBA walk) than now."""
        if kv > 0 and not probation_only:
            target = self.kv_free + kv
            while self.kv_free < target:
                node = self._kv_victim()
                if node is None:
                    break
                self._record("kv", "leaf", node)
                self.counters.evictions_leaf += 1
                self._delete_leaf(node)
        if mamba > 0:
            target = self.mamba_free + mamba
            freed = 0
            while self.mamba_free < target and freed < mamba:
                if not self._mamba_step(probation_only):
                    break
                freed += 1

    def _mamba_step(self, probation_only: bool) -> bool:
        c = self.counters
        if self.probation or probation_only:
            for node in self._probation:
                if not node.mamba_lock:
                    self._record("mamba", "probationary", node)
                    c.evictions_probationary += 1
                    self._drop_state(node)
                    return True
            if probation_only:
                return False
        if self.kind == LRU:
            node = self._lru_unlocked_state()
            kind = "lru"
        else:
            node = self._mamba_victim()
            kind = None
            if node is None:
                node, kind = self._lru_unlocked_state(), "fallback"
        if node is None:
            return False
        leaf = self._is_leaf(node)
        kind = kind if kind == "fallback" else ("leaf" if leaf else "single_child")
        if kind == "fallback":
            c.evictions_fallback += 1
        elif leaf:
            c.evictions_leaf += 1
        else:
            c.evictions_single_child += 1
        self._record("mamba", kind, node)
        self._drop_state(node)
        return True

    def _drop_state(self, node: _Node) -> None:
        """A Mamba-pressure victim: a leaf goes whole, any other node loses its state."""
        if self._is_leaf(node):
            self._delete_leaf(node)
            return
        self._probation.forget(node)
        node.state = False
        self.tree_states -= 1
        self.mamba_used -= 1
        del self._mamba_lru[node.id]

    def _delete_leaf(self, node: _Node) -> None:
        if node.state:
            self._probation.forget(node)
            node.state = False
            self.tree_states -= 1
            self.mamba_used -= 1
            del self._mamba_lru[node.id]
        n = len(node.tokens)
        self.tree_kv -= n
        self.kv_used -= n
        parent = node.parent
        del parent.children[int(node.tokens[0])]
        node.parent = None
        del self._childless[node.id]
        if not parent.children and parent is not self.root:
            self._childless[parent.id] = parent

    def _lru_unlocked_state(self) -> _Node | None:
        for node in self._mamba_lru.values():
            if not node.mamba_lock:
                return node
        return None

    def _record(self, pressure: str, kind: str, node: _Node) -> None:
        if self.events is not None:
            self.events.append(ServedEvent(self.served, pressure, kind, node.start, node.end))

    # -- Marconi's candidates (serving/tree_index.py: the same sets and values) ---------------------
    def _value(self, node: _Node, leaf: bool) -> float:
        start, end = value_rule.anchor_end(node, self.root, _holds_state, _end_of), node.end
        if self.kind == "seglen":
            return float(end - start)
        flops = self._flops.get((start, end))
        if flops is None:
            if len(self._flops) >= 1 << 16:
                self._flops.clear()
            flops = self._flops[(start, end)] = self.profile.prefill_flops(start, end)
        return value_rule.flops_saved_per_byte(flops, self.ssm_state_bytes,
                                          self.kv_bytes_per_token * (end - start) if leaf else 0)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _kv_victim(self) -> _Node | None:
        index = CandidateIndex(tie_key=CandidateIndex.node_id)
        for node in sorted((n for n in self._childless.values() if not n.full_lock and not n.mamba_lock),
                           key=lambda n: n.id):
            index.add(node, node.last_access, self._value(node, True) if node.state else 0.0)
        return index.lowest(self.weight) if len(index) else None

    def _mamba_victim(self) -> _Node | None:
        index = CandidateIndex(tie_key=CandidateIndex.node_id)
        for node in sorted(self._mamba_lru.values(), key=_node_id):
            leaf = self._is_leaf(node)
            if candidates.state_candidate(node.mamba_lock, leaf, len(node.children)):
                index.add(node, node.state_time, self._value(node, leaf))
        return index.lowest(self.weight) if len(index) else None

    def _whole_edges(self, seq):
        """The nodes whose whole edge `seq` follows from the root, in order (nothing changed)."""
        node, pos = self.root, 0
        while pos < len(seq):
            child = node.children.get(int(seq[pos]))
            if child is None:
                return
            m = self._common(child.tokens, seq, pos)
            if m < len(child.tokens):
                return
            node, pos = child, pos + m
            yield node

    def peek_hit(self, input_tokens) -> int:
        """The hit `serve` would report for this input, changing nothing."""
        hit = 0
        for node in self._whole_edges(input_tokens[: len(input_tokens) - 1]):
            if node.state:
                hit = node.end
        return hit

    def may_evict(self, n_in: int, n_kept: int) -> bool:
        """Whether serving a request of `n_in` input tokens that keeps `n_kept` could evict: it
        allocates at most its kept tokens + 1 KV slots and its own slots + 2 Mamba slots (a branch
        state and a probationary one)."""
        return self.kv_free < n_kept + 1 or self.mamba_free < self.pools.request_slots + 2

    # -- copies and checks -----------------------------------------------------------------------
    def copy(self, choice=None) -> ServedCache:
        """An independent copy (a tuner's shadows fork from one), optionally under another choice."""
        clone = copy.deepcopy(self, {id(self.profile): self.profile})
        if choice is not None:
            clone.set_choice(choice)
        return clone

    def states_on_path(self, tokens) -> list[int]:
        """Depths along `tokens` where this cache holds a state (diagnosis)."""
        return [node.end for node in self._whole_edges(as_token_array(tokens)) if node.state]

    def check_invariants(self) -> None:
        kv = states = 0
        for node in self._nodes():
            kv += len(node.tokens)
            states += node.state
            assert node.end == node.parent.end + len(node.tokens) and len(node.tokens) > 0, node
            assert node.state == (node.id in self._mamba_lru), node
            for key, child in node.children.items():
                assert child.parent is node and int(child.tokens[0]) == key
            assert node.full_lock == 0 and node.mamba_lock == 0, f"locked while idle: {node!r}"
        assert kv == self.tree_kv == self.kv_used, (kv, self.tree_kv, self.kv_used)
        assert {n.id for n in self._nodes() if not n.children} == set(self._childless)
        assert states == self.tree_states == self.mamba_used, (states, self.tree_states, self.mamba_used)
        assert kv <= self.pools.kv_tokens and states <= self.pools.mamba_slots
        for node in self._probation:
            assert node.state and node.parent is not None, node
