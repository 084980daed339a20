"""Prefix cache for hybrid models: KV per edge token, SSM checkpoints at node ends (paper §4).

Admission (§4.1): a request admits at most two SSM states, the one after its last decoded
token and one at the branch point that speculative insertion of its input finds (on the
checkpoint grid, as chunked prefill produces states). Eviction (§4.2) is delegated to an
`EvictionPolicy`; candidates live in a numpy `CandidateIndex` kept current incrementally, so
choosing a victim never walks the tree.

Probation (`probation=True`): a prefix that recurs exactly twice in a row (a request, then one that
shares its input and not what followed: SGLang's mooncake generator sends each round with a
placeholder reply) finds no state at the second use: the branch it reveals is checkpointed then
and pays from the third. With probation each admission also keeps, best effort, the state at
the end of the request's input (the prefill computes it anyway) as a probationary state: a
later hit on it confirms it (a regular state from then on), and pressure evicts probationary
states first, oldest first, before the eviction policy is asked for a victim.

Bytes: `kv_bytes_per_token` per cached token plus `ssm_state_bytes` per checkpoint, both from
the model profile; `used_bytes` never exceeds `capacity_bytes` once an admission returns. With
`state_slots` (two budgets, as a serving engine's KV pool and SSM-state pool), `capacity_bytes`
bounds the KV alone and at most `state_slots` states are cached.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.eviction import EvictionPolicy, FlopAwareEviction
from sglang_marconi.policy.rules.eviction.flop_aware import flops_saved_per_byte
from sglang_marconi.policy.rules.probation import ProbationRegistry, evict_oldest_probationary
from sglang_marconi.policy.tree.radix_tree import Node, RadixTree, Walk, as_token_array


@dataclass(frozen=True, slots=True)
class Lookup:
    """The result of matching a request's input before prefill."""

    hit_tokens: int  # prefix reusable now: KV and an SSM state at exactly this length
    overlap_tokens: int  # tokens of the input whose KV is cached (reusable or not)
    checkpoint_at: int | None  # branch position to checkpoint during prefill, if any
    hit_node: Node


@dataclass(slots=True)
class CacheCounters:
    evictions_leaf: int = 0
    evictions_single_child: int = 0
    admissions_skipped: int = 0


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """A picklable copy of a cache's contents: nodes in parent-first order."""

    parents: list[int]  # index into the node list, -1 for a child of the root
    tokens: list[np.ndarray]
    has_state: list[bool]
    last_access: list[float]
    clock: float
    capacity_bytes: int
    checkpoint_grid: int
    page_size: int
    state_slots: int | None = None
    probation: tuple[int, ...] = ()  # indexes (in `parents` order) of probationary states, oldest first
    keeps_probation: bool = False


class HybridPrefixCache:
    def __init__(
        self,
        profile,
        capacity_bytes: int,
        eviction: EvictionPolicy | None = None,
        *,
        checkpoint_grid: int = 1,
        page_size: int = 1,
        state_slots: int | None = None,
        probation: bool = False,
    ):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, (int, np.integer)) or capacity_bytes <= 0:
            raise MarconiError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        if state_slots is not None and (isinstance(state_slots, bool) or not isinstance(state_slots, (int, np.integer))
                                        or state_slots < 2):
            raise MarconiError(f"state_slots must be an integer >= 2 (one request's two states), got {state_slots!r}")
        if state_slots is None and 2 * profile.ssm_state_bytes > capacity_bytes:
            raise MarconiError(
                f"capacity_bytes={capacity_bytes} is smaller than one request's two SSM states "
                f"(2 x {profile.ssm_state_bytes} bytes for {profile.name})"
            )
        if not isinstance(checkpoint_grid, int) or checkpoint_grid < 1:
            raise MarconiError(f"checkpoint_grid must be a positive integer, got {checkpoint_grid!r}")
        self.profile = profile
        self.capacity_bytes = int(capacity_bytes)
        self.state_slots = None if state_slots is None else int(state_slots)
        self.eviction = eviction if eviction is not None else FlopAwareEviction(0.0)
        self._node_value = self._value_of(self.eviction)
        self._value_reaches_up = getattr(self.eviction, "value_reaches_up", False)
        self.checkpoint_grid = checkpoint_grid
        self.kv_bytes_per_token = int(profile.kv_bytes_per_token)
        self.ssm_state_bytes = int(profile.ssm_state_bytes)
        # A pure Transformer needs no SSM state to reuse a prefix (the paper's pure-attention axis).
        self.attention_only = self.ssm_state_bytes == 0
        self.tree = RadixTree(page_size)
        self.index = CandidateIndex(tie_key=CandidateIndex.node_id)
        self.kv_tokens = 0
        self.ssm_states = 0
        self.clock = 0.0
        self.counters = CacheCounters()
        self.probation = probation
        self._probation = ProbationRegistry()

    # -- accounting ------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token + self.ssm_states * self.ssm_state_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    # -- request API -----------------------------------------------------------------------------
    def lookup(self, input_tokens) -> Lookup:
        """Match the input (refreshing timestamps) and speculatively insert it to find the branch
        checkpoint. At least one input token is always left to prefill."""
        seq = as_token_array(input_tokens)
        walk = self.tree.walk(seq)
        limit = len(seq) - 1
        hit_node = self.tree.root
        for node in walk.path:
            if node.end > limit:
                break
            if node.has_state or self.attention_only:
                hit_node = node
        if self.attention_only:  # no SSM layers: any cached prefix is reusable, mid-edge too
            hit = self.tree.page_aligned(min(walk.overlap, limit))
            self._touch_hit(walk, hit_node)
            return Lookup(hit, walk.overlap, None, hit_node)
        self._touch_hit(walk, hit_node)
        if self._probation:
            self._probation.confirm(hit_node)  # a hit confirms a probationary state
        return Lookup(hit_node.end, walk.overlap, self._branch_checkpoint(walk, hit_node.end, limit), hit_node)

    def _touch_hit(self, walk: Walk, hit_node: Node) -> None:
        if self.eviction.refresh_matched_path:
            for node in walk.path:
                self._touch(node)
        elif hit_node is not self.tree.root:
            self._touch(hit_node)

    def _branch_checkpoint(self, walk: Walk, hit: int, limit: int) -> int | None:
        # Inserting the input creates a new intermediate node where it leaves an edge midway,
        # or adds a sibling under a node that has children but no state: checkpoint there.
        if walk.partial is None:
            node = walk.last
            if node is None or not node.children or node.has_state:
                return None
        # Capped like a hit (an input that is wholly cached still prefills its last token), then
        # floored to the grid, as SGLang computes its branching position.
        branch = min(walk.overlap, limit)
        target = branch - branch % self.checkpoint_grid
        return target if target > hit else None

    def admit(self, sequence, checkpoint_at: int | None = None, probation_at: int | None = None) -> int:
        """Cache a finished request's sequence (input + output) with an SSM state at its end and
        at `checkpoint_at`; evict to make room. Returns the number of states admitted (<= 2, plus
        a probationary one at `probation_at` when the cache keeps them and there is room)."""
        seq = as_token_array(sequence)
        n = self.tree.page_aligned(len(seq))
        if n == 0:
            return 0
        seq = seq[:n]
        walk = self.tree.walk(seq)
        positions = [] if self.attention_only else [n]  # no SSM layers: nothing to checkpoint
        if positions and checkpoint_at is not None and 0 < checkpoint_at < n and checkpoint_at % self.tree.page_size == 0:
            positions.insert(0, int(checkpoint_at))
        stateful_ends = {node.end for node in walk.path if node.has_state}
        new_states = sum(1 for p in positions if p not in stateful_ends)
        # Lock what the request reuses, the nodes it matched whole (as SGLang locks a running
        # request's prefix), not the edge it leaves mid-way: that edge (another request's private
        # tail) may be evicted for room like any leaf, and the request then caches those tokens
        # itself, so room is made again for them.
        deepest = walk.last
        if deepest is not None:
            self.lock(deepest)
        try:
            while True:
                if not self._make_room((n - walk.overlap) * self.kv_bytes_per_token, new_states):
                    self.counters.admissions_skipped += 1
                    return 0
                if walk.partial is None:
                    break  # the whole path is locked: nothing on it moved
                overlap, walk = walk.overlap, self.tree.walk(seq)  # the edge left mid-way may be gone or merged
                if walk.overlap == overlap:
                    break
            if n > walk.overlap:
                attach = self._split(walk.partial, walk.partial_len) if walk.partial else (walk.last or self.tree.root)
                self._add_leaf(attach, seq[walk.overlap :])
            admitted = 0
            for pos in positions:
                node = self._node_at(seq, pos)
                if not node.has_state:
                    node.has_state = True
                    self.ssm_states += 1
                    admitted += 1
                elif self._probation:
                    self._probation.confirm(node)  # a regular state where a probationary one was
                self._touch(node)
                self._refresh(node)
            if (self.probation and probation_at is not None and positions and 0 < probation_at < n
                    and probation_at % self.tree.page_size == 0 and probation_at not in positions):
                admitted += self._admit_probationary(seq, int(probation_at))
            return admitted
        finally:
            if deepest is not None:
                self.unlock(deepest)

    def _admit_probationary(self, seq: np.ndarray, pos: int) -> int:
        """A probationary state at `pos`, if it fits without evicting anything but other
        probationary states (the request's own path is locked meanwhile)."""
        walk = self.tree.walk(seq[:pos])
        node = walk.last if walk.partial is None else None
        if node is not None and node.has_state:
            return 0
        deepest = self.tree.walk(seq).last
        if deepest is not None:
            self.lock(deepest)
        try:
            while not self._fits(0, 1) and self._evict_probationary():
                pass
            if not self._fits(0, 1):
                return 0
            node = self._node_at(seq, pos)
            node.has_state = True
            self.ssm_states += 1
            self._probation.add(node)
            self._refresh(node)
            return 1
        finally:
            if deepest is not None:
                self.unlock(deepest)

    def _fits(self, kv_bytes: int, new_states: int) -> bool:
        if self.state_slots is None:
            return self.free_bytes >= kv_bytes + new_states * self.ssm_state_bytes
        return (self.kv_tokens * self.kv_bytes_per_token + kv_bytes <= self.capacity_bytes
                and self.ssm_states + new_states <= self.state_slots)

    def _evict_probationary(self) -> bool:
        """Drop the oldest unlocked probationary state (and what only it kept); False if none."""
        return evict_oldest_probationary(self)

    def serve(self, input_tokens, output_tokens=()) -> tuple[Lookup, int]:
        """Simulate one request end to end: lookup, prefill, decode, admit."""
        inp = as_token_array(input_tokens)
        lookup = self.lookup(inp)
        seq = np.concatenate((inp, np.asarray(output_tokens, dtype=np.int64)))
        return lookup, self.admit(seq, lookup.checkpoint_at, len(inp) if self.probation else None)

    # -- locks -----------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """Protect `node` and its ancestors from eviction (an in-flight request uses them)."""
        while node is not self.tree.root:
            node.lock_count += 1
            if node.lock_count == 1:
                self._refresh(node)
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None and node is not self.tree.root:
            if node.lock_count <= 0:
                raise MarconiError(f"unlock of {node!r} which is not locked")
            node.lock_count -= 1
            parent = node.parent
            if node.lock_count == 0:
                self._refresh(node)
                self._compress(node)
            node = parent

    # -- eviction --------------------------------------------------------------------------------
    def _make_room(self, kv_bytes: int, new_states: int) -> bool:
        if self.state_slots is None:
            needed = kv_bytes + new_states * self.ssm_state_bytes
            if needed > self.capacity_bytes:
                return False
            while self.free_bytes < needed:
                if not self._evict_one():
                    return False
            return True
        kv_room = self.capacity_bytes - kv_bytes
        state_room = self.state_slots - new_states
        if kv_room < 0 or state_room < 0:
            return False
        while self.kv_tokens * self.kv_bytes_per_token > kv_room or self.ssm_states > state_room:
            if not self._evict_one():
                return False
        return True

    def _evict_one(self) -> bool:
        if self._probation and self._evict_probationary():
            return True
        if not len(self.index):
            return False
        self.evict(self.eviction.choose(self.index))
        return True

    def evict(self, node: Node) -> None:
        """Evict one candidate: a leaf frees its KV and state; a single-child node frees its
        state and its edge is absorbed by its child."""
        assert node.slot >= 0, f"{node!r} is not an eviction candidate"
        self._probation.forget(node)
        self._drop(node)
        if node.has_state:
            node.has_state = False
            self.ssm_states -= 1
        if node.children:
            self.counters.evictions_single_child += 1
            self._refresh(self.tree.merge_into_child(node))
            return
        self.counters.evictions_leaf += 1
        self.kv_tokens -= len(node.tokens)
        parent = self.tree.remove_leaf(node)
        self._refresh(parent)
        self._compress(parent)

    # -- tree edits that keep the candidate index current ----------------------------------------
    def _split(self, child: Node, k: int) -> Node:
        head = self.tree.split(child, k)
        self._refresh(head)
        self._refresh(child)
        return head

    def _add_leaf(self, parent: Node, tokens: np.ndarray) -> Node:
        leaf = self.tree.add_leaf(parent, tokens)
        self.kv_tokens += len(tokens)
        leaf.last_access = self.clock
        self._refresh(leaf)
        self._refresh(parent)
        return leaf

    def _node_at(self, seq: np.ndarray, pos: int) -> Node:
        walk = self.tree.walk(seq[:pos])
        assert walk.overlap == pos, "admitted positions lie on the inserted path"
        return self._split(walk.partial, walk.partial_len) if walk.partial else walk.last

    def _compress(self, node: Node) -> None:
        # A stateless node with one child holds nothing an eviction could free: fold it away.
        if node is not self.tree.root and node.lock_count == 0 and not node.has_state and len(node.children) == 1:
            self._drop(node)
            self._refresh(self.tree.merge_into_child(node))

    def _touch(self, node: Node) -> None:
        self.clock += 1.0
        node.last_access = self.clock
        if node.slot >= 0:
            self.index.last_access[node.slot] = self.clock

    def _is_candidate(self, node: Node) -> bool:
        if node.lock_count or node.parent is None:
            return False
        n_children = len(node.children)
        return n_children == 0 or (n_children == 1 and node.has_state and self.eviction.evicts_single_child_nodes)

    def flop_efficiency(self, node: Node) -> float:
        """Eq. 1: FLOPs saved by reusing `node` rather than its parent, per byte its eviction
        would free (a leaf frees KV and state, a single-child node only its state). A node
        without a state saves nothing on its own, unless the model has no SSM layers."""
        if not (node.has_state or self.attention_only):
            return 0.0
        return flops_saved_per_byte(self.profile.prefill_flops(node.parent.end, node.end),
                                    self.ssm_state_bytes if node.has_state else 0,
                                    0 if node.children else len(node.tokens) * self.kv_bytes_per_token)

    def set_eviction(self, eviction: EvictionPolicy) -> None:
        """Switch eviction policy (alpha tuning may move between LRU and FLOP-aware eviction)."""
        if eviction is self.eviction:
            return
        self.eviction = eviction
        self._node_value = self._value_of(eviction)
        self._value_reaches_up = getattr(eviction, "value_reaches_up", False)
        for node in self.tree.nodes():
            self._refresh(node)

    def _value_of(self, eviction: EvictionPolicy):
        """The candidate index's second column: FLOP efficiency, unless the policy brings its own."""
        value = getattr(eviction, "node_value", None)
        return self.flop_efficiency if value is None else functools.partial(value, self)

    def _refresh(self, node: Node) -> None:
        if node is self.tree.root:
            return
        if self._is_candidate(node):
            eff = self._node_value(node)
            if node.slot < 0:
                node.slot = self.index.add(node, node.last_access, eff)
            else:
                self.index.update(node.slot, node.last_access, eff)
        elif node.slot >= 0:
            self._drop(node)
        if self._value_reaches_up:
            self._rescore_stated_ancestor(node)

    def _rescore_stated_ancestor(self, node: Node) -> None:
        # A value that depends on the subtree (coverage) changes with any edit at or below `node`
        # for the nearest ancestor holding a state; every edit refreshes the node it touched.
        above = node.parent
        while above is not None and above is not self.tree.root and not (above.has_state or self.attention_only):
            above = above.parent
        if above is not None and above is not self.tree.root and above.slot >= 0:
            self.index.update(above.slot, above.last_access, self._node_value(above))

    def _drop(self, node: Node) -> None:
        if node.slot < 0:
            return
        moved = self.index.remove(node.slot)
        if moved is not None:
            moved.slot = node.slot
        node.slot = -1

    # -- snapshots (alpha tuning replays a window from one) ---------------------------------------
    def snapshot(self) -> CacheSnapshot:
        order: dict[int, int] = {}
        parents, tokens, has_state, last_access = [], [], [], []
        for node in self.tree.nodes():
            order[node.id] = len(parents)
            parents.append(order.get(node.parent.id, -1) if node.parent is not self.tree.root else -1)
            tokens.append(node.tokens)
            has_state.append(node.has_state)
            last_access.append(node.last_access)
        return CacheSnapshot(
            parents, tokens, has_state, last_access, self.clock, self.capacity_bytes,
            self.checkpoint_grid, self.tree.page_size, self.state_slots,
            tuple(order[n.id] for n in self._probation), self.probation,
        )

    @classmethod
    def from_snapshot(cls, profile, snap: CacheSnapshot, eviction: EvictionPolicy, capacity_bytes: int | None = None):
        cache = HybridPrefixCache(
            profile, capacity_bytes or snap.capacity_bytes, eviction, checkpoint_grid=snap.checkpoint_grid,
            page_size=snap.page_size, state_slots=snap.state_slots, probation=snap.keeps_probation,
        )
        built: list[Node] = []
        for parent_idx, toks, state, stamp in zip(snap.parents, snap.tokens, snap.has_state, snap.last_access):
            parent = cache.tree.root if parent_idx < 0 else built[parent_idx]
            node = cache.tree.add_leaf(parent, toks)
            node.has_state, node.last_access = state, stamp
            cache.kv_tokens += len(toks)
            cache.ssm_states += state
            built.append(node)
        cache.clock = snap.clock
        cache._probation = ProbationRegistry.of(built[i] for i in snap.probation)
        for node in built:
            cache._refresh(node)
        return cache

    # -- checking --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping disagrees with the tree."""
        kv = states = 0
        candidates = set()
        for node in self.tree.nodes():
            kv += len(node.tokens)
            states += node.has_state
            assert node.end == node.parent.end + len(node.tokens), node
            assert len(node.tokens) > 0 and len(node.tokens) % self.tree.page_size == 0, node
            for key, child in node.children.items():
                assert child.parent is node and self.tree._key(child.tokens, 0) == key
            if self._is_candidate(node):
                candidates.add(node.id)
                assert self.index.items[node.slot] is node, node
            else:
                assert node.slot < 0, node
            assert node.has_state or len(node.children) != 1 or node.lock_count, f"uncompressed {node!r}"
        assert kv == self.kv_tokens and states == self.ssm_states
        for node in self._probation:
            assert node.has_state and node.parent is not None, f"stale probationary state {node!r}"
        assert self.probation or not self._probation
        assert candidates == {n.id for n in self.index.items}
        if self.state_slots is None:
            assert self.used_bytes <= self.capacity_bytes
        else:
            assert self.kv_tokens * self.kv_bytes_per_token <= self.capacity_bytes and self.ssm_states <= self.state_slots
