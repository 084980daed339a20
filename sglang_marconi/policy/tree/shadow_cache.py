"""The shadow tuner's caches: `HybridPrefixCache`'s admission and eviction, step for step, on edges
that reference the admitting request's tokens instead of holding copies of them.

Every decision the tuner makes rests on these caches behaving exactly like the live cache would with
the same choice, so this module transcribes `HybridPrefixCache` operation by operation: the same
nodes, the same candidate-index slots in the same order (a near-tie goes where the reference's
arithmetic sends it), the same clock (`tests/test_shadow_cache.py` compares them on random streams,
`tests/test_shadow_equivalence.py` the tuner built on them with the original tuner). What differs is
only what the work costs, which the tuner pays once per candidate choice:

- An edge is (src, start, end): the tokens src[start:end] of the request that admitted them, whose
  own prefix src[:start] is the path above. Splitting moves `start`, merging a node into its child
  moves the child's `start` back (the child's source holds the whole path): no token is copied.
- Matching goes through the request's `SharedMatch`, which compares the request with each source
  once for all shadows (`policy/tree/shared_match.py`); a walk is then dict lookups.
- One walk per request: `lookup` walks the whole sequence and leaves the walk to `admit` (the
  lookup's walk of the input is its prefix); the admitted states are found on the admitted path,
  not by walking again.
- FLOPs of a span come from a table shared by the tuner's caches; the candidate index is
  `SmallCandidateIndex` (same slots, cheaper operations, the reference's victim).
- The tuner calls `lookup` and `admit` with the request's `SharedMatch` (no validation: the tuner
  validated the tokens once).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.eviction import EvictionPolicy, FlopAwareEviction, LruLeafEviction, SegLenEviction
from sglang_marconi.policy.rules.eviction.flop_aware import flops_saved_per_byte
from sglang_marconi.policy.tree.hybrid_cache import CacheCounters
from sglang_marconi.policy.rules.probation import ProbationRegistry, evict_oldest_probationary
from sglang_marconi.policy.tree.shared_match import SharedMatch
from sglang_marconi.policy.tree.small_candidates import SmallCandidateIndex


_CHOOSE_LOWEST = {FlopAwareEviction.choose, LruLeafEviction.choose, SegLenEviction.choose}


class FlopsTable:
    """profile.prefill_flops(start, end), remembered: a shadow refreshes the same spans over and over."""

    __slots__ = ("profile", "_flops")
    LIMIT = 1 << 18

    def __init__(self, profile):
        self.profile = profile
        self._flops: dict[tuple[int, int], float] = {}

    def __call__(self, start: int, end: int) -> float:
        flops = self._flops.get((start, end))
        if flops is None:
            if len(self._flops) >= self.LIMIT:
                self._flops.clear()
            flops = self._flops[(start, end)] = self.profile.prefill_flops(start, end)
        return flops


class ShadowNode:
    __slots__ = ("parent", "children", "key", "src", "start", "end", "has_state", "last_access", "lock_count",
                 "slot", "id")

    def __init__(self, parent, key, src, start: int, end: int, node_id: int):
        self.parent = parent
        self.children: dict = {}
        self.key = key  # this node's key in its parent's children (the first page of its edge)
        self.src = src
        self.start = start
        self.end = end
        self.has_state = False
        self.last_access = 0.0
        self.lock_count = 0
        self.slot = -1
        self.id = node_id

    @property
    def tokens(self) -> np.ndarray:
        return self.src[self.start : self.end]

    def __repr__(self) -> str:
        return f"ShadowNode(id={self.id}, [{self.start},{self.end}), state={self.has_state}, children={len(self.children)})"


@dataclass(frozen=True, slots=True)
class ShadowSnapshot:
    """A shadow cache's contents, nodes in parent-first order (`HybridPrefixCache.snapshot`'s
    order and fields, with each edge as its source and positions)."""

    parents: list[int]
    srcs: list[np.ndarray]
    starts: list[int]
    ends: list[int]
    has_state: list[bool]
    last_access: list[float]
    clock: float
    capacity_bytes: int
    checkpoint_grid: int
    page_size: int
    state_slots: int | None
    probation: tuple[int, ...]
    keeps_probation: bool


class ShadowCache:
    def __init__(self, profile, capacity_bytes: int, eviction: EvictionPolicy, *, checkpoint_grid: int = 1,
                 page_size: int = 1, state_slots: int | None = None, probation: bool = False,
                 flops: FlopsTable | None = None):
        if state_slots is None and 2 * profile.ssm_state_bytes > capacity_bytes:
            raise MarconiError(
                f"capacity_bytes={capacity_bytes} is smaller than one request's two SSM states "
                f"(2 x {profile.ssm_state_bytes} bytes for {profile.name})"
            )
        self.profile = profile
        self.capacity_bytes = int(capacity_bytes)
        self.state_slots = None if state_slots is None else int(state_slots)
        self.checkpoint_grid = checkpoint_grid
        self.page_size = page_size
        self.kv_bytes_per_token = int(profile.kv_bytes_per_token)
        self.ssm_state_bytes = int(profile.ssm_state_bytes)
        self.attention_only = self.ssm_state_bytes == 0
        self.flops = flops if flops is not None else FlopsTable(profile)
        self.root = ShadowNode(None, None, np.empty(0, dtype=np.int64), 0, 0, 0)
        self.root.lock_count = 1
        self._next_id = 1
        self.index = SmallCandidateIndex(tie_key=SmallCandidateIndex.node_id)
        self.kv_tokens = 0
        self.ssm_states = 0
        self.clock = 0.0
        self.counters = CacheCounters()
        self.probation = probation
        self._probation = ProbationRegistry()
        self._walked = None  # (match, walk) that lookup leaves for admit
        # A shadow's choice is fixed for its life (a copy under another choice is another cache).
        self.eviction = eviction
        self._evicts_single_child = eviction.evicts_single_child_nodes
        self._refresh_path = eviction.refresh_matched_path
        self._by_length = getattr(eviction, "node_value", None) is not None  # SegLen ranks by replay length
        # The three policies choose candidates.lowest(alpha) (LRU: alpha 0); asked directly, saving a
        # call per eviction. Any other policy (the shared shadow's) is asked through `choose`.
        self._alpha = getattr(eviction, "alpha", 0.0) if type(eviction).choose in _CHOOSE_LOWEST else None
        # At alpha 0 (LRU, FLOP-aware at 0) the second column ranks nothing and is never read (a copy
        # under another choice recomputes it): it is not computed.
        self._ranks_by_value = bool(self._alpha)

    # -- accounting ----------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token + self.ssm_states * self.ssm_state_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    # -- the tree --------------------------------------------------------------------------------
    def _key_at(self, src: np.ndarray, pos: int):
        return int(src[pos]) if self.page_size == 1 else src[pos : pos + self.page_size].tobytes()

    def _walk(self, match: SharedMatch, n: int):
        """`RadixTree.walk` of match.seq[:n]: (path, partial, partial_len, overlap)."""
        node, pos, path = self.root, 0, []
        page = self.page_size
        key, agreed_end, seq = match.key, match.agreed_end, match.seq
        while pos < n:
            child = node.children.get(key(pos))
            if child is None:
                break
            end = child.end if child.end < n else n
            agreed = end if child.src is seq else agreed_end(child.src, pos, end)
            if agreed < child.end:
                k = agreed - pos
                k -= k % page
                return path, child, k, pos + k
            path.append(child)
            node, pos = child, child.end
        return path, None, 0, pos

    @staticmethod
    def _input_part(walk, n_in: int):
        """The walk of the input's first n_in tokens (the lookup's), from the walk of the whole
        sequence: its nodes that end by n_in, and the node it stops inside, if any."""
        path, partial, partial_len, overlap = walk
        for j, node in enumerate(path):
            if node.end > n_in:  # it starts at or before n_in
                if node.start == n_in:
                    return path[:j], None, 0, n_in
                return path[:j], node, n_in - node.start, n_in
        if partial is None:
            return walk
        if partial.start >= n_in:
            return path, None, 0, n_in
        if overlap <= n_in:
            return walk
        return path, partial, n_in - partial.start, n_in

    def _new_node(self, parent: ShadowNode, key, src: np.ndarray, start: int, end: int) -> ShadowNode:
        node = ShadowNode(parent, key, src, start, end, self._next_id)
        self._next_id += 1
        return node

    def _tree_split(self, child: ShadowNode, k: int) -> ShadowNode:
        parent = child.parent
        head = self._new_node(parent, child.key, child.src, child.start, child.start + k)
        head.last_access = child.last_access
        head.lock_count = child.lock_count
        parent.children[head.key] = head
        child.start += k
        child.key = self._key_at(child.src, child.start)
        child.parent = head
        head.children[child.key] = child
        return head

    def _tree_add_leaf(self, parent: ShadowNode, key, src: np.ndarray, start: int, end: int) -> ShadowNode:
        leaf = self._new_node(parent, key, src, start, end)
        parent.children[key] = leaf
        return leaf

    def _tree_merge_into_child(self, node: ShadowNode) -> ShadowNode:
        (child,) = node.children.values()
        parent = node.parent
        child.start = node.start  # child.src holds the whole path: its edge now begins where node's did
        child.key = node.key
        child.parent = parent
        parent.children[child.key] = child
        node.parent = None
        node.children = {}
        return child

    def nodes(self):
        """Every node except the root, parents first (`RadixTree.nodes`' order)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- request API -----------------------------------------------------------------------------
    def lookup(self, match: SharedMatch) -> tuple[int, int | None]:
        """`HybridPrefixCache.lookup` of the request's input: (hit tokens, checkpoint_at). It walks
        the whole sequence once and keeps the walk for `admit`, which follows on the same tree."""
        page = self.page_size
        seq, input_len = match.seq, match.input_len
        walk = self._walk(match, len(seq) - len(seq) % page)
        self._walked = (match, walk)
        path, partial, _, overlap = self._input_part(walk, input_len - input_len % page)
        limit = input_len - 1
        hit_node = self.root
        attention_only = self.attention_only
        for node in path:
            if node.end > limit:
                break
            if node.has_state or attention_only:
                hit_node = node
        self._touch_hit(path, hit_node)
        if attention_only:
            hit = min(overlap, limit)
            return hit - hit % page, None
        if self._probation:
            self._probation.confirm(hit_node)
        hit = hit_node.end
        # HybridPrefixCache._branch_checkpoint
        if partial is None:
            last = path[-1] if path else None
            if last is None or not last.children or last.has_state:
                return hit, None
        branch = overlap if overlap < limit else limit
        target = branch - branch % self.checkpoint_grid
        return hit, (target if target > hit else None)

    def _touch_hit(self, path: list[ShadowNode], hit_node: ShadowNode) -> None:
        if self._refresh_path:
            for node in path:
                self._touch(node)
        elif hit_node is not self.root:
            self._touch(hit_node)

    def admit(self, match: SharedMatch, checkpoint_at: int | None = None, probation_at: int | None = None) -> int:
        """`HybridPrefixCache.admit` of the request's input + output."""
        seq = match.seq
        page = self.page_size
        n = len(seq) - len(seq) % page
        walked, self._walked = self._walked, None
        if n == 0:
            return 0
        walk = walked[1] if walked is not None and walked[0] is match else self._walk(match, n)
        path, partial, partial_len, overlap = walk
        positions = [] if self.attention_only else [n]
        if positions and checkpoint_at is not None and 0 < checkpoint_at < n and checkpoint_at % page == 0:
            positions.insert(0, int(checkpoint_at))
        new_states = 0
        for pos in positions:
            if not self._state_on(path, pos):
                new_states += 1
        deepest = path[-1] if path else None  # the nodes matched whole, not the edge left mid-way
        if deepest is not None:
            self.lock(deepest)
        try:
            while True:
                if not self._make_room((n - overlap) * self.kv_bytes_per_token, new_states):
                    self.counters.admissions_skipped += 1
                    return 0
                if partial is None:
                    break
                before = overlap
                path, partial, partial_len, overlap = self._walk(match, n)  # the edge may be gone or merged
                if overlap == before:
                    break
            # The nodes along seq[:n] from here on: locked, so evictions left them whole.
            spine = list(path)
            if n > overlap:
                attach = self._split(partial, partial_len) if partial else (path[-1] if path else self.root)
                if partial:
                    spine.append(attach)
                spine.append(self._add_leaf(attach, match, overlap, n))
            elif partial:
                spine.append(partial)
            admitted = 0
            for pos in positions:
                node = self._node_on(spine, pos)
                if not node.has_state:
                    node.has_state = True
                    self.ssm_states += 1
                    admitted += 1
                elif self._probation:
                    self._probation.confirm(node)
                self._touch(node)
                self._refresh(node)
            if (self.probation and probation_at is not None and positions and 0 < probation_at < n
                    and probation_at % page == 0 and probation_at not in positions):
                admitted += self._admit_probationary(match, n, int(probation_at))
            return admitted
        finally:
            if deepest is not None:
                self.unlock(deepest)

    @staticmethod
    def _state_on(path: list[ShadowNode], pos: int) -> bool:
        """Whether a node of `path` (root side first) ends at `pos` with a state. Searched from the
        deep end: the admitted positions are the request's end and its branch, near the end."""
        for j in range(len(path) - 1, -1, -1):
            node = path[j]
            if node.end <= pos:
                return node.end == pos and node.has_state
        return False

    def _node_on(self, spine: list[ShadowNode], pos: int) -> ShadowNode:
        """The node ending at `pos` on the admitted path (`spine`, root side first), its edge split
        there if `pos` falls inside it (`HybridPrefixCache._node_at` without walking again).
        Searched from the deep end, as `_state_on`."""
        for j in range(len(spine) - 1, -1, -1):
            node = spine[j]
            if node.start < pos:
                if node.end == pos:
                    return node
                head = self._split(node, pos - node.start)
                spine.insert(j, head)
                return head
        raise AssertionError("admitted positions lie on the inserted path")

    def _node_at(self, match: SharedMatch, pos: int) -> ShadowNode:
        path, partial, partial_len, overlap = self._walk(match, pos)
        assert overlap == pos, "admitted positions lie on the inserted path"
        return self._split(partial, partial_len) if partial else path[-1]

    def _admit_probationary(self, match: SharedMatch, n: int, pos: int) -> int:
        path, partial, _, _ = self._walk(match, pos)
        node = path[-1] if partial is None and path else None
        if node is not None and node.has_state:
            return 0
        full = self._walk(match, n)[0]
        deepest = full[-1] if full else None
        if deepest is not None:
            self.lock(deepest)
        try:
            while not self._fits(0, 1) and self._evict_probationary():
                pass
            if not self._fits(0, 1):
                return 0
            node = self._node_at(match, pos)
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
        return evict_oldest_probationary(self)

    # -- locks -----------------------------------------------------------------------------------
    def lock(self, node: ShadowNode) -> None:
        root = self.root
        while node is not root:
            node.lock_count += 1
            if node.lock_count == 1 and node.slot >= 0:  # `_refresh` of a locked node: drop it if listed
                self._drop(node)
            node = node.parent

    def unlock(self, node: ShadowNode) -> None:
        root = self.root
        while node is not None and node is not root:
            if node.lock_count <= 0:
                raise MarconiError(f"unlock of {node!r} which is not locked")
            node.lock_count -= 1
            parent = node.parent
            if node.lock_count == 0:
                self._refresh(node)
                if not node.has_state and len(node.children) == 1:  # what `_compress` checks
                    self._compress(node)
            node = parent

    # -- eviction --------------------------------------------------------------------------------
    def _make_room(self, kv_bytes: int, new_states: int) -> bool:
        kv_per = self.kv_bytes_per_token
        if self.state_slots is None:
            needed = kv_bytes + new_states * self.ssm_state_bytes
            if needed > self.capacity_bytes:
                return False
            while self.capacity_bytes - self.kv_tokens * kv_per - self.ssm_states * self.ssm_state_bytes < needed:
                if not self._evict_one():
                    return False
            return True
        kv_room = self.capacity_bytes - kv_bytes
        state_room = self.state_slots - new_states
        if kv_room < 0 or state_room < 0:
            return False
        while self.kv_tokens * kv_per > kv_room or self.ssm_states > state_room:
            if not self._evict_one():
                return False
        return True

    def _evict_one(self) -> bool:
        if self._probation and self._evict_probationary():
            return True
        if not self.index.items:
            return False
        alpha = self._alpha
        self.evict(self.eviction.choose(self.index) if alpha is None else self.index.lowest(alpha))
        return True

    def evict(self, node: ShadowNode) -> None:
        assert node.slot >= 0, f"{node!r} is not an eviction candidate"
        self._probation.forget(node)
        self._drop(node)
        if node.has_state:
            node.has_state = False
            self.ssm_states -= 1
        if node.children:
            self.counters.evictions_single_child += 1
            self._refresh(self._tree_merge_into_child(node))
            return
        self.counters.evictions_leaf += 1
        self.kv_tokens -= node.end - node.start
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        self._refresh(parent)
        self._compress(parent)

    # -- tree edits that keep the candidate index current ----------------------------------------
    def _split(self, child: ShadowNode, k: int) -> ShadowNode:
        head = self._tree_split(child, k)
        self._refresh(head)
        self._refresh(child)
        return head

    def _add_leaf(self, parent: ShadowNode, match: SharedMatch, start: int, end: int) -> ShadowNode:
        """A leaf holding match.seq[start:end] (its key is the request's, shared by every shadow)."""
        leaf = self._tree_add_leaf(parent, match.key(start), match.seq, start, end)
        self.kv_tokens += end - start
        leaf.last_access = self.clock
        self._refresh(leaf)
        self._refresh(parent)
        return leaf

    def _compress(self, node: ShadowNode) -> None:
        if node is not self.root and node.lock_count == 0 and not node.has_state and len(node.children) == 1:
            self._drop(node)
            self._refresh(self._tree_merge_into_child(node))

    def _touch(self, node: ShadowNode) -> None:
        self.clock += 1.0
        node.last_access = self.clock
        if node.slot >= 0:
            self.index.touch(node.slot, self.clock)

    def _refresh(self, node: ShadowNode) -> None:
        """`HybridPrefixCache._refresh`: a candidate is an unlocked node with no child, or with one
        and a state where the policy evicts such nodes (the root is always locked); its second
        column is its FLOP efficiency (`HybridPrefixCache.flop_efficiency`) or, for SegLen, its
        replay length."""
        children = len(node.children)
        if not node.lock_count and node.parent is not None and (
                children == 0 or (children == 1 and node.has_state and self._evicts_single_child)):
            if not (self._ranks_by_value and (node.has_state or self.attention_only)):
                value = 0.0
            elif self._by_length:
                value = float(node.end - node.parent.end)
            else:
                value = flops_saved_per_byte(self.flops(node.parent.end, node.end),
                                             self.ssm_state_bytes if node.has_state else 0,
                                             0 if children else (node.end - node.start) * self.kv_bytes_per_token)
            if node.slot < 0:
                node.slot = self.index.add(node, node.last_access, value)
            else:
                self.index.update(node.slot, node.last_access, value)
        elif node.slot >= 0:
            self._drop(node)

    def _drop(self, node: ShadowNode) -> None:
        if node.slot < 0:
            return
        moved = self.index.remove(node.slot)
        if moved is not None:
            moved.slot = node.slot
        node.slot = -1

    # -- snapshots -------------------------------------------------------------------------------
    def snapshot(self) -> ShadowSnapshot:
        order: dict[int, int] = {}
        parents, srcs, starts, ends, has_state, last_access = [], [], [], [], [], []
        root = self.root
        for node in self.nodes():
            order[node.id] = len(parents)
            parents.append(order[node.parent.id] if node.parent is not root else -1)
            srcs.append(node.src)
            starts.append(node.start)
            ends.append(node.end)
            has_state.append(node.has_state)
            last_access.append(node.last_access)
        return ShadowSnapshot(parents, srcs, starts, ends, has_state, last_access, self.clock, self.capacity_bytes,
                              self.checkpoint_grid, self.page_size, self.state_slots,
                              tuple(order[n.id] for n in self._probation), self.probation)

    @classmethod
    def from_snapshot(cls, profile, snap: ShadowSnapshot, eviction: EvictionPolicy, *, flops: FlopsTable | None = None):
        cache = cls(profile, snap.capacity_bytes, eviction, checkpoint_grid=snap.checkpoint_grid,
                    page_size=snap.page_size, state_slots=snap.state_slots, probation=snap.keeps_probation,
                    flops=flops)
        built: list[ShadowNode] = []
        root = cache.root
        for parent_idx, src, start, end, state, stamp in zip(snap.parents, snap.srcs, snap.starts, snap.ends,
                                                              snap.has_state, snap.last_access):
            parent = root if parent_idx < 0 else built[parent_idx]
            node = cache._tree_add_leaf(parent, cache._key_at(src, start), src, start, end)
            node.has_state, node.last_access = state, stamp
            cache.kv_tokens += end - start
            cache.ssm_states += state
            built.append(node)
        cache.clock = snap.clock
        cache._probation = ProbationRegistry.of(built[i] for i in snap.probation)
        for node in built:
            cache._refresh(node)
        return cache

    # -- checking --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """`HybridPrefixCache.check_invariants`, and every edge's source agreeing with its path."""
        kv = states = 0
        candidates = set()
        for node in self.nodes():
            kv += node.end - node.start
            states += node.has_state
            assert node.start == node.parent.end and node.end > node.start, node
            assert (node.end - node.start) % self.page_size == 0 and node.end <= len(node.src), node
            assert node.key == self._key_at(node.src, node.start), node
            if node.parent is not self.root:
                assert np.array_equal(node.src[: node.start], node.parent.src[: node.start]), node
            for key, child in node.children.items():
                assert child.parent is node and child.key == key
            children = len(node.children)
            if not node.lock_count and (children == 0 or (children == 1 and node.has_state
                                                          and self._evicts_single_child)):
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
