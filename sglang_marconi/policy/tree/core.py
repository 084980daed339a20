"""The hybrid radix tree's mechanics, written once: KV per edge token, SSM states at node ends
(paper §4), Marconi's admission (§4.1) and eviction walk (§4.2) with candidate upkeep.

`TreeCore` holds every mechanic: lock, unlock, split, compress, add leaf, make room, evict,
touch, the candidate index kept current on every edit (so choosing a victim never walks the
tree), the hit and branch position of a lookup, the admission of a request's states (the one
after its last token and the branch state speculative insertion finds), probationary states,
snapshots and the invariant check. A cache is a configuration of it, filling a few hooks:

- the edge kind, as `tree`: copied edges (`radix_tree.RadixTree`: an edge holds its tokens) or
  referenced edges (`shadow_cache.ReferencedTree`: an edge is a span of the admitting request's
  tokens). A tree provides `root`, `page_size`, `split`, `add_leaf(parent, *edge)`,
  `remove_leaf`, `merge_into_child`, `nodes`, `edge_of`, `restore_leaf(parent, *edge)` (a
  snapshot's edge) and `check_node`.
- the request form, as `_walk(request, n)`: the walk of the request's first n tokens as
  (path, partial, partial_len, overlap) (`radix_tree.Walk`'s fields), and `_request_edge(request,
  start, end)`: the edge arguments of a leaf holding tokens [start, end) of the request.
- the budgets: one byte budget (`capacity_bytes` for KV and states), or `state_slots` (KV bytes
  and a state count, as a serving engine's two pools). A host tier (`tiered_cache`) overrides
  candidate upkeep, eviction, compression and the request flow where a second tier changes them.
- SGLang's tree over a serving engine's two pools (`PoolTree`, below; `served_cache.ServedCache`):
  no compression, SGLang's recency counter, a lock on the reused state beside the path's, running
  requests' holdings in the pools, candidates kept as sets and ranked at the choice, eviction
  walked under one pressure at a time.
- `fixed_choice`: the eviction policy and its weight never change for the cache's life (the
  tuner's shadows): the weight is read once, victims are asked of the index directly, and the
  candidate index's value column is computed only where the choice ranks by it (alpha > 0). A
  cache that may switch (`set_eviction`, or `adopt_choice` changing the weight in place) keeps
  the column current and asks the policy at each eviction.

Bytes: `kv_bytes_per_token` per cached token plus `ssm_state_bytes` per state, from the model
profile; a model without SSM layers (`attention_only`) reuses any cached prefix, mid-edge too.
Probation: with `probation=True` each admission also keeps, best effort, the state at the end of
the request's input, in free room only; a hit confirms it, pressure evicts it first
(`rules/probation.py`).
"""

from __future__ import annotations

import functools
import operator
import types
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules import candidates, score
from sglang_marconi.policy.rules.eviction import EvictionPolicy, FlopAwareEviction, LruLeafEviction, SegLenEviction
from sglang_marconi.policy.rules.probation import ProbationRegistry, evict_oldest_probationary
from sglang_marconi.policy.rules import value as value_rule
from sglang_marconi.policy.tree.own_code import origin, own_copies
from sglang_marconi.policy.tree.radix_tree import PoolNode, RadixTree

# Policies whose `choose` is `candidates.lowest(alpha)` (LRU: alpha 0): under a fixed choice the
# core asks the index directly, saving a call per eviction; any other policy is asked through `choose`.
_CHOOSE_LOWEST = {FlopAwareEviction.choose, LruLeafEviction.choose, SegLenEviction.choose}


@dataclass(frozen=True, slots=True)
class TreeSnapshot:
    """A picklable copy of a cache's contents: nodes in parent-first order."""

    parents: list[int]  # index into the node list, -1 for a child of the root
    edges: list[tuple]  # each node's edge as its tree keeps it (`edge_of`, the arguments of `restore_leaf`)
    has_state: list[bool]
    last_access: list[float]
    clock: float
    capacity_bytes: int
    checkpoint_grid: int
    page_size: int
    state_slots: int | None = None
    probation: tuple[int, ...] = ()  # indexes (in `parents` order) of probationary states, oldest first
    keeps_probation: bool = False


@dataclass(slots=True)
class CacheCounters:
    evictions_leaf: int = 0
    evictions_single_child: int = 0
    admissions_skipped: int = 0


class FlopsTable(dict):
    """profile.prefill_flops(start, end), remembered: a cache refreshes the same spans over and over.
    `table(start, end)`, or `table[start, end]` (a remembered span then costs no Python call)."""

    __slots__ = ("profile",)
    LIMIT = 1 << 18

    def __init__(self, profile):
        super().__init__()
        self.profile = profile

    def __missing__(self, span: tuple[int, int]) -> float:
        if len(self) >= self.LIMIT:
            self.clear()
        flops = self[span] = self.profile.prefill_flops(*span)
        return flops

    def __call__(self, start: int, end: int) -> float:
        return self[start, end]

    def of_prefixes(self, ends) -> list[float]:
        """[self(0, end) for end in ends] (the tuner's gains: one per cache per request)."""
        return [self[0, end] for end in ends]


def _stamp_recency(index, slot: int, clock: float) -> None:
    index.last_access[slot] = clock


def check_capacity(profile, capacity_bytes, state_slots) -> None:
    """One line naming the bad value, for a budget that is no integer or that no admission fits."""
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


class TreeCore:
    """The mechanics; a configuration calls `_configure` from its constructor."""

    # Whether a node just locked must be refreshed even if it is not listed: its ancestors' values
    # (`value_reaches_up`) or another index (the host tier's) may list it.
    _lock_refreshes_unlisted = False
    # Whether stateless single-child nodes fold away (the paper's compressed tree; SGLang's keeps them).
    _compressed = True
    # Whether `_request_edge(request, start, end)` is (request, start, end) itself (an admission's
    # new leaf then passes them to the tree without asking).
    _request_edge_is_span = False

    # The methods a request runs through: each configuration class runs its own copy (`own_code.py`).
    _hot_methods = ("_hit", "_admit", "_make_room", "evict", "_evict_one", "_refresh", "_drop", "lock", "unlock",
                    "flop_efficiency", "_touch", "_touch_hit", "_add_leaf", "_split", "_compress", "_node_on",
                    "_forget_state", "_remove_leaf", "_rescore_stated_ancestor")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own_copies(cls, cls._hot_methods)

        def core(name: str) -> bool:  # whether `cls` keeps the core's method (its own copy of it or the original)
            return origin(getattr(cls, name)) is getattr(TreeCore, name)

        # Where a configuration keeps the core's touch, or its state and leaf removal, the hot paths
        # (a lookup's hit, an admission, an eviction) do them inline rather than through the hooks.
        cls._core_touch = core("_touch") and core("_touch_hit")
        cls._core_removal = core("_forget_state") and core("_remove_leaf") and core("_compress")
        # Where it keeps the core's leaf, touch and candidate upkeep too, an admission's new leaf is
        # listed once, with its state (`_admit`), rather than listed stateless and then re-scored.
        # Where it keeps the core's candidate upkeep, an unlock tests the candidate predicate inline and
        # calls `_refresh` only for a node it lists (a locked node is never listed: `lock`).
        cls._core_refresh = core("_refresh") and core("_is_candidate") and core("_compress")
        cls._core_leaf = cls._core_touch and core("_add_leaf") and cls._core_refresh

    def _configure(self, profile, capacity_bytes: int, eviction: EvictionPolicy | None, tree, index, *,
                   checkpoint_grid: int = 1, state_slots: int | None = None, probation: bool = False,
                   flops=None, fixed_choice: bool = False, counters=None) -> None:
        if not isinstance(checkpoint_grid, int) or checkpoint_grid < 1:
            raise MarconiError(f"checkpoint_grid must be a positive integer, got {checkpoint_grid!r}")
        self.profile = profile
        self.capacity_bytes = int(capacity_bytes)
        self.state_slots = None if state_slots is None else int(state_slots)
        self.checkpoint_grid = checkpoint_grid
        self.kv_bytes_per_token = int(profile.kv_bytes_per_token)
        self.ssm_state_bytes = int(profile.ssm_state_bytes)
        # A pure Transformer needs no SSM state to reuse a prefix (the paper's pure-attention axis).
        self.attention_only = self.ssm_state_bytes == 0
        self.flops = flops if flops is not None else FlopsTable(profile)
        self.tree = tree
        self.index = index
        touch = getattr(index, "touch", None)
        self._stamp_recency = touch if touch is not None else functools.partial(_stamp_recency, index)
        self.kv_tokens = 0
        self.ssm_states = 0
        self.clock = 0.0
        self.counters = counters if counters is not None else CacheCounters()
        self.probation = probation
        self._probation = ProbationRegistry()
        self._fixed_choice = fixed_choice
        # A configuration may bring its own candidate predicate; else `_refresh` applies this one inline.
        self._candidates_overridden = type(self)._is_candidate is not TreeCore._is_candidate
        self.eviction = None
        # No policy (a pool tree ranks its candidates at the choice): no index column to keep.
        self._refresh_every_locked = self._lock_refreshes_unlisted
        if eviction is not None:
            self.set_eviction(eviction)

    # -- accounting ------------------------------------------------------------------------------
    def bytes_of(self, kv_tokens: int, states: int) -> int:
        return kv_tokens * self.kv_bytes_per_token + states * self.ssm_state_bytes

    @property
    def used_bytes(self) -> int:
        return self.bytes_of(self.kv_tokens, self.ssm_states)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def _fits(self, kv_bytes: int, new_states: int) -> bool:
        if self.state_slots is None:
            return self.free_bytes >= kv_bytes + new_states * self.ssm_state_bytes
        return (self.kv_tokens * self.kv_bytes_per_token + kv_bytes <= self.capacity_bytes
                and self.ssm_states + new_states <= self.state_slots)

    # -- the eviction choice ---------------------------------------------------------------------
    def set_eviction(self, eviction: EvictionPolicy) -> None:
        """Switch eviction policy (alpha tuning may move between LRU and FLOP-aware eviction)."""
        if eviction is self.eviction:
            return
        self.eviction = eviction
        self._evicts_single_child = eviction.evicts_single_child_nodes
        value = getattr(eviction, "node_value", None)
        # The candidate index's second column: FLOP efficiency, unless the policy brings its own.
        # (a bound method, not a partial: the interpreter calls it without a C-level hop)
        self._node_value = self.flop_efficiency if value is None else types.MethodType(value, self)
        self._value_reaches_up = getattr(eviction, "value_reaches_up", False)
        # (a configuration's own rules object may bring neither: it then touches and admits its own way)
        self._refresh_matched_path = getattr(eviction, "refresh_matched_path", False)
        # A rule that learns from the stream is told of each admission (`observe_request`).
        observe = getattr(type(eviction), "observe_request", EvictionPolicy.observe_request)
        self._observes = observe is not EvictionPolicy.observe_request
        self._refresh_every_locked = self._lock_refreshes_unlisted or self._value_reaches_up
        fixed_lowest = self._fixed_choice and type(eviction).choose in _CHOOSE_LOWEST
        self._alpha = getattr(eviction, "alpha", 0.0) if fixed_lowest else None
        # At alpha 0 (LRU, FLOP-aware at 0) the second column ranks nothing and is never read.
        self._ranks_by_value = bool(self._alpha) if self._fixed_choice else True
        for node in self.tree.nodes():
            self._refresh(node)

    def flop_efficiency(self, node) -> float:
        """Eq. 1 (`rules/value.py`): FLOPs saved by reusing `node` rather than its parent, per byte its eviction
        would free (a leaf frees KV and state, a single-child node only its state). A node
        without a state saves nothing on its own, unless the model has no SSM layers."""
        if not (node.has_state or self.attention_only):
            return 0.0
        return value_rule.flops_saved_per_byte(self.flops[node.parent.end, node.end],
                                    self.ssm_state_bytes if node.has_state else 0,
                                    0 if node.children else (node.end - node.parent.end) * self.kv_bytes_per_token)

    # -- candidate upkeep --------------------------------------------------------------------------
    def _is_candidate(self, node) -> bool:
        """An unlocked node with no child, or with one and a state where the policy evicts such
        nodes (the root is always locked)."""
        children = len(node.children)
        return not node.lock_count and node.parent is not None and (
            children == 0 or (children == 1 and node.has_state and self._evicts_single_child))

    def _refresh(self, node) -> None:
        """List, re-score or unlist `node` after any edit at it."""
        children = len(node.children)
        if (self._is_candidate(node) if self._candidates_overridden else  # else `_is_candidate`, inline: the hot path
                not node.lock_count and node.parent is not None and (
                    children == 0 or (children == 1 and node.has_state and self._evicts_single_child))):
            value = self._node_value(node) if self._ranks_by_value else 0.0
            if node.slot < 0:
                node.slot = self.index.add(node, node.last_access, value)
            else:
                self.index.update(node.slot, node.last_access, value)
        elif node.slot >= 0:
            self._drop(node)
        if self._value_reaches_up:
            self._rescore_stated_ancestor(node)

    def _rescore_stated_ancestor(self, node) -> None:
        # A value that depends on the subtree (coverage) changes with any edit at or below `node`
        # for the nearest ancestor holding a state; every edit refreshes the node it touched.
        root = self.tree.root
        above = node.parent
        while above is not None and above is not root and not (above.has_state or self.attention_only):
            above = above.parent
        if above is not None and above is not root and above.slot >= 0:
            self.index.update(above.slot, above.last_access, self._node_value(above))

    def _drop(self, node) -> None:
        if node.slot < 0:
            return
        moved = self.index.remove(node.slot)
        if moved is not None:
            moved.slot = node.slot
        node.slot = -1

    def _touch(self, node) -> None:
        self.clock += 1.0
        node.last_access = self.clock
        if node.slot >= 0:
            self._stamp_recency(node.slot, self.clock)

    def _touch_hit(self, path: list, hit_node) -> None:
        if self._refresh_matched_path:
            for node in path:
                self._touch(node)
        elif hit_node is not self.tree.root:
            self._touch(hit_node)

    # -- tree edits that keep the candidate index current ----------------------------------------
    def _split(self, child, k: int):
        head = self.tree.split(child, k)
        self._refresh(head)
        self._refresh(child)
        return head

    def _add_leaf(self, parent, *edge):
        leaf = self.tree.add_leaf(parent, *edge)
        self.kv_tokens += leaf.end - parent.end
        leaf.last_access = self.clock
        self._refresh(leaf)
        if parent is not self.tree.root:  # the root is never a candidate
            self._refresh(parent)
        return leaf

    def _compress(self, node) -> None:
        # A stateless node with one child holds nothing an eviction could free: fold it away.
        if node.lock_count == 0 and not node.has_state and len(node.children) == 1:
            self._drop(node)
            self._refresh(self.tree.merge_into_child(node))

    def _node_at(self, request, pos: int):
        """The node ending at `pos` on the request's path, its edge split there if need be."""
        path, partial, partial_len, overlap = self._walk(request, pos)
        assert overlap == pos, "admitted positions lie on the inserted path"
        return self._split(partial, partial_len) if partial else path[-1]

    # -- locks -----------------------------------------------------------------------------------
    def lock(self, node) -> None:
        """Protect `node` and its ancestors from eviction (an in-flight request uses them)."""
        root = self.tree.root
        refresh_all = self._refresh_every_locked
        while node is not root:
            node.lock_count += 1
            if node.lock_count == 1:
                if refresh_all:
                    self._refresh(node)
                elif node.slot >= 0:  # all `_refresh` would do: a locked node is no candidate
                    self._drop(node)
            node = node.parent

    def unlock(self, node) -> None:
        root = self.tree.root
        inline = self._core_refresh and not self._value_reaches_up
        while node is not None and node is not root:
            if node.lock_count <= 0:
                raise MarconiError(f"unlock of {node!r} which is not locked")
            node.lock_count -= 1
            parent = node.parent
            if node.lock_count == 0:
                if inline:  # `_refresh`'s predicate, inline: a deep path's branch nodes are no candidates
                    children = len(node.children)
                    if children == 0 or (children == 1 and node.has_state and self._evicts_single_child):
                        self._refresh(node)
                        node = parent
                        continue
                    if node.slot >= 0:
                        self._drop(node)
                else:
                    self._refresh(node)
                if not node.has_state and len(node.children) == 1:  # what `_compress` asks first
                    self._compress(node)
            node = parent

    # -- eviction --------------------------------------------------------------------------------
    def _make_room(self, kv_bytes: int, new_states: int) -> bool:
        """Evict until `kv_bytes` more KV and `new_states` more states fit; False (nothing
        evicted) for a request that could never fit, or if the candidates ran out."""
        kv_per, state_bytes = self.kv_bytes_per_token, self.ssm_state_bytes
        if self.state_slots is None:  # one budget: what is cached must fit in what the request leaves
            kv_room = self.capacity_bytes - kv_bytes - new_states * state_bytes
            state_room = None
        else:
            kv_room = self.capacity_bytes - kv_bytes
            state_room = self.state_slots - new_states
            if state_room < 0:
                return False
        if kv_room < 0:
            return False
        index, alpha = self.index, self._alpha
        while (self.kv_tokens * kv_per + self.ssm_states * state_bytes > kv_room if state_room is None
               else self.kv_tokens * kv_per > kv_room or self.ssm_states > state_room):
            # `_evict_one`, inline: the shadows' hot loop
            if self.probation and self._probation and self._evict_probationary():
                continue
            if not index.items:
                return False
            self.evict(self.eviction.choose(index) if alpha is None else index.lowest(alpha))
        return True

    def _evict_one(self) -> bool:
        if self.probation and self._probation and self._evict_probationary():
            return True
        if not self.index.items:
            return False
        alpha = self._alpha
        self.evict(self.eviction.choose(self.index) if alpha is None else self.index.lowest(alpha))
        return True

    def _evict_probationary(self) -> bool:
        """Drop the oldest unlocked probationary state (and what only it kept); False if none."""
        return evict_oldest_probationary(self)

    def evict(self, node) -> None:
        """Evict one candidate: a leaf frees its KV and state; a single-child node frees its
        state and its edge is absorbed by its child."""
        slot = node.slot
        assert slot >= 0, f"{node!r} is not an eviction candidate"
        moved = self.index.remove(slot)  # `_drop`
        if moved is not None:
            moved.slot = slot
        node.slot = -1
        core = self._core_removal
        if node.has_state:
            if core:  # `_forget_state`
                if self.probation:
                    self._probation.forget(node)
                node.has_state = False
                self.ssm_states -= 1
            else:
                self._forget_state(node)
        if node.children:
            self.counters.evictions_single_child += 1
            self._refresh(self.tree.merge_into_child(node))
            return
        self.counters.evictions_leaf += 1
        if core:  # `_remove_leaf` of a stateless leaf, then `_compress`'s test
            self.kv_tokens -= node.end - node.parent.end
            parent = self.tree.remove_leaf(node)
            if parent is not self.tree.root:  # the root is never a candidate
                self._refresh(parent)
            if not parent.lock_count and not parent.has_state and len(parent.children) == 1:
                self._compress(parent)
            return
        parent = self._remove_leaf(node)
        self._refresh(parent)
        self._compress(parent)

    def _forget_state(self, node) -> None:
        """`node` loses its state (the node stays)."""
        self._probation.forget(node)
        node.has_state = False
        self.ssm_states -= 1

    def _remove_leaf(self, node):
        """Delete a leaf whole, its state and its own edge's KV; return its parent."""
        if node.has_state:
            self._forget_state(node)
        self.kv_tokens -= node.end - node.parent.end
        return self.tree.remove_leaf(node)

    # -- lookup ----------------------------------------------------------------------------------
    def _hit(self, path: list, partial, overlap: int, input_len: int):
        """The hit of an input whose walk is (path, partial, overlap), refreshing recency:
        (hit tokens, branch position to checkpoint during prefill or None, hit node). At least one
        input token is always left to prefill."""
        limit = input_len - 1
        hit_node = root = self.tree.root
        attention_only = self.attention_only
        for node in path:
            if node.end > limit:
                break
            if node.has_state or attention_only:
                hit_node = node
        if self._core_touch and not self._refresh_matched_path:  # `_touch_hit`: the node hit alone
            if hit_node is not root:
                self.clock = clock = self.clock + 1.0
                hit_node.last_access = clock
                if hit_node.slot >= 0:
                    self._stamp_recency(hit_node.slot, clock)
        else:
            self._touch_hit(path, hit_node)
        if attention_only:  # no SSM layers: any cached prefix is reusable, mid-edge too
            hit = overlap if overlap < limit else limit
            return hit - hit % self.tree.page_size, None, hit_node
        if self.probation and self._probation:
            self._probation.confirm(hit_node)  # a hit confirms a probationary state
        hit = hit_node.end
        if partial is None and (not path or not path[-1].children or path[-1].has_state):
            return hit, None, hit_node  # `_branch_target`'s first answer: no new intermediate node
        branch = self._branch_target(path, partial, overlap, limit)
        return hit, (branch if branch is not None and branch > hit else None), hit_node

    def _branch_target(self, path: list, partial, overlap: int, limit: int) -> int | None:
        """Where inserting the input creates a new intermediate node (it leaves an edge midway, or
        adds a sibling under a node that has children but no state), capped like a hit and floored
        to the checkpoint grid, as SGLang computes its branching position; None if nowhere."""
        if partial is None:
            last = path[-1] if path else None
            if last is None or not last.children or last.has_state:
                return None
        branch = overlap if overlap < limit else limit
        return branch - branch % self.checkpoint_grid

    # -- admission -------------------------------------------------------------------------------
    def _admitted_positions(self, n: int, checkpoint_at: int | None) -> list[int]:
        """Where a request of n (page-aligned) tokens admits states: its end and its branch."""
        if self.attention_only:  # no SSM layers: nothing to checkpoint
            return []
        if checkpoint_at is not None and 0 < checkpoint_at < n and checkpoint_at % self.tree.page_size == 0:
            return [int(checkpoint_at), n]
        return [n]

    def _admit(self, request, n: int, walk, checkpoint_at: int | None, probation_at: int | None) -> int:
        """Cache the request's first n tokens (page-aligned, n > 0; `walk` their walk) with an SSM
        state at n and at `checkpoint_at`; evict to make room. Returns the number of states
        admitted (<= 2, plus a probationary one), 0 if the request could not fit."""
        path, partial, partial_len, overlap = walk
        positions = [n] if checkpoint_at is None and not self.attention_only else self._admitted_positions(n, checkpoint_at)
        new_states = 0
        last = path[-1] if path else None
        for pos in positions:
            # `_state_on`'s first looks, inline: no node of the path ends past its deepest one
            if last is None or last.end < pos or not (last.has_state if last.end == pos else _state_on(path, pos)):
                new_states += 1
        # Lock what the request reuses, the nodes it matched whole (as SGLang locks a running
        # request's prefix), not the edge it leaves mid-way: that edge (another request's private
        # tail) may be evicted for room like any leaf, and the request then caches those tokens
        # itself, so room is made again for them.
        deepest = path[-1] if path else None
        if deepest is not None:
            self.lock(deepest)
        try:
            while True:
                if not self._make_room((n - overlap) * self.kv_bytes_per_token, new_states):
                    self.counters.admissions_skipped += 1
                    return 0
                if partial is None:
                    break  # the whole path is locked: nothing on it moved
                before = overlap
                path, partial, partial_len, overlap = self._walk(request, n)  # the edge may be gone or merged
                if overlap == before:
                    break
            # The nodes along the request's path from here on: locked, so evictions left them whole.
            spine = list(path)
            admitted = 0
            states_at = positions
            if n > overlap:
                attach = self._split(partial, partial_len) if partial else (path[-1] if path else self.tree.root)
                if partial:
                    spine.append(attach)
                if (self._core_leaf and not self._value_reaches_up
                        and (len(positions) == 1 or (len(positions) == 2 and positions[0] == attach.end))):
                    # The end's state goes on the new leaf, the branch's (if any) on the node it hangs
                    # from: `_add_leaf`, then the loop's states, touches and refreshes below, with the
                    # leaf listed once (the same slot and score). `attach` is never a candidate here
                    # (locked, the root, or a split head with two children), so its refreshes list
                    # nothing, and the leaf is scored with its parent's state set, as the loop scores it.
                    if len(positions) == 2:
                        if not attach.has_state:
                            attach.has_state = True
                            self.ssm_states += 1
                            admitted = 1
                        elif self.probation and self._probation:
                            self._probation.confirm(attach)
                        self.clock = attach.last_access = self.clock + 1.0
                    leaf = (self.tree.add_leaf(attach, request, overlap, n) if self._request_edge_is_span
                            else self.tree.add_leaf(attach, *self._request_edge(request, overlap, n)))
                    self.kv_tokens += leaf.end - attach.end
                    leaf.has_state = True
                    self.ssm_states += 1
                    self.clock = leaf.last_access = self.clock + 1.0
                    # `_refresh(leaf)`: an unlocked childless node is listed; `_refresh(attach)` lists
                    # nothing (`attach` is no candidate and, locked or new, unlisted)
                    leaf.slot = self.index.add(leaf, leaf.last_access,
                                               self._node_value(leaf) if self._ranks_by_value else 0.0)
                    spine.append(leaf)
                    states_at = ()
                    admitted += 1
                else:
                    spine.append(self._add_leaf(attach, *self._request_edge(request, overlap, n)))
            elif partial:
                spine.append(partial)
            core_touch = self._core_touch
            for pos in states_at:
                node = spine[-1]  # the request's end is the deepest node's (`_node_on`'s first look)
                if node.end != pos:
                    node = self._node_on(spine, pos)
                if not node.has_state:
                    node.has_state = True
                    self.ssm_states += 1
                    admitted += 1
                elif self.probation and self._probation:
                    self._probation.confirm(node)  # a regular state where a probationary one was
                if core_touch:  # `_touch`
                    self.clock = clock = self.clock + 1.0
                    node.last_access = clock
                    if node.slot >= 0:
                        self._stamp_recency(node.slot, clock)
                else:
                    self._touch(node)
                self._refresh(node)
            if (self.probation and probation_at is not None and positions and 0 < probation_at < n
                    and probation_at % self.tree.page_size == 0 and probation_at not in positions):
                admitted += self._admit_probationary(request, n, int(probation_at))
            return admitted
        finally:
            if deepest is not None:
                self.unlock(deepest)
            if self._observes:
                self.eviction.observe_request(self, request, n)  # a rule that learns from the stream (`eviction/depth.py`)

    def _node_on(self, spine: list, pos: int):
        """The node ending at `pos` on the admitted path (`spine`, root side first), its edge split
        there if `pos` falls inside it (`_node_at` without walking again). Searched from the deep
        end, as `_state_on`."""
        for j in range(len(spine) - 1, -1, -1):
            node = spine[j]
            if node.start < pos:
                if node.end == pos:
                    return node
                head = self._split(node, pos - node.start)
                spine.insert(j, head)
                return head
        raise AssertionError("admitted positions lie on the inserted path")

    def _admit_probationary(self, request, n: int, pos: int) -> int:
        """A probationary state at `pos`, if it fits without evicting anything but other
        probationary states (the request's own path is locked meanwhile)."""
        path, partial, _, _ = self._walk(request, pos)
        node = path[-1] if partial is None and path else None
        if node is not None and node.has_state:
            return 0
        full = self._walk(request, n)[0]
        deepest = full[-1] if full else None
        if deepest is not None:
            self.lock(deepest)
        try:
            while not self._fits(0, 1) and self._evict_probationary():
                pass
            if not self._fits(0, 1):
                return 0
            node = self._node_at(request, pos)
            node.has_state = True
            self.ssm_states += 1
            self._probation.add(node)
            self._refresh(node)
            return 1
        finally:
            if deepest is not None:
                self.unlock(deepest)

    # -- snapshots (alpha tuning replays a window from one) ---------------------------------------
    def snapshot(self) -> TreeSnapshot:
        order: dict[int, int] = {}
        parents, edges, has_state, last_access = [], [], [], []
        root = self.tree.root
        edge_of = self.tree.edge_of
        for node in self.tree.nodes():
            order[node.id] = len(parents)
            parents.append(order[node.parent.id] if node.parent is not root else -1)
            edges.append(edge_of(node))
            has_state.append(node.has_state)
            last_access.append(node.last_access)
        return TreeSnapshot(parents, edges, has_state, last_access, self.clock, self.capacity_bytes,
                            self.checkpoint_grid, self.tree.page_size, self.state_slots,
                            tuple(order[n.id] for n in self._probation), self.probation)

    def _load_snapshot(self, snap: TreeSnapshot) -> None:
        """Rebuild an empty cache's contents from `snap`."""
        built: list = []
        root = self.tree.root
        restore_leaf = self.tree.restore_leaf
        for parent_idx, edge, state, stamp in zip(snap.parents, snap.edges, snap.has_state, snap.last_access):
            parent = root if parent_idx < 0 else built[parent_idx]
            node = restore_leaf(parent, *edge)
            node.has_state, node.last_access = state, stamp
            self.kv_tokens += node.end - parent.end
            self.ssm_states += state
            built.append(node)
        self.clock = snap.clock
        self._probation = ProbationRegistry.of(built[i] for i in snap.probation)
        for node in built:
            self._refresh(node)

    # -- comparing two caches --------------------------------------------------------------------
    def same_contents(self, other) -> bool:
        """Whether `other`, a cache of the same configuration under the same rule, holds what this
        one holds so that, fed the same stream from here on, the two evict alike (a tuner's stand-in
        for the live cache merges into a shadow so: `shadow_tuner._LiveStandIn`). Between requests.

        The same nodes (tokens, ends, states), recency stamps exactly one offset apart, the clocks'
        (every rule ranks recency min-max normalized or as an age: each difference of two stamps,
        rounded once, is then the same float in both), the same order of node age (the candidate
        indexes break exact ties by node id), the same probationary states in the same order, and
        what a configuration adds (`_same_rest`). O(nodes)."""
        if (self.kv_tokens, self.ssm_states) != (other.kv_tokens, other.ssm_states):
            return False
        ours, theirs, our_ids, their_ids = [], [], [], []
        twin: dict = {}  # our node id -> the other's node
        same_edge = self._same_edge
        pending = [(self.tree.root, other.tree.root)]
        while pending:
            x, y = pending.pop()
            if len(x.children) != len(y.children):
                return False
            for key, cx in x.children.items():
                cy = y.children.get(key)
                if cy is None or cx.end != cy.end or cx.has_state != cy.has_state or not same_edge(cx, cy):
                    return False
                ours.append(cx.last_access)
                theirs.append(cy.last_access)
                our_ids.append(cx.id)
                their_ids.append(cy.id)
                twin[cx.id] = cy
                pending.append((cx, cy))
        return (exactly_offset(ours, theirs, self.clock - other.clock)
                and np.array_equal(np.argsort(our_ids), np.argsort(their_ids))
                and same_nodes([twin[n.id] for n in self._probation], other._probation)
                and self._same_rest(other, twin))

    @staticmethod
    def _same_edge(x, y) -> bool:
        return np.array_equal(x.tokens, y.tokens)

    def _same_rest(self, other, twin: dict) -> bool:
        """What a configuration keeps beyond the tree that decides its evictions, the same in
        `other` (`twin`: our node id -> the other's node)."""
        return True

    # -- checking --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping disagrees with the tree."""
        kv = states = 0
        listed = set()
        indexed = self.index is not None
        for node in self.tree.nodes():
            kv += node.end - node.parent.end
            states += node.has_state
            self.tree.check_node(node)
            if indexed and self._is_candidate(node):
                listed.add(node.id)
                assert self.index.items[node.slot] is node, node
            else:
                assert node.slot < 0, node
            assert (not self._compressed or node.has_state or len(node.children) != 1
                    or node.lock_count), f"uncompressed {node!r}"
        assert kv == self.kv_tokens and states == self.ssm_states, (kv, self.kv_tokens, states, self.ssm_states)
        for node in self._probation:
            assert node.has_state and node.parent is not None, f"stale probationary state {node!r}"
        assert self.probation or not self._probation
        assert not indexed or listed == {n.id for n in self.index.items}
        if self.state_slots is None:
            assert self.used_bytes <= self.capacity_bytes
        else:
            assert self.kv_tokens * self.kv_bytes_per_token <= self.capacity_bytes and self.ssm_states <= self.state_slots


def _state_on(path: list, pos: int) -> bool:
    """Whether a node of `path` (root side first) ends at `pos` with a state. Searched from the
    deep end: the admitted positions are the request's end and its branch, near the end."""
    for j in range(len(path) - 1, -1, -1):
        node = path[j]
        if node.end <= pos:
            return node.end == pos and node.has_state
    return False


def exactly_offset(ours, theirs, offset: float) -> bool:
    """Whether ours[i] - theirs[i] == offset exactly, as real numbers, for every i (a rounded
    difference can equal the offset when the exact one does not: the error of each subtraction,
    by Knuth's TwoSum, must be 0 too)."""
    a = np.asarray(ours, dtype=float)
    b = -np.asarray(theirs, dtype=float)
    s = a + b
    b_part = s - a
    error = (a - (s - b_part)) + (b - b_part)
    return bool(np.all(s == offset) and not np.any(error))


def same_nodes(ours, theirs) -> bool:
    """Whether two sequences hold the same node objects in the same order."""
    ours, theirs = list(ours), list(theirs)
    return len(ours) == len(theirs) and all(x is y for x, y in zip(ours, theirs))


class TokenArrayRequests:
    """The request form of a copied-edge tree (`radix_tree.RadixTree`): a token array."""

    def _walk(self, seq, n: int):
        walk = self.tree.walk(seq[:n] if n < len(seq) else seq)
        return walk.path, walk.partial, walk.partial_len, walk.overlap

    @staticmethod
    def _request_edge(seq, start: int, end: int) -> tuple:
        return (seq[start:end],)


_STAMP_STEP = 0.00001  # a match stamps the node hit's ancestors this much older, level by level (SGLang's)
_node_id = operator.attrgetter("id")


def _recency_then_id(node) -> tuple:
    return node.last_access, node.id


def _state_recency_then_id(node) -> tuple:
    return node.state_time, node.id


def _no_value(node, leaf: bool) -> float:
    return 0.0


class PoolTree(TreeCore):
    """A configuration of `TreeCore`: SGLang's radix tree over a serving engine's two pools, KV
    token slots and state slots, as its `UnifiedRadixCache` runs it. What it changes in the core's
    mechanics:

    - No compression (`_compressed`): split points, tombstoned states and stateless leaves stay as
      nodes (a deleted leaf frees only its own edge); nodes are `PoolNode`s.
    - Recency is SGLang's counter (`_tick`, advanced where SGLang advances it): two ticks per new
      node, a split restamps the node it cut, an insert stamps every node it walks
      (`_insert_state`), a match stamps the node hit and its ancestors (`_match_reused`); a
      state's own recency (`state_time`, ranked under state pressure) is when it was last
      committed or reused.
    - Two locks: a running request holds the KV of its reused path (`lock_count`, the core's
      `lock`) and the reused node's state (`state_lock`): `lock_reused` / `unlock_reused`.
    - The pools: `kv_slots` and `state_slots`, of which running requests hold `held_kv` and
      `held_states` outside the tree; `_free_up` walks one pressure at a time until an allocation
      fits (SGLang's `evict_for_alloc`): under KV pressure the unlocked leaves, deleted whole;
      under state pressure probationary states first (oldest), then a candidate state
      (`rules/candidates.py`: a leaf goes whole, a single-child node loses its state), else the
      least recently used unlocked state (`lru_states`: always that one, SGLang's LRU).
    - Candidates are kept as sets on every edit (the childless nodes; the stated nodes, least
      recently used first) and ranked when a victim is asked for: a value counts from the node's
      anchor (`rules/value.py`), which edits above it move. The configuration brings the value
      (`_candidate_value(node, leaf)`, read only where the rule reads values: `_reads_values`) and
      the score's weight (`weight`), scored as `CandidateIndex.lowest` scores a small index, ties
      to the smallest node id (`_lowest_of`, which a configuration may replace); a rule that ranks
      by recency alone (weight 0) takes the oldest candidate. `_record(pressure, kind, node)` is
      told of each eviction.
    - `same_contents` also compares what lies outside the tree: nothing held, and the states'
      own recency order and stamps.
    """

    _compressed = False

    def _configure_pools(self, profile, kv_slots: int, state_slots: int, *, probation: bool, counters) -> None:
        self._configure(profile, int(kv_slots) * int(profile.kv_bytes_per_token), None, RadixTree(1, PoolNode), None,
                        state_slots=state_slots, probation=probation, counters=counters)
        self.kv_slots = int(kv_slots)
        self.held_kv = 0
        self.held_states = 0
        self._childless: dict[int, PoolNode] = {}  # nodes without children, locked or not
        self._state_recency: OrderedDict[int, PoolNode] = OrderedDict()  # stated nodes, least recent first
        self.weight = 0.0
        self.lru_states = False
        root = self.tree.root
        root.last_access = self._tick()  # SGLang's node: last_access_time, then creation_time
        self._tick()

    @property
    def kv_free(self) -> int:
        return self.kv_slots - self.kv_tokens - self.held_kv

    @property
    def state_free(self) -> int:
        return self.state_slots - self.ssm_states - self.held_states

    def _tick(self) -> float:
        """SGLang's time counter: the time now, then advanced."""
        now = self.clock
        self.clock = now + 1.0
        return now

    def _record(self, pressure: str, kind: str, node) -> None:
        """An eviction is about to happen (a configuration may keep a log)."""

    # -- the core's edits, on an uncompressed tree with candidate sets ----------------------------
    def _refresh(self, node) -> None:
        """No index to keep: candidates are ranked at the choice."""

    def _compress(self, node) -> None:
        """SGLang keeps stateless single-child nodes."""

    def _split(self, child, k: int):
        head = super()._split(child, k)  # the head holds the path's KV lock, as SGLang's split copies it
        tick = self._tick
        head.last_access = tick()  # a new node's two ticks; the node cut is restamped
        tick()
        child.last_access = tick()
        return head

    def _add_leaf(self, parent, *edge):
        leaf = super()._add_leaf(parent, *edge)
        leaf.last_access = self._tick()  # a new node's two ticks
        self._tick()
        self._childless.pop(parent.id, None)
        self._childless[leaf.id] = leaf
        return leaf

    def _state_used(self, node) -> None:
        """`node`'s state was just committed or reused: the most recent."""
        recency = self._state_recency
        recency[node.id] = node
        recency.move_to_end(node.id)
        node.state_time = self._tick()

    def _forget_state(self, node) -> None:
        super()._forget_state(node)
        del self._state_recency[node.id]

    def _remove_leaf(self, node):
        parent = super()._remove_leaf(node)
        del self._childless[node.id]
        if not parent.children and parent is not self.tree.root:
            self._childless[parent.id] = parent
        return parent

    def _drop_state(self, node) -> None:
        """A state-pressure victim: an evictable leaf goes whole, any other node loses its state."""
        if self._is_evictable_leaf(node):
            self._remove_leaf(node)
        else:
            self._forget_state(node)

    def _is_evictable_leaf(self, node) -> bool:
        return not node.children and not node.lock_count and not node.state_lock and node is not self.tree.root

    # -- locks -----------------------------------------------------------------------------------
    def lock_reused(self, node) -> None:
        """A running request's reused prefix: the KV of `node`'s path and `node`'s state."""
        if node is self.tree.root:
            return
        node.state_lock += 1
        self.lock(node)

    def unlock_reused(self, node) -> None:
        if node is self.tree.root:
            return
        assert node.state_lock > 0, node
        node.state_lock -= 1
        self.unlock(node)

    # -- match and insert ------------------------------------------------------------------------
    def _match_reused(self, key, barred=None):
        """SGLang's match of `key`: the edge it leaves midway is split there, the deepest node on
        its path holding a state is reused (its state refreshed and confirmed), and that node and
        its ancestors are stamped. `barred(walk)`: nodes on the walk whose states may not be
        reused. Returns (node reused, or the root; tokens of KV matched)."""
        root = self.tree.root
        if not len(key):
            return root, 0  # SGLang's empty match: nothing walked, nothing stamped
        walk = self.tree.walk(key)
        best = root
        skip = barred(walk) if barred is not None else ()
        for node in walk.path:
            if node.has_state and node not in skip:
                best = node
        if walk.partial is not None:
            self._split(walk.partial, walk.partial_len)
        if best.has_state:
            self._state_used(best)
            self._probation.confirm(best)
        stamp = self._tick()
        node = best
        while node is not None:
            node.last_access = stamp
            stamp -= _STAMP_STEP
            node = node.parent
        return best, walk.overlap

    def _insert_state(self, key, probationary: bool):
        """SGLang's insert of `key` with a state at its end (a probationary one if `probationary`
        and new): (node, whether it held a state already, tokens of KV that were cached)."""
        tick = self._tick
        tick()  # the insert touches the root
        walk = self.tree.walk(key)
        for node in walk.path:
            node.last_access = tick()
        node = walk.path[-1] if walk.path else self.tree.root
        if walk.partial is not None:
            walk.partial.last_access = tick()
            node = self._split(walk.partial, walk.partial_len)
        overlap, n = walk.overlap, len(key)
        if overlap < n:
            node = self._add_leaf(node, key[overlap:].copy())
        else:
            node.last_access = tick()
        existed = node.has_state
        if not existed:
            node.has_state = True
            self.ssm_states += 1
        self._state_used(node)
        if not probationary:
            self._probation.confirm(node)
        elif not existed:
            self._probation.add(node)
        return node, existed, overlap

    def _whole_edges(self, key) -> list:
        """The nodes whose whole edge `key` follows from the root, in order (nothing changes)."""
        return self.tree.walk(key).path

    # -- eviction --------------------------------------------------------------------------------
    def _free_up(self, kv: int = 0, states: int = 0, probation_only: bool = False) -> None:
        """Walk until `kv` more KV slots (KV pressure) or `states` more state slots (state
        pressure) are free than now, or nothing more can go; `probation_only`: probationary
        states only."""
        if kv > 0 and not probation_only:
            target = self.kv_free + kv
            while self.kv_free < target:
                node = self._kv_victim()
                if node is None:
                    break
                self._record("kv", "leaf", node)
                self.counters.evictions_leaf += 1
                self._remove_leaf(node)
        if states > 0:
            target = self.state_free + states
            freed = 0
            while self.state_free < target and freed < states:
                if not self._evict_state(probation_only):
                    break
                freed += 1

    def _evict_state(self, probation_only: bool) -> bool:
        c = self.counters
        if self.probation or probation_only:
            node = self._probation.oldest_unlocked(_state_locked)
            if node is not None:
                self._record("mamba", "probationary", node)
                c.evictions_probationary += 1
                self._drop_state(node)
                return True
            if probation_only:
                return False
        if self.lru_states:
            node, kind = self._least_recent_unlocked_state(), "lru"
        else:
            node, kind = self._state_victim(), None
            if node is None:
                node, kind = self._least_recent_unlocked_state(), "fallback"
        if node is None:
            return False
        if kind == "fallback":
            c.evictions_fallback += 1
        elif self._is_evictable_leaf(node):
            kind = "leaf"
            c.evictions_leaf += 1
        else:
            kind = "single_child"
            c.evictions_single_child += 1
        self._record("mamba", kind, node)
        self._drop_state(node)
        return True

    def _kv_victim(self):
        """The lowest-scoring unlocked leaf (a stateless one is worth nothing), or None."""
        unlocked = [n for n in self._childless.values() if not n.lock_count and not n.state_lock]
        if not unlocked:
            return None
        if self._kv_ranks_recency_alone:  # the oldest, exact ties to the smallest node id
            return min(unlocked, key=_recency_then_id)
        value = self._candidate_value if self._reads_values else _no_value
        return self._lowest_of(unlocked, [n.last_access for n in unlocked],
                               [value(n, True) if n.has_state else 0.0 for n in unlocked])

    def _state_victim(self):
        """The lowest-scoring state candidate, ranked by its state's recency, or None."""
        is_leaf, state_candidate = self._is_evictable_leaf, candidates.state_candidate
        found, leaves = [], []
        for node in self._state_recency.values():
            leaf = is_leaf(node)
            if state_candidate(node.state_lock, leaf, len(node.children)):
                found.append(node)
                leaves.append(leaf)
        if not found:
            return None
        if self._ranks_recency_alone:
            return min(found, key=_state_recency_then_id)
        value = self._candidate_value if self._reads_values else _no_value
        return self._lowest_of(found, [n.state_time for n in found], list(map(value, found, leaves)))

    def _lowest_of(self, nodes: list, recency: list, values: list):
        """The victim among candidates given as parallel lists: the lowest weighted score
        (`rules/score.py`, scored as `CandidateIndex.lowest` scores them), exact ties to the
        smallest node id. A configuration may rank by another rule."""
        scores = score.score_each(score.scale(min(recency), max(recency), min(values), max(values), self.weight),
                                  recency, values)
        return nodes[score.lowest_slot(scores, lambda slots: min(slots, key=lambda i: nodes[i].id))]

    @property
    def _ranks_recency_alone(self) -> bool:
        """Whether the rule in force ranks candidates by recency alone (the oldest goes, exact ties
        to the smallest node id): a weight of 0, and no other rule in `_lowest_of`."""
        return not self.weight

    @property
    def _kv_ranks_recency_alone(self) -> bool:
        """The same, of the leaves under KV pressure (a rule may rank them apart from the states)."""
        return self._ranks_recency_alone

    # Whether the rule in force reads the candidates' values (`_candidate_value`); else they are 0.
    _reads_values = True

    def _least_recent_unlocked_state(self):
        for node in self._state_recency.values():
            if not node.state_lock:
                return node
        return None

    # -- comparing two caches --------------------------------------------------------------------
    def _same_rest(self, other, twin: dict) -> bool:
        """Nothing held outside the tree, and the states ranked by their own recency in the same
        order, their stamps the same offset apart as the nodes' (`same_contents`)."""
        if self.held_kv or self.held_states or other.held_kv or other.held_states:
            return False
        ours = list(self._state_recency.values())
        return (same_nodes([twin[n.id] for n in ours], other._state_recency.values())
                and exactly_offset([n.state_time for n in ours],
                                   [n.state_time for n in other._state_recency.values()], self.clock - other.clock))

    # -- checking --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The core's checks, and the candidate sets and the two ledgers agree with the tree."""
        super().check_invariants()
        nodes = list(self.tree.nodes())
        assert {n.id for n in nodes if n.has_state} == set(self._state_recency)
        assert {n.id for n in nodes if not n.children} == set(self._childless)
        assert self.held_kv >= 0 and self.held_states >= 0
        assert self.kv_free >= 0 and self.state_free >= 0, (self.kv_free, self.state_free)


def _state_locked(node) -> int:
    return node.state_lock
