"""Two-tier prefix cache for hybrid models: `HybridPrefixCache`'s device tier plus a host tier.

A configuration of `core.TreeCore` (copied edges whose nodes carry tier flags): the core's locks,
leaf insertion, room making and lookup pieces run as they are; candidate upkeep (a second index),
eviction (the tier rules), splits (tier flags), compression (only edges on the same tiers merge)
and the request flow (load back, re-evicted KV) are this module's.

The model (what `--host-capacity` simulates; SGLang's HiCache with `--hicache-write-policy
write_back` is the system modeled):

- One radix tree holds both tiers, as SGLang's unified tree does. Each node's edge KV is on the
  device, on the host, or on both; the SSM state at its end likewise. Device-resident KV is closed
  under ancestors (the device only ever evicts device leaves, and every load or admission puts a
  whole path on the device); every node's KV is on at least one tier (a node whose KV leaves both
  is removed with its subtree, which could no longer be reached).
- Bytes: `kv_bytes_per_token` per cached token and `ssm_state_bytes` per state on each tier, from
  the model profile; the device holds at most `capacity_bytes`, the host at most
  `host_capacity_bytes` (each one budget for KV and states; SGLang splits its host pool by the
  device pools' ratio, which one byte budget leaves to the policy).
- Admission is Marconi's (the state after the last decoded token, the branch state speculative
  insertion finds), as on the device alone; a host-only node the request passes through gets
  the request's KV on the device again and keeps its host copy (a duplicate), as SGLang's
  insert does.
- A request's hit is the deepest node of its path with a state on either tier (KV is there by
  construction). If that needs the host (the state, or KV of the path, is host-only), it is
  loaded back: the device makes room (evicting as for an admission, the path locked) and the
  loaded copies stay on the host too (SGLang keeps them; a later demotion then copies nothing).
  If the device cannot make room, the hit falls back to the deepest point reusable from the
  device alone. Tier credit: `device_hit_tokens` is that device-only point, the rest of the hit
  came from the host (`hit_tokens - device_hit_tokens`), with `loaded_bytes` copied host to
  device. What a load back costs in time is the simulator's business (`sim/host_link.py`: bytes
  over the host link, added to the modeled TTFT); the policy core counts the bytes.
- Device eviction: the device's `EvictionPolicy` picks the victim among its candidates (device
  leaves, and single-child nodes whose state is on the device where the policy evicts those);
  the `TierRules` (`policy/rules/tier_rules.py`) decide from the node's facts what gets (or keeps) a host
  copy, and whether the host must rank it above what it would displace. A client's `24h` hint in
  force on the node (`client_hints`, a hint ledger whose adapter stamps this cache's nodes) is
  one of those facts.
- Host eviction: duplicates first (host copies of what is also on the device: freeing them loses
  nothing), the device's leaves last among them (SGLang's two passes); then the host's own
  candidates, ranked by recency + alpha x FLOPs saved per host byte freed (`alpha` 0: LRU), or,
  under rules that rank by the continuation signal (`MarconiTiering(depth=...)`), by
  `tier_rules.DepthOrder` over each candidate's depth in `continuation` (a `ContinuationRecord`
  this cache feeds once per admitted request, after the admission, as the core feeds a depth
  eviction; shared with a device `DepthEviction` that feeds its own): host-only leaves (KV and
  state), and, under Marconi's rules, host-only states of nodes with at most one child (a branch
  point's state serves every branch).

Not modeled: probation, separate state-slot budgets (SGLang's Mamba-slot pressure, which evicts
internal states on their own; `UpstreamWriteBack` answers for that path too), write-through
policies, storage (L3) tiers, attention-only models. SGLang's load-back threshold (10 tokens)
never binds here: a host hit always loads a state, and a state transfer always loads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.continuation import ContinuationRecord
from sglang_marconi.policy.rules.eviction import EvictionPolicy, FlopAwareEviction
from sglang_marconi.policy.rules.eviction.depth import DepthEviction, core_node_end
from sglang_marconi.policy.tree.core import TokenArrayRequests, TreeCore
from sglang_marconi.policy.tree.host_candidates import HostCandidateIndex
from sglang_marconi.policy.tree.radix_tree import Node, RadixTree, as_token_array
from sglang_marconi.policy.rules.tier_rules import Demotion, EvictionFacts, host_candidate_bytes
from sglang_marconi.policy.rules import value as value_rule


class TieredNode(Node):
    __slots__ = ("kv_dev", "kv_host", "st_dev", "st_host", "hslot", "digest")

    def __init__(self, parent, tokens, end: int, node_id: int):
        super().__init__(parent, tokens, end, node_id)
        self.kv_dev = True  # edge KV on the device
        self.kv_host = False  # edge KV on the host
        self.st_dev = False  # state at `end` on the device
        self.st_host = False  # ... on the host (`has_state` = either)
        self.hslot = -1  # slot in the host candidate index
        self.digest = None  # with verify=True: a digest of the prefix the state summarizes

    def __repr__(self) -> str:
        tiers = lambda dev, host: "dh" if dev and host else "d" if dev else "h" if host else "-"  # noqa: E731
        return (f"TieredNode(id={self.id}, [{self.start},{self.end}), kv={tiers(self.kv_dev, self.kv_host)}, "
                f"state={tiers(self.st_dev, self.st_host)}, children={len(self.children)})")


class _TieredTree(RadixTree):
    def __init__(self, page_size: int):
        super().__init__(page_size)
        self.root = TieredNode(None, np.empty(0, dtype=np.int64), 0, 0)
        self.root.lock_count = 1

    def _new_node(self, parent, tokens, end):
        node = TieredNode(parent, tokens, end, self._next_id)
        self._next_id += 1
        return node

    def split(self, child: TieredNode, k: int) -> TieredNode:
        head = super().split(child, k)
        head.kv_dev, head.kv_host = child.kv_dev, child.kv_host  # the edge's KV stays where it was
        return head


@dataclass(frozen=True, slots=True)
class TieredLookup:
    hit_tokens: int  # reusable now: KV and a state at exactly this length (loaded back if it had to be)
    device_hit_tokens: int  # what the device alone could have served
    overlap_tokens: int
    checkpoint_at: int | None
    hit_node: Node
    loaded_bytes: int  # copied host -> device for this hit

    @property
    def host_hit_tokens(self) -> int:
        return self.hit_tokens - self.device_hit_tokens


@dataclass(slots=True)
class TierCounters:
    evictions_leaf: int = 0  # device evictions of a whole node
    evictions_single_child: int = 0  # device evictions of a state alone
    admissions_skipped: int = 0
    load_backs: int = 0
    load_back_failures: int = 0  # the device could not make room: the hit fell back to the device's
    bytes_loaded: int = 0  # host -> device
    bytes_demoted: int = 0  # device -> host copies
    bytes_dropped: int = 0  # content that left the cache at a device eviction (no host copy kept)
    bytes_evicted_host: int = 0  # content the host evicted (its only copy)
    bytes_reclaimed: int = 0  # host duplicates freed (the device copy stays: nothing lost)
    states_demoted: int = 0
    states_dropped: int = 0  # states lost at a device eviction
    states_evicted_host: int = 0


def _digest(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()


class TieredPrefixCache(TokenArrayRequests, TreeCore):
    _lock_refreshes_unlisted = True  # a locked node leaves the host's candidates too

    def __init__(self, profile, capacity_bytes: int, host_capacity_bytes: int, rules,
                 eviction: EvictionPolicy | None = None, *, checkpoint_grid: int = 1, page_size: int = 1,
                 verify: bool = False, continuation: ContinuationRecord | None = None):
        """`continuation`: the record the host's depth order reads, fed by this cache (a new one by
        default; a device `DepthEviction` feeding its own shares its record instead)."""
        for name, value, low in (("capacity_bytes", capacity_bytes, 1), ("host_capacity_bytes", host_capacity_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise MarconiError(f"{name} must be an integer >= {low}, got {value!r}")
        if profile.ssm_state_bytes == 0:
            raise MarconiError(f"the host-tier model covers hybrid models; {profile.name} has no SSM layers")
        if 2 * profile.ssm_state_bytes > capacity_bytes:
            raise MarconiError(f"capacity_bytes={capacity_bytes} is smaller than one request's two SSM states "
                               f"(2 x {profile.ssm_state_bytes} bytes for {profile.name})")
        self.host_capacity_bytes = int(host_capacity_bytes)
        self.rules = rules
        self.verify = verify
        self.host_index = HostCandidateIndex()
        self.host_kv_tokens = 0
        self.host_states = 0
        # host copies of what is also on the device, in the order they became duplicates
        self._kv_duplicates: dict[int, TieredNode] = {}
        self._state_duplicates: dict[int, TieredNode] = {}
        # tier changes whose tree tidying waits for a safe point (by id: a deterministic order)
        self._unsettled: dict[int, TieredNode] = {}
        self._protected: TieredNode | None = None  # the node being evicted: a candidate of neither tier meanwhile
        # clients' cache hints (`cache_hints.HintLedger` or anything with `kept_for_day(node)`):
        # a node a `24h` credit is in force on is kept on the host (`EvictionFacts.kept_for_client`)
        self.client_hints = None
        # what the host's depth order reads (None: the rules rank by no depth)
        self.continuation: ContinuationRecord | None = None
        if rules.ranks_by_depth:
            own = isinstance(eviction, DepthEviction) and eviction.feeds_record
            self.continuation = (eviction.record if own else continuation if continuation is not None
                                 else ContinuationRecord())
        # kv_tokens and ssm_states count the device's; the index holds the device's candidates
        self._configure(profile, capacity_bytes, eviction if eviction is not None else FlopAwareEviction(0.0),
                        _TieredTree(page_size), CandidateIndex(tie_key=CandidateIndex.node_id),
                        checkpoint_grid=checkpoint_grid, counters=TierCounters())

    # -- accounting ------------------------------------------------------------------------------
    @property
    def host_used_bytes(self) -> int:
        return self.bytes_of(self.host_kv_tokens, self.host_states)

    @property
    def host_free_bytes(self) -> int:
        return self.host_capacity_bytes - self.host_used_bytes

    def _kv_bytes(self, node: TieredNode) -> int:
        return len(node.tokens) * self.kv_bytes_per_token

    # -- request API -----------------------------------------------------------------------------
    def lookup(self, input_tokens) -> TieredLookup:
        """Match the input, load back from the host what the deepest reusable point needs, refresh
        timestamps, and find the branch checkpoint. At least one input token is left to prefill."""
        seq = as_token_array(input_tokens)
        limit = len(seq) - 1
        walk = self.tree.walk(seq)
        target, on_device = self._reusable(walk, limit)
        hit_node, loaded = target, 0
        if target is not on_device:
            loaded = self._load_back(walk, target)
            walk = self.tree.walk(seq)  # making room may have changed the tree beyond the hit
            if not loaded:
                hit_node = on_device
        self._touch_hit(walk.path, hit_node)
        branch = self._branch_target(walk.path, walk.partial, walk.overlap, limit)
        self._settle()
        return TieredLookup(hit_node.end, on_device.end, walk.overlap,
                            branch if branch is not None and branch > hit_node.end else None, hit_node, loaded)

    def _reusable(self, walk, limit: int) -> tuple[TieredNode, TieredNode]:
        """The deepest node of the walk (within `limit`) with a state on either tier, and the
        deepest with one on the device (whose KV is then on the device too)."""
        target = on_device = self.tree.root
        for node in walk.path:
            if node.end > limit:
                break
            if node.has_state:
                target = node
                if node.st_dev:
                    on_device = node
        return target, on_device

    def _load_back(self, walk, target: TieredNode) -> int:
        """Copy to the device what a hit at `target` reads from the host; the bytes, 0 if the
        device could not make room."""
        path = [node for node in walk.path if node.end <= target.end]
        kv_tokens = sum(len(node.tokens) for node in path if not node.kv_dev)
        needed = kv_tokens * self.kv_bytes_per_token + self.ssm_state_bytes
        self.lock(target)
        try:
            if not self._make_room(kv_tokens * self.kv_bytes_per_token, 1):
                self.counters.load_back_failures += 1
                return 0
            for node in path:  # root side first: device KV stays closed under ancestors
                if not node.kv_dev:
                    assert node.kv_host, f"{node!r}: KV on neither tier"
                    self._set_kv(node, dev=True)
            assert target.st_host and not target.st_dev, target
            if self.verify:
                assert target.digest == _digest(walk_tokens(target)), f"{target!r} restored another prefix's state"
            self._set_state(target, dev=True)
            for node in path:
                self._refresh(node)
                self._refresh(node.parent)
            self.counters.load_backs += 1
            self.counters.bytes_loaded += needed
            return needed
        finally:
            self.unlock(target)

    def admit(self, sequence, checkpoint_at: int | None = None) -> int:
        """Cache a finished request's sequence with a device state at its end and at
        `checkpoint_at`; evict to make room. Returns the device states it added (<= 2)."""
        seq = as_token_array(sequence)
        n = self.tree.page_aligned(len(seq))
        if n == 0:
            return 0
        seq = seq[:n]
        walk = self.tree.walk(seq)
        positions = self._admitted_positions(n, checkpoint_at)
        device_state_ends = {node.end for node in walk.path if node.st_dev}
        new_states = sum(1 for p in positions if p not in device_state_ends)
        # Lock what the request matched whole, not the edge it leaves mid-way (`HybridPrefixCache.admit`).
        deepest = walk.last
        if deepest is not None:
            self.lock(deepest)
        try:
            while True:
                need = n - walk.overlap + _unevicted(walk)
                if not self._make_room(need * self.kv_bytes_per_token, new_states):
                    self.counters.admissions_skipped += 1
                    return 0
                if walk.partial is None:
                    break  # the whole path is locked: nothing on it moved
                # the edge left mid-way may have been demoted, dropped or merged: room for what is left
                walk = self.tree.walk(seq)
                if n - walk.overlap + _unevicted(walk) <= need:
                    break
            unevicted = _unevicted(walk)
            if n > walk.overlap:
                attach = self._split(walk.partial, walk.partial_len) if walk.partial else (walk.last or self.tree.root)
                self._add_leaf(attach, seq[walk.overlap:])
            if unevicted:
                self._unevict(seq, walk.overlap)
            admitted = 0
            for pos in positions:
                node = self._node_at(seq, pos)
                if not node.st_dev:
                    if self.verify:
                        digest = _digest(seq[:pos])
                        assert node.digest in (None, digest), f"{node!r} holds another prefix's state"
                        node.digest = digest
                    self._set_state(node, dev=True)
                    admitted += 1
                self._touch(node)
                self._refresh(node)
            return admitted
        finally:
            if deepest is not None:
                self.unlock(deepest)
            self._settle()
            self._observe(seq, n)

    def _observe(self, seq: np.ndarray, n: int) -> None:
        """Feed the stream's learners once per admitted request (cached or skipped): the device
        eviction's (`observe_request`) and the host's record, unless it is the same record."""
        eviction = self.eviction
        eviction.observe_request(self, seq, n)
        record = self.continuation
        if record is not None and not (isinstance(eviction, DepthEviction) and eviction.feeds_record
                                       and eviction.record is record):
            record.finish(seq, n)

    def _unevict(self, seq: np.ndarray, upto: int) -> None:
        walk = self.tree.walk(seq[:upto])
        path = list(walk.path)
        if walk.partial is not None:
            path.append(self._split(walk.partial, walk.partial_len))
        for node in path:
            if not node.kv_dev:
                self._set_kv(node, dev=True)
                self._refresh(node)
                self._refresh(node.parent)

    def serve(self, input_tokens, output_tokens=()) -> tuple[TieredLookup, int]:
        inp = as_token_array(input_tokens)
        lookup = self.lookup(inp)
        seq = np.concatenate((inp, np.asarray(output_tokens, dtype=np.int64)))
        return lookup, self.admit(seq, lookup.checkpoint_at)

    # -- device eviction -------------------------------------------------------------------------
    def _is_device_leaf(self, node: TieredNode) -> bool:
        return node.kv_dev and not any(child.kv_dev for child in node.children.values())

    def evict(self, node: TieredNode) -> None:
        """Evict one device candidate: a device leaf leaves the device whole, another candidate
        only its state; the tier rules say what is demoted to the host and what is dropped."""
        assert node.slot >= 0, f"{node!r} is not an eviction candidate"
        leaf = self._is_device_leaf(node)
        plan = self.rules.demotion(EvictionFacts(
            frees_kv=leaf, kv_on_host=node.kv_host, state_on_device=node.st_dev, state_on_host=node.st_host,
            host_descendants=leaf and bool(node.children),
            kept_for_client=self.client_hints is not None and self.client_hints.kept_for_day(node)))
        copy_kv = plan.kv and not node.kv_host
        copy_state = plan.state and node.st_dev and not node.st_host
        copy = (self._kv_bytes(node) if copy_kv else 0) + (self.ssm_state_bytes if copy_state else 0)
        self._drop(node)
        if copy:
            # making room on the host must neither evict the node's own host state nor list it again
            self._protected = node
            self._drop_host(node)
            incoming = None
            if plan.ranked:
                footprint = (self._kv_bytes(node) if leaf else 0) + self.ssm_state_bytes
                incoming = (node.last_access, self._host_value(node, footprint))
            if not self._host_make_room(copy, incoming, node):
                plan = Demotion(kv=node.kv_host, state=node.st_host)  # nothing new gets a host copy
            self._protected = None
        if leaf:
            self.counters.evictions_leaf += 1
            self._evict_leaf(node, plan)
        else:
            self.counters.evictions_single_child += 1
            self._evict_state(node, plan)

    def _evict_leaf(self, node: TieredNode, plan: Demotion) -> None:
        c, kv_bytes = self.counters, self._kv_bytes(node)
        if node.st_dev:
            self._state_leaves_device(node, plan)
        if plan.kv and not node.kv_host:
            self._set_kv(node, host=True)
            c.bytes_demoted += kv_bytes
        elif not plan.kv:
            c.bytes_dropped += kv_bytes
        self._set_kv(node, dev=False)
        if not plan.kv:
            self._remove_subtree(node)
            return
        self._refresh(node)
        self._refresh(node.parent)

    def _evict_state(self, node: TieredNode, plan: Demotion) -> None:
        c = self.counters
        if plan.kv and not node.kv_host:  # upstream's internal backup copies the node's KV too
            self._set_kv(node, host=True)
            c.bytes_demoted += self._kv_bytes(node)
        self._state_leaves_device(node, plan)
        self._refresh(node)
        self._compress(node)  # without a state: `HybridPrefixCache.evict`, the edge is absorbed by the child

    def _state_leaves_device(self, node: TieredNode, plan: Demotion) -> None:
        """The device state of an evicted node goes to the host if the plan keeps it (unless a copy
        is there already), or is lost."""
        c = self.counters
        if plan.state and not node.st_host:
            self._set_state(node, host=True)
            c.states_demoted += 1
            c.bytes_demoted += self.ssm_state_bytes
        elif not plan.state:
            c.states_dropped += 1
            c.bytes_dropped += self.ssm_state_bytes
        self._set_state(node, dev=False)

    def _remove_subtree(self, node: TieredNode) -> None:
        """Remove `node`, whose KV is on neither tier, and the host-only nodes below it."""
        order, stack = [], [node]
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        for x in reversed(order):  # children before their parent
            if x is not node:
                self.counters.bytes_dropped += self._host_bytes(x)
                self.counters.states_dropped += x.st_host
            self._set_kv(x, dev=False, host=False)
            self._set_state(x, dev=False, host=False)
            self._drop(x)
            self._drop_host(x)
            parent = self.tree.remove_leaf(x)
        self._refresh(parent)
        self._compress(parent)

    def _host_bytes(self, node: TieredNode) -> int:
        return (self._kv_bytes(node) if node.kv_host else 0) + (self.ssm_state_bytes if node.st_host else 0)

    # -- host eviction ---------------------------------------------------------------------------
    def _host_make_room(self, needed: int, incoming, protect: TieredNode) -> bool:
        """Free `needed` host bytes: duplicates first, then the host's own candidates by rank.
        `incoming` (last access, value) makes it a ranked admission: nothing is evicted unless
        the candidates ranking below it (with free bytes and duplicates) cover `needed`."""
        if needed > self.host_capacity_bytes:
            return False
        if self.host_free_bytes >= needed:
            return True
        order = self.rules.host_order(self.eviction, self.continuation)
        if incoming is not None:
            room = (self.host_free_bytes + self._duplicate_bytes(protect)
                    + self.host_index.bytes_ranked_below(order, *incoming))
            if room < needed:
                return False
        self._reclaim_duplicates(needed, protect)
        while self.host_free_bytes < needed:
            if not len(self.host_index):
                return False
            self._evict_host(self.host_index.lowest(order))
        return True

    def _duplicate_bytes(self, protect: TieredNode) -> int:
        total = sum(self._kv_bytes(n) for n in self._kv_duplicates.values() if n is not protect and not n.lock_count)
        if self.rules.reclaims_state_duplicates:
            total += self.ssm_state_bytes * sum(1 for n in self._state_duplicates.values()
                                                if n is not protect and not n.lock_count)
        return total

    def _reclaim_duplicates(self, needed: int, protect: TieredNode) -> None:
        """Free host copies of what the device also holds: SGLang's `_reclaim_full_host_duplicates`
        (oldest duplicate first; the device's leaves, about to be demoted onto their copy, in a
        second pass), for states too under rules that say so."""
        kinds = [(self._kv_duplicates, True)]
        if self.rules.reclaims_state_duplicates:
            kinds.append((self._state_duplicates, False))
        for duplicates, is_kv in kinds:
            for spare_leaves in (True, False):
                for node in list(duplicates.values()):
                    if self.host_free_bytes >= needed:
                        return
                    if node is protect or node.lock_count or (spare_leaves and self._is_device_leaf(node)):
                        continue
                    if is_kv:
                        self.counters.bytes_reclaimed += self._kv_bytes(node)
                        self._set_kv(node, host=False)
                    else:
                        self.counters.bytes_reclaimed += self.ssm_state_bytes
                        self._set_state(node, host=False)

    def _evict_host(self, node: TieredNode) -> None:
        """Evict one host candidate: a host-only leaf goes whole, a host-only state alone."""
        c = self.counters
        c.states_evicted_host += node.st_host
        if node.kv_dev or node.children:
            c.bytes_evicted_host += self.ssm_state_bytes
            self._set_state(node, host=False)
            self._refresh(node)
            return
        self._remove_host_leaf(node)

    def _remove_host_leaf(self, node: TieredNode) -> None:
        """A host-only leaf leaves the cache with its host copies; its parent is settled later."""
        self.counters.bytes_evicted_host += self._host_bytes(node)
        self._set_kv(node, host=False)
        self._set_state(node, host=False)
        self._drop(node)
        self._drop_host(node)
        parent = self.tree.remove_leaf(node)
        self._refresh(parent)
        self._unsettled[parent.id] = parent

    def _host_candidate_bytes(self, node: TieredNode) -> int | None:
        """Host bytes evicting `node` from the host frees; None if it is not a host candidate."""
        return host_candidate_bytes(
            self.rules, locked=bool(node.lock_count) or node is self._protected, is_root=node.parent is None,
            kv_on_device=node.kv_dev, kv_on_host=node.kv_host, state_on_device=node.st_dev,
            state_on_host=node.st_host, n_children=len(node.children), kv_bytes=self._kv_bytes(node),
            state_bytes=self.ssm_state_bytes)

    # -- settling: tree tidying deferred out of eviction loops ------------------------------------
    def _settle(self) -> None:
        """Compress the nodes whose tiers changed (a stateless single-child node whose KV sits on
        the same tiers as its child's holds nothing of its own), and, under rules that say so,
        drop host-only leaves without a state. Deferred to here: mid-eviction a merge would grow
        the very node being demoted."""
        while self._unsettled:
            _, node = self._unsettled.popitem()
            if node.parent is None or node is self.tree.root:
                continue
            if (self.rules.drops_stateless_host_leaves and not node.kv_dev and not node.children
                    and not node.has_state and not node.lock_count):
                self._remove_host_leaf(node)
                continue
            parent = node.parent
            self._compress(node)
            self._compress(parent)

    # -- tier flags (accounting and duplicate tracking; callers refresh the indexes) --------------
    def _set_kv(self, node: TieredNode, *, dev: bool | None = None, host: bool | None = None) -> None:
        n = len(node.tokens)
        if dev is not None and dev != node.kv_dev:
            node.kv_dev = dev
            self.kv_tokens += n if dev else -n
        if host is not None and host != node.kv_host:
            node.kv_host = host
            self.host_kv_tokens += n if host else -n
        self._track(self._kv_duplicates, node, node.kv_dev and node.kv_host)
        self._unsettled[node.id] = node

    def _set_state(self, node: TieredNode, *, dev: bool | None = None, host: bool | None = None) -> None:
        if dev is not None and dev != node.st_dev:
            node.st_dev = dev
            self.ssm_states += 1 if dev else -1
        if host is not None and host != node.st_host:
            node.st_host = host
            self.host_states += 1 if host else -1
        node.has_state = node.st_dev or node.st_host
        if not node.has_state:
            node.digest = None
        self._track(self._state_duplicates, node, node.st_dev and node.st_host)
        self._unsettled[node.id] = node

    @staticmethod
    def _track(duplicates: dict, node: TieredNode, is_duplicate: bool) -> None:
        if is_duplicate:
            duplicates.setdefault(node.id, node)
        else:
            duplicates.pop(node.id, None)

    # -- tree edits that keep both candidate indexes current ---------------------------------------
    def _split(self, child: TieredNode, k: int) -> TieredNode:
        head = super()._split(child, k)
        self._track(self._kv_duplicates, head, head.kv_dev and head.kv_host)
        return head

    def _compress(self, node: TieredNode) -> None:
        if node is self.tree.root or node.parent is None or node.lock_count or node.has_state or len(node.children) != 1:
            return
        (child,) = node.children.values()
        if (child.kv_dev, child.kv_host) != (node.kv_dev, node.kv_host):
            return  # the merged edge would sit on two sets of tiers at once
        self._drop(node)
        self._drop_host(node)
        self._kv_duplicates.pop(node.id, None)
        self._refresh(self.tree.merge_into_child(node))

    def _touch(self, node: TieredNode) -> None:
        super()._touch(node)
        if node.hslot >= 0:
            self.host_index.last_access[node.hslot] = self.clock

    def _is_candidate(self, node: TieredNode) -> bool:
        if node.lock_count or node.parent is None or not node.kv_dev or node is self._protected:
            return False
        if self._is_device_leaf(node):
            return True
        return node.st_dev and len(node.children) == 1 and self.eviction.evicts_single_child_nodes

    def flop_efficiency(self, node: TieredNode) -> float:
        """Eq. 1 on the device: FLOPs a hit at `node` saves over its parent, per device byte its
        eviction frees (a device leaf its KV and device state, another candidate its state)."""
        return self._value(node, (self.ssm_state_bytes if node.st_dev else 0)
                           + (self._kv_bytes(node) if self._is_device_leaf(node) else 0))

    def _value(self, node: TieredNode, freed: int) -> float:
        """Eq. 1 (`rules/value.py`): FLOPs a hit at `node` saves over its parent per byte (`freed`),
        0 without a state."""
        if not node.has_state:
            return 0.0
        return value_rule.flops_saved_per_byte(self.flops(node.parent.end, node.end), freed)

    def _host_value(self, node: TieredNode, freed: int) -> float:
        """The host ranking's value column: the node's depth under a depth order, else Eq. 1."""
        if self.continuation is not None:
            return self.rules.depth_of(self.continuation, *core_node_end(node))
        return self._value(node, freed)

    def set_eviction(self, eviction: EvictionPolicy) -> None:
        """Switch the device's eviction policy (the tuner moves between choices)."""
        if eviction is self.eviction:
            return
        if getattr(eviction, "value_reaches_up", False):
            raise MarconiError(f"the host-tier model does not support {eviction.name} eviction")
        super().set_eviction(eviction)

    def _refresh(self, node: TieredNode) -> None:
        if node is self.tree.root:
            return
        super()._refresh(node)  # the device's candidates
        freed = self._host_candidate_bytes(node)
        if freed is not None:
            value = self._host_value(node, freed)
            if node.hslot < 0:
                node.hslot = self.host_index.add(node, node.last_access, value, freed)
            else:
                self.host_index.update(node.hslot, node.last_access, value, freed)
        elif node.hslot >= 0:
            self._drop_host(node)

    def _drop_host(self, node: TieredNode) -> None:
        if node.hslot < 0:
            return
        moved = self.host_index.remove(node.hslot)
        if moved is not None:
            moved.hslot = node.hslot
        node.hslot = -1

    def snapshot(self):
        raise MarconiError("the host-tier model keeps no snapshots (the tuner's shadows model the device alone)")

    # -- checking --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping disagrees with the tree."""
        kv = host_kv = states = host_states = 0
        candidates, host_candidates = set(), set()
        root = self.tree.root
        for node in self.tree.nodes():
            kv += len(node.tokens) * node.kv_dev
            host_kv += len(node.tokens) * node.kv_host
            states += node.st_dev
            host_states += node.st_host
            self.tree.check_node(node)
            assert node.kv_dev or node.kv_host, f"{node!r}: KV on neither tier"
            assert not node.kv_dev or node.parent is root or node.parent.kv_dev, f"{node!r}: device KV below host-only KV"
            assert not node.st_dev or node.kv_dev, f"{node!r}: device state over host-only KV"
            assert node.has_state == (node.st_dev or node.st_host), node
            if self._is_candidate(node):
                candidates.add(node.id)
                assert self.index.items[node.slot] is node, node
            else:
                assert node.slot < 0, node
            if self._host_candidate_bytes(node) is not None:
                host_candidates.add(node.id)
                assert self.host_index.items[node.hslot] is node, node
            else:
                assert node.hslot < 0, node
            if not node.has_state and len(node.children) == 1 and not node.lock_count:
                (child,) = node.children.values()
                assert (child.kv_dev, child.kv_host) != (node.kv_dev, node.kv_host), f"uncompressed {node!r}"
            if self.rules.drops_stateless_host_leaves and not node.lock_count:
                assert node.kv_dev or node.children or node.has_state, f"useless host leaf {node!r}"
            assert (node.id in self._kv_duplicates) == (node.kv_dev and node.kv_host), node
            assert (node.id in self._state_duplicates) == (node.st_dev and node.st_host), node
            if self.verify and node.has_state:
                assert node.digest == _digest(walk_tokens(node)), f"{node!r} holds another prefix's state"
        assert (kv, states, host_kv, host_states) == (self.kv_tokens, self.ssm_states, self.host_kv_tokens,
                                                      self.host_states)
        assert candidates == {n.id for n in self.index.items}
        assert host_candidates == {n.id for n in self.host_index.items}
        assert self.used_bytes <= self.capacity_bytes, (self.used_bytes, self.capacity_bytes)
        assert self.host_used_bytes <= self.host_capacity_bytes, (self.host_used_bytes, self.host_capacity_bytes)


def walk_tokens(node: Node) -> np.ndarray:
    """The tokens of the path from the root to the end of `node`."""
    parts = []
    while node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    return np.concatenate(parts[::-1]) if parts else np.empty(0, dtype=np.int64)


def _unevicted(walk) -> int:
    """Host-only KV on the walked path that the request computed (or loaded) again: it goes back
    on the device."""
    total = sum(len(node.tokens) for node in walk.path if not node.kv_dev)
    if walk.partial is not None and not walk.partial.kv_dev:
        total += walk.partial_len
    return total
