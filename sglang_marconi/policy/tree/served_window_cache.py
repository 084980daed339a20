"""The served sliding-window cache, modeled: SGLang 0.5.23's `UnifiedRadixCache` with FULL + SWA
components and the `marconi` backend (`serving/swa_component.py`), driven one request at a time
through the scheduler's calls. Engine-free.

What it follows of SGLang, call for call (page size 1):

- Two pools of token slots: full KV (`kv_pool`, every global layer) and SWA KV (`swa_pool`).
  A tree node always holds its full KV; its SWA KV is present or not (a tombstone). The request in
  flight holds what it allocated: its full KV beyond the tree-owned prefix, and its SWA KV beyond
  both that prefix and the point up to which it freed its own out-of-window SWA KV.
- Match (`UnifiedTreeCore.match_prefix` + the SWA validator): the deepest node whose SWA KV is
  present and, if a tombstone lies above it, whose SWA run since the last tombstone covers the
  window; the edge where the input leaves the tree is split. Where the full-KV match runs past
  the hit, its end is the request's branch point (`swa_branching_seqlen`).
- Locks: a running request locks the full KV of its path and the SWA KV of the nodes covering the
  window before its end (a boundary uuid marks where the segment stops, carried up by splits);
  the lock moves to the node each insert ends on.
- Inserts (`checkpoint_into_tree`): a checkpoint before the request finishes, with a pending
  branch point, inserts only up to it; SWA KV is live from the request's freed point on (a
  tombstone below), tombstones on the walked path get it back where the request still has it,
  and a new leaf is cut to one window, the rest split off above it. The request frees its own SWA
  KV out of the window at each checkpoint and every `SGLANG_SWA_EVICTION_INTERVAL` decode tokens,
  never below the window before its pending branch point (Marconi's retain floor).
- Eviction at allocation, when either pool is short: first the FULL walk (SGLang's leaf LRU by
  `last_access_time`), then the SWA walk by Marconi's rule, `policy/rules/window_plan.py`, kept
  incrementally by a `WindowPlan` over this tree exactly as the served component keeps it:
  stale SWA KV, then branch windows and leaves, one tombstone or leaf per step, stopping when the
  pool's target is reached or the step quota is met. With nothing of the rule's left, SGLang's
  LRU walk (modeled as the oldest live unlocked SWA KV: it has never been reached in the checks).
- Recency: SGLang's time counter, advanced where SGLang advances it (two ticks per new node, one
  per split, per node an insert walks, per match, per window stamp); the FULL LRU reads
  `last_access_time`, Marconi's rule reads window times (a hit stamps the nodes of the window it
  reads, an insert those of the window it keeps at its end).

A configuration of `core.TreeCore` (copied edges, nodes with SWA KV and two locks): the core's
splits, leaf insertion, full-KV locks, candidate upkeep (its candidates: SGLang's evictable
leaves), leaf deletion and eviction walk (the FULL walk: `LruLeafEviction`, fixed) run as they
are, with SGLang's clock on new nodes and splits; the tree is never compressed. The match with
the SWA validator, the insert with its tombstone revival, the SWA locks, the pools, the request's
own ledger and the SWA walk (the rule's calls into `window_plan`) are this module's.

`serve` returns the hit SGLang reports. `check_invariants` asserts the ledgers and the tree agree;
`check_plan` compares the incremental plan with `window_plan.reference_plan`. The calls modeled
are those of `tests/serving/sglang_swa_cpu.run_swa_request`; `scripts/check_sim_vs_served.py
--kind sliding-window` compares the two request by request.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.eviction import LruLeafEviction
from sglang_marconi.policy.rules.window_plan import LEAF, STALE, WindowPlan
from sglang_marconi.policy.tree.core import TokenArrayRequests, TreeCore
from sglang_marconi.policy.tree.radix_tree import Node, RadixTree, as_token_array

SWA_EVICTION_INTERVAL = 128  # SGLANG_SWA_EVICTION_INTERVAL: decode tokens between two out-of-window frees
_STAMP_STEP = 0.00001  # a match stamps ancestors this much older, level by level (SGLang's)


class ServedNode(Node):
    """A node of SGLang's SWA tree: full KV always, SWA KV present or not (`swa`), two lock counts
    (`lock_count` the full KV's, `swa_lock` the SWA KV's). No SSM state (`has_state` stays False)."""

    __slots__ = ("key", "swa", "swa_lock", "uuid", "window_time", "alive")

    def __init__(self, parent, tokens: np.ndarray, end: int, node_id: int):
        super().__init__(parent, tokens, end, node_id)
        self.key = tokens  # the edge again, under the name `window_plan` reads (kept in step by splits)
        self.swa = False  # SWA KV present for the whole edge
        self.swa_lock = 0
        self.uuid = None  # the SWA lock segment ends here (SGLang's metadata["uuid"])
        self.window_time = 0.0  # Marconi's window time (the window rule's recency); last_access is SGLang's
        self.alive = True

    def __repr__(self) -> str:
        return f"ServedNode(id={self.id}, [{self.start},{self.end}), swa={self.swa}, children={len(self.children)})"


class ServedTree(RadixTree):
    """`RadixTree` of `ServedNode`s; a split is `UnifiedTreeCore._split_node`'s: the new upper node
    takes the edge's locks, SWA KV and window time, and the lock segment's boundary (it is the
    older edge)."""

    def __init__(self):
        super().__init__(1, ServedNode)

    def split(self, child: ServedNode, k: int) -> ServedNode:
        head = super().split(child, k)
        child.key = child.tokens
        head.swa_lock, head.swa, head.window_time = child.swa_lock, child.swa, child.window_time
        head.uuid, child.uuid = child.uuid, None
        return head


class _View:
    """What the window plan reads of this tree (`window_plan.WindowView`)."""

    __slots__ = ()

    def live(self, node) -> bool:
        return node.swa and node.swa_lock == 0

    def evictable_leaf(self, node) -> bool:
        return node.slot >= 0

    def recency(self, node) -> float:
        return node.window_time

    def alive(self, node) -> bool:
        return node.alive


class _EvictableLeaves:
    """SGLang's evictable device leaves as the core's candidate index (`add`, `update`, `remove`,
    `items`, `lowest`). A leaf entering or leaving is a change the window plan hears of
    (`WindowView.evictable_leaf`). `lowest` is the FULL walk's order: least recently accessed,
    ties to the older node, recency read as SGLang's walk reads it, from a heap built at the
    walk's first step (leaves listed during the walk join it; `end_walk` drops it)."""

    def __init__(self, plan: WindowPlan):
        self.items: list[ServedNode] = []
        self.plan = plan
        self._heap = None

    def add(self, node: ServedNode, last_access: float, value: float) -> int:
        self.items.append(node)
        self.plan.touched(node)
        if self._heap is not None:
            heapq.heappush(self._heap, (last_access, node.id, node))
        return len(self.items) - 1

    def update(self, slot: int, last_access: float, value: float) -> None:
        pass  # the walk reads recency when it starts

    def remove(self, slot: int):
        node, last = self.items[slot], self.items.pop()
        if node.alive:
            self.plan.touched(node)
        if slot == len(self.items):
            return None
        self.items[slot] = last
        return last

    def lowest(self, alpha: float = 0.0):
        """The least recently accessed leaf (`alpha` 0: recency alone is SGLang's FULL order)."""
        heap = self._heap
        if heap is None:
            heap = self._heap = [(node.last_access, node.id, node) for node in self.items]
            heapq.heapify(heap)
        while heap:
            node = heap[0][2]
            if node.slot >= 0:
                return node
            heapq.heappop(heap)
        return None

    def end_walk(self) -> None:
        self._heap = None


@dataclass
class WindowCounters:
    """Evictions as the served component counts them (`SWAFigures`), plus the FULL walk's."""
    evictions_stale: int = 0  # SWA KV in no reuse point's window, tombstoned
    evictions_window: int = 0  # a branch point's window tombstoned
    evictions_leaf: int = 0  # a leaf deleted whole by the SWA walk
    evictions_fallback: int = 0  # SGLang's LRU step (nothing of the rule's left)
    evictions_full_leaf: int = 0  # a leaf deleted by the FULL walk (SGLang's LRU)


@dataclass(frozen=True)
class WindowOutcome:
    hit_tokens: int  # the prefix reused (SGLang's req.prefix_len after the match)
    overlap_tokens: int  # the full-KV match
    tokens_kept: int  # what the tree holds of the request after its release


@dataclass
class _Request:
    kv_len: int  # KV allocated (= committed)
    protected: int  # req.kv.cache_protected_len: the prefix the tree owns
    branch: int | None  # req.swa_branching_seqlen, until inserted
    evicted: int = 0  # req.kv.get_evicted_seqlen(SWA): own SWA KV freed below it
    lock: tuple | None = None  # (node, uuid) of the tree lock


class ServedWindowCache(TokenArrayRequests, TreeCore):
    """See the module docstring. `alpha`: the FLOP weight of Marconi's window rule."""

    _compressed = False  # SGLang's tree keeps stateless single-child nodes

    def __init__(self, profile, kv_tokens: int, swa_tokens: int, alpha: float = 0.0, *,
                 chunk_size: int | None = None, window: int | None = None):
        if not getattr(profile, "has_sliding_window", False):
            raise MarconiError(f"model {profile.name} has no sliding-window layers: the served SWA cache does not "
                               f"apply")
        for name, value in (("kv_tokens", kv_tokens), ("swa_tokens", swa_tokens)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise MarconiError(f"{name} must be a positive integer, got {value!r}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer))
                                       or chunk_size < 1):
            raise MarconiError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
        self.kv_pool, self.swa_pool = int(kv_tokens), int(swa_tokens)
        self.chunk_size = chunk_size
        self.window = int(window or profile.sliding_window)
        if self.window < 1:
            raise MarconiError(f"window must be positive, got {self.window}")
        self.alpha = float(alpha)
        tree = ServedTree()
        self.plan = WindowPlan(self.window, _View(), profile)
        self.plan.bind(tree.root)
        # The FULL walk is SGLang's LRU over evictable leaves: the core's eviction walk, fixed. Its
        # candidates (the core's predicate: unlocked leaves) are SGLang's evictable leaves: a node's
        # SWA lock is taken and released with a full lock on it, so `swa_lock <= lock_count`.
        self._configure(profile, self.kv_pool * int(profile.kv_bytes_per_token), LruLeafEviction(), tree,
                        _EvictableLeaves(self.plan), fixed_choice=True, counters=WindowCounters())
        self.clock = 2.0  # SGLang's time counter (the next value it hands out): the root took two ticks
        self.tree_swa = 0  # SWA-KV tokens the tree holds
        self._uuids = 0
        self._req: _Request | None = None
        self.served = 0

    # -- ledgers ---------------------------------------------------------------------------------
    @property
    def root(self) -> ServedNode:
        return self.tree.root

    @property
    def tree_full(self) -> int:
        """Full-KV tokens the tree holds."""
        return self.kv_tokens

    @property
    def full_free(self) -> int:
        req = self._req
        held = 0 if req is None else req.kv_len - req.protected
        return self.kv_pool - self.kv_tokens - held

    @property
    def swa_free(self) -> int:
        req = self._req
        held = 0 if req is None else max(0, req.kv_len - max(req.protected, req.evicted))
        return self.swa_pool - self.tree_swa - held

    def _tick(self) -> float:
        self.clock += 1.0
        return self.clock - 1.0

    # -- one request -----------------------------------------------------------------------------
    def serve(self, input_tokens, output_tokens) -> WindowOutcome:
        """One request: match, prefill (chunked), first token, decode, release. `output_tokens`
        are every decoded token; the cache keeps input + output[:-1] (the last one was never fed
        back)."""
        inp = as_token_array(input_tokens)
        out = np.asarray(output_tokens, dtype=np.int64)
        seq = np.concatenate((inp, out[:-1])) if len(out) > 1 else inp
        return self.serve_kept(seq, len(inp))

    def serve_kept(self, seq: np.ndarray, n_in: int) -> WindowOutcome:
        """`serve` of a request given as what the cache keeps of it: input + output[:-1] (`seq`)
        and the input's length."""
        seq = as_token_array(seq)
        if n_in < 1 or n_in > len(seq):
            raise MarconiError(f"input of {n_in} tokens in a request of {len(seq)}")
        try:
            return self._serve(seq, n_in)
        except MarconiError:  # out of memory: the request lets go of what it held, the tree stays consistent
            req, self._req = self._req, None
            if req is not None and req.lock is not None:
                self._unlock(req.lock)
            raise

    def _serve(self, seq: np.ndarray, n_in: int) -> WindowOutcome:
        n_out = len(seq) - n_in + 1
        hit_node, full_hit = self._match(seq[: n_in - 1])
        hit = hit_node.end
        req = self._req = _Request(hit, hit, full_hit if full_hit > hit else None)
        prefix, first = hit, True
        while True:  # prefill chunks
            end = n_in if self.chunk_size is None else min(prefix + self.chunk_size, n_in)
            if first:
                req.lock = self._lock(hit_node)
                first = False
            self._alloc(end - prefix)
            if end == n_in:
                break
            self._checkpoint(seq, end, end, finished=False)
            prefix = end
        window, interval = self.window, SWA_EVICTION_INTERVAL
        done, step = 1, 0  # output tokens so far; decode steps so far
        if done < n_out:
            self._checkpoint(seq, n_in, n_in, finished=False)  # after prefill, before the first decode step
        while done < n_out:
            seqlen = n_in + done
            if step >= 1 and seqlen - 1 - window >= req.evicted + interval:
                self._free_out_of_window(seqlen - 1)
            fires_at = req.evicted + interval + window + 1
            k = 1 if step == 0 else max(1, min(n_out - done, fires_at - seqlen))
            self._alloc(k)
            step += k
            done += k
        # release_kv_cache(checkpoint=True): insert what the request owns, free the rest, unlock
        self._checkpoint(seq, req.kv_len, req.kv_len, finished=True)
        if req.lock is not None:
            self._unlock(req.lock)
        kept = req.protected
        self._req = None
        self.served += 1
        return WindowOutcome(hit, full_hit, kept)

    def _alloc(self, n: int) -> None:
        """alloc_token_slots: evict for either pool's shortfall, then take `n` slots of each."""
        if n <= 0:
            return
        full_short, swa_short = max(0, n - self.full_free), max(0, n - self.swa_free)
        if full_short or swa_short:
            self._evict(full_short, swa_short, n)
        if self.full_free < n or self.swa_free < n:
            raise MarconiError(f"out of memory: {n} tokens needed, {self.full_free} full and {self.swa_free} SWA "
                               f"slots free after eviction (SGLang: alloc_token_slots fails)")
        self._req.kv_len += n

    def _free_out_of_window(self, pre_len: int) -> None:
        """free_swa_out_of_window_slots: the request frees its SWA KV before the window ending at
        `pre_len`, above the prefix the tree owns, never below Marconi's retain floor."""
        req, window = self._req, self.window
        if pre_len - window < req.evicted + 1:
            return
        req.evicted = max(req.evicted, req.protected)
        threshold = pre_len - window
        if req.branch is not None:  # swa_retain_floor: the window before the branch point stays
            threshold = min(threshold, max(0, req.branch - window))
        req.evicted = max(req.evicted, threshold)

    def _checkpoint(self, seq: np.ndarray, up_to: int, extend_end: int, finished: bool) -> None:
        """checkpoint_into_tree: insert [protected, up_to) (up to a pending branch point), move
        the lock onto the node the insert ended on."""
        req = self._req
        length, branch_insert = up_to, None
        if req.branch is not None and req.protected < req.branch <= up_to:
            length = branch_insert = req.branch
        if not finished:
            self._free_out_of_window(length - 1)
        if length <= 0:
            return
        target = self._insert(seq, length)
        # The lock moves to `target` (SGLang: dec_lock_ref, then inc_lock_ref): taken first, the
        # path both hold is never unlocked in between, the same locks in the end.
        held, req.lock = req.lock, self._lock(target)
        if held is not None:
            self._unlock(held)
        req.protected = length
        if branch_insert is not None:
            req.branch = None
            if not finished:
                self._free_out_of_window(extend_end - 1)

    # -- the tree (the core's edits, with SGLang's clock and the plan's hooks) --------------------
    def _match(self, key: np.ndarray) -> tuple[ServedNode, int]:
        """UnifiedTreeCore.match_prefix with the SWA validator and Marconi's window stamp:
        (node hit, full-KV match). The edge where the key leaves the tree is split."""
        root = self.tree.root
        if not len(key):
            return root, 0
        path, partial, partial_len, overlap = self._walk(key, len(key))
        if partial is not None:
            path.append(self._split(partial, partial_len))
        best, window = root, self.window
        run = float("inf")  # SWA run since the last tombstone on the path (the validator's state)
        for node in path:
            if node.swa:
                run += len(node.tokens)
                if run >= window:
                    best = node
            else:
                run = 0
        stamp = self._tick()  # MATCH_END: the node hit and its ancestors, SGLang's recency
        cur = best
        while cur is not None:
            cur.last_access = stamp
            stamp -= _STAMP_STEP
            cur = cur.parent
        self._stamp_window(best)  # the window this hit reads
        return best, overlap

    def _split(self, child: ServedNode, k: int) -> ServedNode:
        """UnifiedTreeCore._split_node: a new node takes the first `k` tokens of `child`'s edge."""
        head = super()._split(child, k)
        head.last_access = self.clock  # a new node: two ticks (last_access_time, then creation_time)
        self.clock += 2.0
        child.last_access = self._tick()
        self.plan.split(head, child)
        return head

    def _add_leaf(self, parent: ServedNode, tokens: np.ndarray) -> ServedNode:
        leaf = super()._add_leaf(parent, tokens)  # stamped with the clock: a new node's two ticks
        self.clock += 2.0
        self.plan.added(leaf)
        return leaf

    def _compress(self, node: ServedNode) -> None:
        """SGLang's tree never merges a node into its child."""

    def _insert(self, seq: np.ndarray, length: int) -> ServedNode:
        """UnifiedTreeCore insert of seq[:length] from the running request; returns the node it
        ended on."""
        req = self._req
        protected, evicted = req.protected, req.evicted
        root = self.tree.root
        root.last_access = self._tick()  # begin_insert touches the root
        # The path to the node the request holds is seq[:protected] (locked, so whole): stamped
        # like the rest, compared no more.
        held = req.lock[0]
        assert held.end == protected <= length, (held, protected, length)
        walk = self.tree.walk(seq[:length], held)
        path = []
        while held is not root:
            path.append(held)
            held = held.parent
        path.reverse()
        path += walk.path
        partial, partial_len, overlap = walk.partial, walk.partial_len, walk.overlap
        if partial is not None:
            path.append(partial)
        node, end = root, 0
        for child in path:
            start = end
            child.last_access = self._tick()
            if child is partial:
                child = self._split(child, partial_len)
            end = child.end
            if protected < end and not child.swa:  # a tombstone the request still has SWA KV for
                live = max(start, evicted)
                if live < end:
                    if live > start:
                        self._split(child, live - start)
                    child.swa = True
                    self.tree_swa += len(child.tokens)
                    self.plan.touched(child)
            node = child
        pos = overlap
        if pos < length:  # a new leaf; its SWA KV from the request's freed point, cut to one window
            leaf = self._add_leaf(node, seq[pos:length].copy())
            live = max(pos, evicted)
            if live < length:
                if live > pos:
                    self._split(leaf, live - pos)
                if len(leaf.tokens) > self.window:
                    upper = self._split(leaf, len(leaf.tokens) - self.window)
                    upper.swa = True
                    self.plan.touched(upper)
                leaf.swa = True
                self.tree_swa += length - live
                self.plan.touched(leaf)
            node = leaf
        self._stamp_window(node)  # the window this insert keeps at its end
        return node

    def _stamp_window(self, node: ServedNode) -> None:
        now = self._tick()
        covered, cur, root = 0, node, self.tree.root
        while cur is not root and covered < self.window:
            cur.window_time = now
            self.plan.stamped(cur)
            covered += len(cur.tokens)
            cur = cur.parent

    def _lock(self, node: ServedNode) -> tuple:
        """inc_lock_ref: SWA KV of the segment covering the window, full KV of the path (the
        core's lock)."""
        uuid, covered, cur, root = None, 0, node, self.tree.root
        while cur is not root and covered < self.window:
            cur.swa_lock += 1
            covered += len(cur.tokens)
            if covered >= self.window:
                if cur.uuid is None:
                    self._uuids += 1
                    cur.uuid = self._uuids
                uuid = cur.uuid
            if cur.swa_lock == 1:
                self.plan.touched(cur)
            cur = cur.parent
        self.lock(node)  # drops `node` from the evictable leaves if it was one
        return node, uuid

    def _unlock(self, lock: tuple) -> None:
        node, uuid = lock
        root = self.tree.root
        if node is root:
            return
        self.unlock(node)
        cur = node
        while cur is not root:
            assert cur.swa_lock > 0, cur
            cur.swa_lock -= 1
            if cur.swa_lock == 0:
                self.plan.touched(cur)
            if uuid is not None and cur.uuid == uuid:
                break
            cur = cur.parent

    # -- eviction --------------------------------------------------------------------------------
    def _evict(self, full_short: int, swa_short: int, n: int) -> None:
        """UnifiedRadixCache.evict_for_alloc: the FULL walk to its target, then the SWA walk."""
        full_target, swa_target = self.full_free + full_short, self.swa_free + swa_short
        freed_swa = 0
        if full_short > 0:
            freed_swa += self._full_walk(full_target)
        if swa_short > 0 and self.swa_free < swa_target and freed_swa < swa_short:
            self._swa_walk(swa_target, swa_short, freed_swa)

    def _full_walk(self, target: int) -> int:
        """SGLang's FULL LRU over evictable leaves (the core's eviction walk); returns the SWA
        tokens freed with them."""
        swa_before = self.tree_swa
        while self.full_free < target and self._evict_one():
            self.counters.evictions_full_leaf += 1
        self.index.end_walk()
        return swa_before - self.tree_swa

    def _swa_walk(self, target: int, quota: int, freed: int) -> None:
        """Marconi's SWA walk (`MarconiSWAComponent._evict_device_next_node`): one tombstone or
        one leaf per step until the pool reaches `target` or `quota` SWA tokens were freed."""
        c, pending, unusable = self.counters, [], None
        while self.swa_free < target and freed < quota:
            node = None
            while pending:
                cand = pending.pop(0)
                if cand.swa and not cand.swa_lock and cand.alive:
                    node = cand
                    break
            if node is not None:
                freed += self._tombstone(node)
                continue
            victim = self.plan.next_victim(self.alpha)
            if victim is None:
                node = self._fallback_victim()
                if node is None:
                    return
                c.evictions_fallback += 1
                freed += self._delete_leaf(node) if node.slot >= 0 else self._tombstone(node)
                continue
            kind, nodes = victim
            if kind == LEAF:
                c.evictions_leaf += 1
                freed += self._delete_leaf(nodes[0])
                continue
            if kind == STALE:
                c.evictions_stale += 1
            else:
                c.evictions_window += 1
            if unusable is not None and nodes == unusable:
                raise AssertionError(f"the window plan repeats a victim it cannot evict: {victim}")
            pending, unusable = list(nodes), nodes

    def _fallback_victim(self) -> ServedNode | None:
        """SGLang's LRU step, approximated: the least recently accessed live unlocked SWA KV."""
        live = [node for node in self.tree.nodes() if node.swa and not node.swa_lock]
        return min(live, key=lambda node: (node.last_access, node.id), default=None)

    def _tombstone(self, node: ServedNode) -> int:
        node.swa = False
        k = len(node.tokens)
        self.tree_swa -= k
        self.plan.touched(node)
        return k

    def _delete_leaf(self, node: ServedNode) -> int:
        """Delete an evictable leaf whole (`evict`); returns the SWA tokens freed."""
        before = self.tree_swa
        self.evict(node)
        return before - self.tree_swa

    def evict(self, node: ServedNode) -> None:
        """Delete an evictable leaf whole, its full KV (the core's `_remove_leaf`) and its SWA KV;
        each walk counts its own deletions. Never a merge: SGLang's tree keeps its nodes."""
        if node.swa:
            node.swa = False
            self.tree_swa -= len(node.tokens)
        node.alive = False
        self.plan.removed(node)  # while it still names its parent
        self._drop(node)
        self._refresh(self._remove_leaf(node))

    # -- reading ---------------------------------------------------------------------------------
    def peek_hit(self, input_tokens) -> int:
        """The hit `serve` would report for this input, changing nothing."""
        key = as_token_array(input_tokens)[: max(0, len(input_tokens) - 1)]
        path, partial, partial_len, _ = self._walk(key, len(key))
        hit, run, window = 0, float("inf"), self.window
        for node in path + ([partial] if partial is not None else []):
            m = partial_len if node is partial else len(node.tokens)
            run = run + m if node.swa else 0
            if node.swa and run >= window:
                hit = node.start + m
        return hit

    def check_plan(self) -> None:
        """Assert the incremental plan equals `window_plan.reference_plan` on this tree."""
        self.plan.check(self.alpha)

    def check_invariants(self) -> None:
        """The core's checks (ledger, candidates), and the SWA ledger, the locks and the pools."""
        super().check_invariants()
        swa = 0
        for node in self.tree.nodes():
            swa += len(node.tokens) if node.swa else 0
            assert node.lock_count == 0 and node.swa_lock == 0 or self._req is not None, f"locked while idle: {node!r}"
            assert node.swa_lock <= node.lock_count, node
        assert swa == self.tree_swa, (swa, self.tree_swa)
        assert 0 <= self.full_free and 0 <= self.swa_free, (self.full_free, self.swa_free)
