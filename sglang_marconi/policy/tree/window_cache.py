"""Prefix cache for sliding-window (SWA) hybrids: a node's reusable state is made of components.

Components, as in SGLang's unified cache: full KV (every global attention layer, per token: the
tree's tokens themselves, so a node without it leaves the tree) and SWA KV (every SWA layer, per
token, read again only for the `window` tokens before a reuse point). A node keeps its SWA KV as a
suffix of its edge (`WindowNode.swa`): what any reuse point can need is a run of SWA KV ending there.

A prefix of length p is reusable iff its tokens match, full KV holds all p of them, and SWA KV
covers [max(0, p - window), p) contiguously. `verify_hit` checks exactly that, independently of
how `lookup` found the hit, so a simulator can check every reported hit.

What differs between policies is in `WindowRules`: which SWA KV a finished request keeps
(admission), which candidates eviction may pick and how it ranks them, whether a hit refreshes
the whole matched path, and one byte budget or a static split between global and SWA bytes
(`swa_share`). `FURIOSA`, `SGLANG` and `MARCONI` are the three rule sets the simulator runs.

A configuration of `core.TreeCore` (copied edges whose nodes carry their SWA run): the core's
splits, leaf insertion, compression, locks, leaf eviction and candidate upkeep run as they are,
with a node's SWA KV in the role of an SSM state (what eviction can free while the node keeps its
edge); the candidate predicate and value, the SWA ledger, admission (insert, then evict to the
budget), the pools and the SWA-only evictions (tombstones, trims) are this module's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.rules import score
from sglang_marconi.policy.rules import value as value_rule
from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.tree.core import TokenArrayRequests, TreeCore
from sglang_marconi.policy.tree.radix_tree import Node, RadixTree, as_token_array

# Why a hit ended where it did. A tree node without full KV leaves the tree, so a token match is
# always backed by full KV here: "missing global KV" shows up as a token mismatch.
HIT_END_REASONS = ("input_end", "token_mismatch", "broken_window")
LEAF, WINDOW, TRIM = "leaf", "window", "trim"  # evict a whole leaf / only a node's SWA KV / SWA beyond one window


@dataclass(frozen=True, slots=True)
class WindowRules:
    name: str
    keep_all: bool  # keep the SWA KV of every computed token (Furiosa) or only the windows that can be reused
    branch: str  # where a request keeps a window besides its end: "speculative" (Marconi) or "full_kv" (SGLang)
    ranking: str  # "lru", or "flops": recency + alpha x FLOPs saved per byte freed (Marconi)
    window_victims: str  # SWA-only evictions: "inner" (SGLang tombstones), "safe" (no branch's last window), "any"
    refresh_path: bool  # a hit refreshes every matched node (LRU engines) or only the nodes it reads
    stale_first: bool = False  # SWA KV beyond a node's last window is reclaimed before anything else (Furiosa)

    # What the tree core reads of its eviction policy: the rules rank their own candidates
    # (`WindowPrefixCache._choose`), with the value `WindowPrefixCache.flop_efficiency`.
    evicts_single_child_nodes = True  # an inner node can lose its SWA KV and keep its edge


FURIOSA = WindowRules("furiosa", keep_all=True, branch="full_kv", ranking="lru", window_victims="any",
                      refresh_path=True, stale_first=True)
SGLANG = WindowRules("sglang+", keep_all=False, branch="full_kv", ranking="lru", window_victims="inner",
                     refresh_path=True)
MARCONI = WindowRules("marconi", keep_all=False, branch="speculative", ranking="flops", window_victims="safe",
                      refresh_path=False)


@dataclass(frozen=True, slots=True)
class WindowLookup:
    hit_tokens: int  # reusable prefix: full KV for all of it, an intact window at its end
    overlap_tokens: int  # tokens of the input present in the tree (full KV), reusable or not
    branch_at: int | None  # where this request keeps an extra window (a branch point), if anywhere
    end_reason: str  # one of HIT_END_REASONS


@dataclass(slots=True)
class WindowCounters:
    evictions_leaf: int = 0
    evictions_window: int = 0  # SWA KV dropped from a node that stays (a tombstone)
    window_trims: int = 0  # SWA KV beyond a node's last window dropped
    windows_admitted: int = 0


class WindowNode(Node):
    """A tree node whose SWA KV is `swa` tokens at the end of its edge; its `has_state` (the core's
    state: what eviction can free while the node keeps its edge) is whether it holds any."""

    __slots__ = ("swa", "needed")

    def __init__(self, parent, tokens: np.ndarray, end: int, node_id: int):
        super().__init__(parent, tokens, end, node_id)
        self.swa = 0
        # Whether a child's window reaches into this node (Marconi's rule), None until asked again
        # after one of its children changed (hub nodes have thousands of children).
        self.needed = None

    def __repr__(self) -> str:
        return f"WindowNode(id={self.id}, [{self.start},{self.end}), swa={self.swa}, children={len(self.children)})"


class WindowTree(RadixTree):
    """`RadixTree` of `WindowNode`s: a split leaves the SWA run at the end of the edge."""

    def __init__(self):
        super().__init__(1, WindowNode)

    def split(self, child: WindowNode, k: int) -> WindowNode:
        s = child.swa
        head = super().split(child, k)
        tail = len(child.tokens)
        if s > tail:
            child.swa, head.swa = tail, s - tail
            head.has_state = True
        return head

    def check_node(self, node: WindowNode) -> None:
        super().check_node(node)
        assert 0 <= node.swa <= len(node.tokens) and node.has_state == (node.swa > 0), node


class _Candidates:
    """Dense columns of the eviction candidates (recency, value, leaf?, SWA tokens) for numpy
    argmins; the core's index interface (`add`, `update`, `remove`, `items`)."""

    def __init__(self):
        self.items: list[WindowNode] = []
        self.cols = np.zeros((4, 256))

    def __len__(self) -> int:
        return len(self.items)

    def add(self, node: WindowNode, last_access: float, value: float) -> int:
        slot = len(self.items)
        if slot == self.cols.shape[1]:
            self.cols = np.concatenate((self.cols, np.zeros_like(self.cols)), axis=1)
        self.items.append(node)
        self.cols[:, slot] = (last_access, value, float(not node.children), float(node.swa))
        return slot

    def update(self, slot: int, last_access: float, value: float) -> None:
        node = self.items[slot]
        self.cols[:, slot] = (last_access, value, float(not node.children), float(node.swa))

    def remove(self, slot: int):
        """Free `slot`; the item moved into it (its slot to update), or None."""
        last = len(self.items) - 1
        moved = None
        if slot != last:
            moved = self.items[slot] = self.items[last]
            self.cols[:, slot] = self.cols[:, last]
        self.items.pop()
        return moved


def pool_split(profile, kv_tokens: int, swa_tokens: int) -> tuple[int, float]:
    """(capacity_bytes, swa_share) of an SWA model's two pools as SGLang sizes them (`kv_tokens`
    full-KV token slots, `swa_tokens` SWA token slots), such that `WindowPrefixCache`'s static split
    gives each pool exactly its bytes. The served runtime's window shadows and the simulator's
    served SWA policy both size their caches here."""
    full = int(kv_tokens) * int(profile.kv_bytes_per_token)
    swa = int(swa_tokens) * int(profile.swa_kv_bytes_per_token)
    if full <= 0 or swa <= 0:
        raise MarconiError(f"pools of {kv_tokens} full and {swa_tokens} SWA tokens: both must be positive")
    total = full + swa
    share = swa / total
    if int(total * share) != swa:  # float rounding: nudge within the byte
        share = (swa + 0.5) / total
    assert int(total * share) == swa
    return total, share


class WindowPrefixCache(TokenArrayRequests, TreeCore):
    def __init__(self, profile, capacity_bytes: int, rules: WindowRules, *, alpha: float = 0.0,
                 swa_share: float | None = None):
        if not getattr(profile, "has_sliding_window", False):
            raise MarconiError(f"model {profile.name} has no sliding-window layers: use HybridPrefixCache")
        if profile.n_ssm_layers:
            raise MarconiError(f"model {profile.name} mixes SSM and sliding-window layers: not supported yet")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, (int, np.integer)) or capacity_bytes <= 0:
            raise MarconiError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        if swa_share is not None and not 0 < swa_share < 1:
            raise MarconiError(f"swa_share must be in (0, 1) (the SWA pool's share of the bytes), got {swa_share!r}")
        self.rules, self.alpha = rules, float(alpha)
        self.window = int(profile.sliding_window)
        self.full_bpt, self.swa_bpt = int(profile.kv_bytes_per_token), int(profile.swa_kv_bytes_per_token)
        self.swa_share = swa_share
        if swa_share is None:
            self.full_cap = self.swa_cap = None
        else:
            self.swa_cap = int(capacity_bytes * swa_share)
            self.full_cap = int(capacity_bytes) - self.swa_cap
        if (self.swa_cap if swa_share is not None else capacity_bytes) < self.window * self.swa_bpt:
            raise MarconiError(f"capacity {capacity_bytes} bytes (swa_share={swa_share}) holds no SWA window of "
                               f"{self.window} tokens ({self.window * self.swa_bpt} bytes on {profile.name})")
        self.swa_tokens = 0
        self._configure(profile, capacity_bytes, rules, WindowTree(), _Candidates(), counters=WindowCounters())

    # -- accounting ------------------------------------------------------------------------------
    @property
    def full_tokens(self) -> int:
        return self.kv_tokens

    @property
    def used_bytes(self) -> int:
        return self.kv_tokens * self.full_bpt + self.swa_tokens * self.swa_bpt

    def _pressure(self) -> str | None:
        if self.swa_share is None:
            return "any" if self.used_bytes > self.capacity_bytes else None
        if self.kv_tokens * self.full_bpt > self.full_cap:
            return "full"
        return "swa" if self.swa_tokens * self.swa_bpt > self.swa_cap else None

    # -- coverage ----------------------------------------------------------------------------------
    def _run_at_end(self, node: WindowNode) -> int:
        """Contiguous SWA tokens ending at node.end (walking up while whole edges are covered)."""
        run = 0
        root = self.tree.root
        while node is not root:
            s = node.swa
            run += s
            if s < len(node.tokens) or run >= self.window:
                break
            node = node.parent
        return run

    def _valid_in(self, node: WindowNode, p: int, run_above: int) -> bool:
        """Whether position p in (node.start, node.end] has an intact window; run_above is the
        SWA run ending at node.start."""
        s = node.swa
        lo = node.end - s
        if p <= lo:
            return False
        run = p - lo + (run_above if s == len(node.tokens) else 0)
        return run >= min(self.window, p)

    def verify_hit(self, input_tokens, hit: int) -> None:
        """Raise MarconiError unless the first `hit` tokens of the input are reusable now: tokens
        and full KV in the tree, SWA KV covering the window before `hit`."""
        if hit == 0:
            return
        seq = as_token_array(input_tokens)
        if hit >= len(seq):
            raise MarconiError(f"hit of {hit} tokens leaves none of the {len(seq)}-token input to prefill")
        walk = self.tree.walk(seq[:hit])
        if walk.overlap < hit:
            raise MarconiError(f"hit of {hit} tokens but only {walk.overlap} are cached with full KV")
        nodes = walk.path + ([walk.partial] if walk.partial is not None else [])
        node = nodes[-1]
        # the SWA run ending at hit: inside `node` up to `hit`, then whole edges above
        s, lo = node.swa, node.end - node.swa
        run = max(0, hit - lo)
        if s == len(node.tokens) and hit > lo and run < self.window:
            run += self._run_at_end(node.parent) if node.parent is not self.tree.root else 0
        if run < min(self.window, hit):
            raise MarconiError(f"hit of {hit} tokens ends on a broken window: {run} contiguous SWA tokens "
                               f"before it, {min(self.window, hit)} needed")

    # -- request API -------------------------------------------------------------------------------
    def lookup(self, input_tokens) -> WindowLookup:
        seq = as_token_array(input_tokens)
        walk = self.tree.walk(seq)
        limit = len(seq) - 1
        end = min(walk.overlap, limit)
        nodes = walk.path + ([walk.partial] if walk.partial is not None else [])
        hit, run_above = 0, 0
        for node in nodes:
            p = min(node.end, end)
            if p <= node.start:
                break
            if self._valid_in(node, p, run_above):
                hit = p
            s = node.swa
            run_above = s + run_above if s == len(node.tokens) else s
        reason = "input_end" if hit == limit else "token_mismatch" if hit == walk.overlap else "broken_window"
        self._touch_hit(walk.path, nodes, hit)
        return WindowLookup(hit, walk.overlap, self._branch(walk, hit, end), reason)

    def _branch(self, walk, hit: int, end: int) -> int | None:
        if self.rules.branch == "full_kv":  # SGLang: any full-KV match beyond the reusable window
            return end if end > hit else None
        # Marconi: where inserting the input creates a branch (mid-edge, or a new sibling under a
        # node with children whose end has no window)
        if walk.partial is None:
            node = walk.last
            if node is None or not node.children or self._run_at_end(node) >= min(self.window, node.end):
                return None
        return end if end > hit else None

    def _touch_hit(self, path: list, nodes: list, hit: int) -> None:
        """One clock tick for the hit; the nodes it refreshes share it."""
        self.clock += 1.0
        if self.rules.refresh_path:
            touched = path
        else:  # only what the hit reads: the nodes spanning its window
            touched = [n for n in nodes if n.start < hit and n.end > hit - self.window]
        for node in touched:
            node.last_access = self.clock
            self._refresh(node)

    def admit(self, sequence, lookup: WindowLookup) -> int:
        """Cache a finished request (input + output) after `lookup`; evict to fit. Returns the
        number of SWA windows kept."""
        seq = as_token_array(sequence)
        n, hit, w = len(seq), lookup.hit_tokens, self.window
        points = [n]
        if lookup.branch_at is not None and hit < lookup.branch_at < n:
            points.append(lookup.branch_at)
        path, partial, partial_len, overlap = self._walk(seq, n)
        node = path[-1] if path else self.tree.root
        if partial is not None:
            node = self._split(partial, partial_len)
        if overlap < n:
            node = self._add_leaf(node, *self._request_edge(seq, overlap, n))
        end_node = node
        ranges = [(hit, n, end_node)] if self.rules.keep_all else []
        if not self.rules.keep_all:
            for q in points:  # only the request's computed tokens [hit, n) can be kept
                ranges.append((max(hit, q - w), q, end_node if q == n else self._node_at(seq, q)))
        self.clock += 1.0
        for lo, _, at in ranges:
            self._cover(at, lo)
        self.counters.windows_admitted += len(ranges)
        self.lock(end_node)
        try:
            self._evict_to_budget(locked=True)
        finally:
            self.unlock(end_node)
        self._evict_to_budget(locked=False)  # a request larger than the cache: its own nodes go too
        return len(ranges)

    def serve(self, input_tokens, output_tokens=()) -> tuple[WindowLookup, int]:
        inp = as_token_array(input_tokens)
        lookup = self.lookup(inp)
        seq = np.concatenate((inp, np.asarray(output_tokens, dtype=np.int64)))
        return lookup, self.admit(seq, lookup)

    # -- tree edits (the core's, plus the SWA run) -------------------------------------------------
    def _cover(self, node: WindowNode, lo: int) -> None:
        """Make SWA KV present for [lo, node.end) along node and its ancestors."""
        root = self.tree.root
        while node is not root and node.end > lo:
            need = min(len(node.tokens), node.end - lo)
            s = node.swa
            if need > s:
                if not s:
                    node.has_state = True
                    self.ssm_states += 1
                node.swa = need
                self.swa_tokens += need - s
                node.parent.needed = None
            node.last_access = self.clock
            self._refresh(node)
            self._refresh(node.parent)
            if need < len(node.tokens):
                break
            node = node.parent

    def _split(self, child: WindowNode, k: int) -> WindowNode:
        child.parent.needed = None  # its child is now the head
        head = super()._split(child, k)
        self.ssm_states += head.has_state  # the SWA run may now span both
        self._refresh(head.parent)
        return head

    def _add_leaf(self, parent: WindowNode, tokens: np.ndarray) -> WindowNode:
        parent.needed = None
        return super()._add_leaf(parent, tokens)

    def evict(self, node: WindowNode) -> None:
        """Evict a leaf whole: its full KV and its SWA KV (the core drops its state)."""
        self.swa_tokens -= node.swa
        node.swa = 0
        node.parent.needed = None
        super().evict(node)

    def _tombstone(self, node: WindowNode, action: str) -> None:
        """Drop `node`'s SWA KV (WINDOW) or all of it beyond one window (TRIM); its full KV stays."""
        keep = self.window if action == TRIM else 0
        self.swa_tokens -= node.swa - keep
        node.swa = keep
        node.parent.needed = None
        if action == TRIM:
            self.counters.window_trims += 1
        else:
            self.counters.evictions_window += 1
            self._forget_state(node)
        self._refresh(node)
        self._refresh(node.parent)
        self._compress(node)

    # -- eviction --------------------------------------------------------------------------------
    def _evict_to_budget(self, locked: bool) -> None:
        while (pool := self._pressure()) is not None:
            victim = self._choose(pool)
            if victim is None:
                if locked:
                    return  # only the request's own nodes are left: the unlocked pass takes them
                raise AssertionError(f"over budget with no eviction candidate ({pool})")
            node, action = victim
            if action == LEAF:
                self.evict(node)
            else:
                self._tombstone(node, action)

    def _choose(self, pool: str) -> tuple[WindowNode, str] | None:
        c = self.index
        n = len(c)
        if not n:
            return None
        last, value, is_leaf, swa = c.cols[:, :n]
        leaf = is_leaf > 0
        if pool == "full":
            mask = leaf
        elif pool == "swa":
            mask = swa > 0
        else:
            mask = np.ones(n, dtype=bool)
        if self.rules.stale_first and pool != "full":
            stale = mask & (swa > self.window)
            if stale.any():
                return c.items[int(np.where(stale, last, np.inf).argmin())], TRIM
        if not mask.any():
            return None
        if self.rules.ranking == "flops" and self.alpha:
            idx = np.flatnonzero(mask)
            items = c.items
            i = int(idx[score.lowest_slot(score.scores(last[idx], value[idx], self.alpha),
                                          lambda tied: min(tied, key=lambda j: items[idx[j]].id))])
        else:
            masked = np.where(mask, last, np.inf)
            i = score.lowest_slot(masked, lambda tied: min(tied, key=lambda j: c.items[j].id))
        node = c.items[i]
        if leaf[i] and not (self.rules.window_victims == "any" and pool == "swa"):
            return node, LEAF
        return node, WINDOW

    # -- candidates (the core keeps the index current; these say what it holds) -------------------
    def _is_candidate(self, node: WindowNode) -> bool:
        """An unlocked leaf (evicted whole), or an unlocked inner node whose SWA KV alone may go."""
        return not node.lock_count and node.parent is not None and (not node.children or self._window_victim(node))

    def _window_victim(self, node: WindowNode) -> bool:
        """Whether eviction may drop only `node`'s SWA KV (keeping its full KV)."""
        if not node.swa:
            return False
        mode = self.rules.window_victims
        if mode == "any":
            return True
        if not node.children:
            return False  # a leaf's SWA is its branch's last window: the leaf goes whole
        if mode == "inner":
            return True
        # Marconi: never tombstone inside the last window of a branch (SGLang #35515): a child
        # whose run of SWA reaches into this node needs this node's SWA for its own window.
        needed = node.needed
        if needed is None:
            w = self.window
            needed = node.needed = any(len(c.tokens) < w and c.swa == len(c.tokens) for c in node.children.values())
        return not needed

    def flop_efficiency(self, node: WindowNode) -> float:
        """FLOPs saved by a hit at node.end rather than at its parent's end, per byte freed
        (`rules/value.py`): a leaf frees its full KV and SWA KV, an inner node its SWA KV."""
        if self.rules.ranking != "flops":
            return 0.0
        if self._run_at_end(node) < min(self.window, node.end):
            return 0.0  # nothing can hit here: free it first
        freed = node.swa * self.swa_bpt + (0 if node.children else len(node.tokens) * self.full_bpt)
        return value_rule.flops_saved_per_byte(self.flops(node.parent.end, node.end), freed)

    # -- checking --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The core's checks (ledgers, candidates, compression), the SWA ledger and the budget."""
        super().check_invariants()
        swa = sum(node.swa for node in self.tree.nodes())
        assert swa == self.swa_tokens, (swa, self.swa_tokens)
        assert self._pressure() is None, "over budget"
