"""The served sliding-window cache, modeled: SGLang 0.5.23's `UnifiedRadixCache` with FULL + SWA
components and the `marconi` backend (`serving/swa_component.py`), driven one request at a time
through the scheduler's calls. Engine-free.

What it follows of SGLang, call for call (page size 1):

- Two pools of token slots: full KV (`kv_tokens`, every global layer) and SWA KV (`swa_tokens`).
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

`serve` returns the hit SGLang reports. `check_invariants` asserts the ledgers and the tree agree;
`check_plan` compares the incremental plan with `window_plan.reference_plan`. The calls modeled
are those of `tests/serving/sglang_swa_cpu.run_swa_request`; `scripts/check_sim_vs_served.py
--kind sliding-window` compares the two request by request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.window_plan import LEAF, STALE, WindowPlan
from sglang_marconi.policy.tree.radix_tree import as_token_array

SWA_EVICTION_INTERVAL = 128  # SGLANG_SWA_EVICTION_INTERVAL: decode tokens between two out-of-window frees
_STAMP_STEP = 0.00001  # a match stamps ancestors this much older, level by level (SGLang's)


class _Node:
    __slots__ = ("id", "parent", "children", "key", "end", "swa", "full_lock", "swa_lock", "uuid",
                 "last_access", "window_time", "alive")

    def __init__(self, node_id: int, parent, key: np.ndarray, end: int):
        self.id = node_id
        self.parent = parent
        self.children: dict = {}
        self.key = key  # the edge's tokens (`window_plan` reads len(key))
        self.end = end
        self.swa = False  # SWA KV present for the whole edge
        self.full_lock = 0
        self.swa_lock = 0
        self.uuid = None  # the SWA lock segment ends here (SGLang's metadata["uuid"])
        self.last_access = 0.0  # SGLang's last_access_time (the FULL LRU)
        self.window_time = 0.0  # Marconi's window time (the window rule's recency)
        self.alive = True

    @property
    def start(self) -> int:
        return self.end - len(self.key)

    def __repr__(self) -> str:
        return f"Node(id={self.id}, [{self.start},{self.end}), swa={self.swa}, children={len(self.children)})"


class _View:
    """What the window plan reads of this tree (`window_plan.WindowView`)."""

    __slots__ = ("leaves",)

    def __init__(self, leaves: set):
        self.leaves = leaves

    def live(self, node) -> bool:
        return node.swa and node.swa_lock == 0

    def evictable_leaf(self, node) -> bool:
        return node in self.leaves

    def recency(self, node) -> float:
        return node.window_time

    def alive(self, node) -> bool:
        return node.alive


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


class ServedWindowCache:
    """See the module docstring. `alpha`: the FLOP weight of Marconi's window rule."""

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
        self.profile = profile
        self.kv_tokens, self.swa_tokens = int(kv_tokens), int(swa_tokens)
        self.chunk_size = chunk_size
        self.window = int(window or profile.sliding_window)
        if self.window < 1:
            raise MarconiError(f"window must be positive, got {self.window}")
        self.alpha = float(alpha)
        self.counters = WindowCounters()
        self._clock = 0.0
        self._next_id = 0
        self._uuids = 0
        self._leaves: set = set()  # SGLang's evictable device leaves
        self.root = self._new_node(None, np.empty(0, dtype=np.int64), 0)
        self.tree_full = 0  # full-KV tokens the tree holds
        self.tree_swa = 0  # SWA-KV tokens the tree holds
        self._req: _Request | None = None
        self.plan = WindowPlan(self.window, _View(self._leaves), profile)
        self.plan.bind(self.root)
        self.served = 0

    # -- ledgers ---------------------------------------------------------------------------------
    @property
    def full_free(self) -> int:
        req = self._req
        held = 0 if req is None else req.kv_len - req.protected
        return self.kv_tokens - self.tree_full - held

    @property
    def swa_free(self) -> int:
        req = self._req
        held = 0 if req is None else max(0, req.kv_len - max(req.protected, req.evicted))
        return self.swa_tokens - self.tree_swa - held

    @property
    def clock(self) -> float:
        """SGLang's time counter as this model has advanced it (the next value it hands out)."""
        return self._clock

    def _tick(self) -> float:
        self._clock += 1.0
        return self._clock - 1.0

    def _new_node(self, parent, key, end) -> _Node:
        """UnifiedTreeNode(): the next id, and two ticks (last_access_time, then creation_time)."""
        node, self._next_id = _Node(self._next_id, parent, key, end), self._next_id + 1
        node.last_access, self._clock = self._clock, self._clock + 2.0
        return node

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
        if req.lock is not None:
            self._unlock(req.lock)
        req.lock = self._lock(target)
        req.protected = length
        if branch_insert is not None:
            req.branch = None
            if not finished:
                self._free_out_of_window(extend_end - 1)

    # -- the tree ----------------------------------------------------------------------------------
    @staticmethod
    def _common(edge: np.ndarray, seq: np.ndarray, pos: int, limit: int) -> int:
        lim = min(len(edge), limit - pos)
        eq = edge[:lim] == seq[pos: pos + lim]
        return lim if eq.all() else int(eq.argmin())

    def _match(self, key: np.ndarray) -> tuple[_Node, int]:
        """UnifiedTreeCore.match_prefix with the SWA validator and Marconi's window stamp:
        (node hit, full-KV match)."""
        if not len(key):
            return self.root, 0
        node, pos, best = self.root, 0, self.root
        run = float("inf")  # SWA run since the last tombstone on the path (the validator's state)
        n = len(key)
        while pos < n:
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            m = self._common(child.key, key, pos, n)
            pos += m
            partial = m < len(child.key)
            if partial:
                child = self._split(child, m)
            if child.swa:
                run += len(child.key)
                if run >= self.window:
                    best = child
            else:
                run = 0
            node = child
            if partial:
                break
        stamp = self._tick()  # MATCH_END: the node hit and its ancestors, SGLang's recency
        cur = best
        while cur is not None:
            cur.last_access = stamp
            stamp -= _STAMP_STEP
            cur = cur.parent
        self._stamp_window(best)  # the window this hit reads
        return best, pos

    def _split(self, child: _Node, k: int) -> _Node:
        """UnifiedTreeCore._split_node: a new node takes the first `k` tokens of `child`'s edge."""
        parent = child.parent
        head = self._new_node(parent, child.key[:k], child.start + k)
        head.full_lock, head.swa_lock = child.full_lock, child.swa_lock
        head.uuid, child.uuid = child.uuid, None  # the segment's boundary is the older edge
        head.swa = child.swa
        head.window_time = child.window_time
        child.key = child.key[k:]
        child.parent = head
        head.children[int(child.key[0])] = child
        parent.children[int(head.key[0])] = head
        child.last_access = self._tick()
        self.plan.split(head, child)
        self._update_leaf(head)
        return head

    def _insert(self, seq: np.ndarray, length: int) -> _Node:
        """UnifiedTreeCore insert of seq[:length] from the running request; returns the node it
        ended on."""
        req = self._req
        protected, evicted = req.protected, req.evicted
        self.root.last_access = self._tick()  # begin_insert touches the root
        node, pos = self.root, 0
        while pos < length:
            child = node.children.get(int(seq[pos]))
            if child is None:
                break
            child.last_access = self._tick()
            m = self._common(child.key, seq, pos, length)
            if m < len(child.key):
                child = self._split(child, m)
            if protected < pos + m and not child.swa:  # a tombstone the request still has SWA KV for
                live = max(pos, evicted)
                if live < pos + m:
                    if live > pos:
                        self._split(child, live - pos)
                    child.swa = True
                    self.tree_swa += len(child.key)
                    self.plan.touched(child)
            node, pos = child, pos + m
        if pos < length:  # a new leaf; its SWA KV from the request's freed point, cut to one window
            leaf = self._new_node(node, seq[pos:length].copy(), length)
            node.children[int(seq[pos])] = leaf
            self.tree_full += length - pos
            self.plan.added(leaf)
            self._update_leaf(leaf)
            self._update_leaf(node)
            live = max(pos, evicted)
            if live < length:
                if live > pos:
                    self._split(leaf, live - pos)
                if len(leaf.key) > self.window:
                    upper = self._split(leaf, len(leaf.key) - self.window)
                    upper.swa = True
                    self.plan.touched(upper)
                leaf.swa = True
                self.tree_swa += length - live
                self.plan.touched(leaf)
            node = leaf
        self._stamp_window(node)  # the window this insert keeps at its end
        return node

    def _stamp_window(self, node: _Node) -> None:
        now = self._tick()
        covered, cur, root = 0, node, self.root
        while cur is not root and covered < self.window:
            cur.window_time = now
            self.plan.stamped(cur)
            covered += len(cur.key)
            cur = cur.parent

    def _lock(self, node: _Node) -> tuple:
        """inc_lock_ref: full KV of the path, SWA KV of the segment covering the window."""
        uuid, covered, cur = None, 0, node
        while cur is not self.root and covered < self.window:
            cur.swa_lock += 1
            covered += len(cur.key)
            if covered >= self.window:
                if cur.uuid is None:
                    self._uuids += 1
                    cur.uuid = self._uuids
                uuid = cur.uuid
            if cur.swa_lock == 1:
                self.plan.touched(cur)
            cur = cur.parent
        cur = node
        while cur is not self.root:
            cur.full_lock += 1
            cur = cur.parent
        self._update_leaf(node)
        return node, uuid

    def _unlock(self, lock: tuple) -> None:
        node, uuid = lock
        if node is self.root:
            return
        cur = node
        while cur is not self.root:
            assert cur.full_lock > 0, cur
            cur.full_lock -= 1
            cur = cur.parent
        cur = node
        while cur is not self.root:
            assert cur.swa_lock > 0, cur
            cur.swa_lock -= 1
            if cur.swa_lock == 0:
                self.plan.touched(cur)
                self._update_leaf(cur)
            if uuid is not None and cur.uuid == uuid:
                break
            cur = cur.parent
        self._update_leaf(node)

    def _update_leaf(self, node: _Node) -> None:
        """SGLang's evictable device leaf: not the root, unlocked, no children."""
        leaf = (node is not self.root and node.alive and not node.children and not node.full_lock
                and not node.swa_lock)
        if leaf != (node in self._leaves):
            if leaf:
                self._leaves.add(node)
            else:
                self._leaves.discard(node)
            self.plan.touched(node)

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
        """SGLang's FULL LRU over evictable leaves; returns the SWA tokens freed with them."""
        import heapq

        heap = [(n.last_access, n.id, n) for n in self._leaves]
        heapq.heapify(heap)
        freed_swa, last = 0, None
        while self.full_free < target:
            if last is not None and last.parent in self._leaves:
                p = last.parent
                heapq.heappush(heap, (p.last_access, p.id, p))
            last = None
            while heap:
                _, _, x = heapq.heappop(heap)
                if x in self._leaves:
                    last = x
                    break
            if last is None:
                break
            self.counters.evictions_full_leaf += 1
            freed_swa += self._delete_leaf(last)
        return freed_swa

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
                freed += self._delete_leaf(node) if node in self._leaves else self._tombstone(node)
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

    def _fallback_victim(self) -> _Node | None:
        """SGLang's LRU step, approximated: the least recently accessed live unlocked SWA KV."""
        live = [node for node in self._nodes() if node.swa and not node.swa_lock]
        return min(live, key=lambda node: (node.last_access, node.id), default=None)

    def _tombstone(self, node: _Node) -> int:
        node.swa = False
        k = len(node.key)
        self.tree_swa -= k
        self.plan.touched(node)
        return k

    def _delete_leaf(self, node: _Node) -> int:
        """Delete an evictable leaf whole (full and SWA KV); returns the SWA tokens freed."""
        k = len(node.key)
        freed_swa = k if node.swa else 0
        self.tree_full -= k
        self.tree_swa -= freed_swa
        parent = node.parent
        del parent.children[int(node.key[0])]
        node.alive = False
        self._leaves.discard(node)
        self.plan.removed(node)
        self._update_leaf(parent)
        return freed_swa

    # -- reading ---------------------------------------------------------------------------------
    def _nodes(self):
        """Every node below the root, level by level."""
        level = list(self.root.children.values())
        while level:
            yield from level
            level = [child for node in level for child in node.children.values()]

    def peek_hit(self, input_tokens) -> int:
        """The hit `serve` would report for this input, changing nothing."""
        key = as_token_array(input_tokens)[: max(0, len(input_tokens) - 1)]
        node, pos, hit, run = self.root, 0, 0, float("inf")
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            m = self._common(child.key, key, pos, len(key))
            run = run + m if child.swa else 0
            if child.swa and run >= self.window:
                hit = pos + m
            if m < len(child.key):
                break
            node, pos = child, pos + m
        return hit

    def check_plan(self) -> None:
        """Assert the incremental plan equals `window_plan.reference_plan` on this tree."""
        self.plan.check(self.alpha)

    def check_invariants(self) -> None:
        full = swa = 0
        for node in self._nodes():
            full += len(node.key)
            swa += len(node.key) if node.swa else 0
            assert len(node.key) > 0 and node.end == node.parent.end + len(node.key), node
            for key, child in node.children.items():
                assert child.parent is node and int(child.key[0]) == key, (node, child)
            assert node.full_lock == 0 and node.swa_lock == 0 or self._req is not None, f"locked while idle: {node!r}"
            assert (node in self._leaves) == (not node.children and not node.full_lock and not node.swa_lock), node
        assert (full, swa) == (self.tree_full, self.tree_swa), ((full, swa), (self.tree_full, self.tree_swa))
        assert 0 <= self.full_free and 0 <= self.swa_free, (self.full_free, self.swa_free)
