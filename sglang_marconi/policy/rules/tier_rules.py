"""What a device eviction does with what it evicts, under a host tier: demote it or drop it.

Each rule is a function of one node's facts (`EvictionFacts`), nothing else, so a serving engine
can ask it about its own tree node exactly as the simulator's `TieredPrefixCache` does.

`UpstreamWriteBack` is SGLang 0.5.23's `--hicache-write-policy write_back` for hybrid trees, as
its source reads (`unified_radix_cache.py`, `unified_cache/unified_tree_core.py`,
`unified_cache/components/mamba.py`):

- A node leaves the device whole (a device leaf, `evict_device_leaf`): if its KV has no host copy
  (`not node.backuped`) it is backed up first, KV and the node's device Mamba state together
  (`_build_backup_kv_action` -> `build_backup_spec`), then demoted; if the host cannot make room
  for the KV even after its own eviction (`evict_host`), the node and its host-only subtree are
  dropped (`drop_subtree_no_host`). If its KV already has a host copy, it is demoted in place
  (`_demote`: no backup is built), and a Mamba state that lives only on the device is freed with
  the device KV (`_cascade_evict`): the state is lost.
- A node's Mamba state leaves the device alone (Mamba-slot pressure on an internal node,
  `MambaComponent._evict_device_next_node`): backed up first (`InternalStateBackup` ->
  `backup_node_for_write_back`, KV and state) only if the node's KV has no host copy and is on
  the device; otherwise the state is tombstoned with no copy. A failed backup tombstones it too.
- So "internal-node Mamba states are dropped on write-back" is, in 0.5.23, true exactly where
  the node's KV already has a host copy: after a load back (host copies stay), or on a branch
  node split off such a node, which is where Marconi's admission puts its most shared state.
  The comment in `finalize_match_result_in_tree_core` says as much ("incremental persistence of
  a new branching state is currently write-through only; write-back eviction may discard the
  device-only state"). SGLang #40680 (open) proposes backing those up too.

`MarconiTiering`: keep on the host what is worth its bytes there. A leaf that holds a state (or
whose KV the host-resident nodes below it need) is demoted with its state, and a state evicted
alone (its KV stays on the device, where its child needs it) is demoted, whatever already has a
host copy; but the host admits what is not forced only if the candidates it would displace rank
below it (recency + alpha x FLOPs saved per byte, the host's own candidates and budget): else it
is dropped. A leaf without a state saves no prefill anywhere: it is dropped. A node a client asked to keep
(`kept_for_client`: a `24h` cache-hint credit in force on it, `cache_hints.py`) is demoted with its
state whatever it would displace: the host makes room by its own order. That is bounded: credits
are charged against the share of the device pools (`--marconi-hinted-share`), and they lapse.
`UpstreamWriteBack` writes back every device leaf anyway (a credit changes nothing there).

`MarconiTiering(depth=B)` (or `depth="auto"`) ranks the host by the continuation signal instead:
a host candidate's keep score is B x log(1 + depth) - log(age) (`DepthOrder`: the device's
depth rule, `eviction/depth.py`, over the host's candidates), its depth that of the finished
sequence ending exactly at it in the stream's `ContinuationRecord` (0 if none, or once past the
record's continuation horizon), its age measured
back from the most recent of the candidates compared (and the incoming node). The host evicts
the lowest keep score first, and a ranked demotion displaces only candidates below the incoming
node's. "auto" fits B from the record (`fitted_exponent`: 0, plain recency, unless deeper
sequences are continued significantly more often). On conversation traffic, where most reuse is
a next turn extending its previous turn's whole sequence, this keeps on the host the sequences
deep in a conversation, which are the likelier to be continued.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.eviction import FlopAwareEviction
from sglang_marconi.policy.rules.eviction.depth import MAX_EXPONENT, check_exponent, fitted_exponent
from sglang_marconi.policy.rules.eviction.flop_aware import check_alpha


@dataclass(frozen=True, slots=True)
class EvictionFacts:
    """One device eviction, as the rule sees it."""

    frees_kv: bool  # the node leaves the device whole (a device leaf); False: only its state does
    kv_on_host: bool  # its KV already has a host copy (SGLang's `node.backuped`)
    state_on_device: bool
    state_on_host: bool
    host_descendants: bool  # host-resident nodes below it reach the root only through its KV
    kept_for_client: bool = False  # a client's `24h` cache-hint credit is in force on it

    @property
    def has_state(self) -> bool:
        return self.state_on_device or self.state_on_host


@dataclass(frozen=True, slots=True)
class Demotion:
    """What a host copy exists of once the eviction is done (copied now where there was none)."""

    kv: bool
    state: bool
    # True: the host takes it only if what it would displace ranks below it, else it is dropped.
    # False: the host makes room by its own eviction order, whatever that displaces.
    ranked: bool = False


class UpstreamWriteBack:
    """SGLang 0.5.23's write_back eviction (see the module docstring), LRU on the host."""

    name = "upstream-write-back"
    reclaims_state_duplicates = False  # only Full KV host duplicates are reclaimed (`_reclaim_full_host_duplicates`)
    host_evicts_states = False  # under KV pressure the host evicts host leaves only (FullComponent.drive_host_eviction)
    drops_stateless_host_leaves = False  # a KV-only host node stays until LRU reaches it

    def demotion(self, facts: EvictionFacts) -> Demotion:
        if not facts.kv_on_host:  # not backed up: the backup carries the node's device state with it
            return Demotion(kv=True, state=facts.has_state)
        return Demotion(kv=True, state=facts.state_on_host)  # demoted in place: a device-only state is lost

    ranks_by_depth = False

    def host_alpha(self, device_eviction) -> float:
        return 0.0

    def host_order(self, device_eviction, record=None) -> float:
        return 0.0


@dataclass(frozen=True, slots=True)
class DepthOrder:
    """The host's order under the continuation signal: the lowest keep score goes first,
    keep = exponent x log(1 + depth) - log(newest - recency + 1) (the device's depth rule,
    `eviction/depth.deepest_oldest`, as a score); exponent 0 is plain recency (LRU)."""

    exponent: float

    def keep(self, recency, depths, newest: float) -> np.ndarray:
        age = newest - np.asarray(recency, dtype=float) + 1.0
        if not self.exponent:
            return -np.log(age)
        return self.exponent * np.log1p(np.asarray(depths, dtype=float)) - np.log(age)


class MarconiTiering:
    """Demote by value per byte against the host's own candidates, ranked by recency + `alpha` x
    FLOPs saved per byte. The default weighs the two normalized terms equally: the device's tuner
    sees the device tier alone, so its alpha is no evidence for the host (`alpha=None` follows it
    anyway: the device's FLOP-aware alpha in force, 0 while it runs another choice)."""

    reclaims_state_duplicates = True
    host_evicts_states = True  # a host-only state of a node with <= 1 child is a candidate on its own
    drops_stateless_host_leaves = True  # a host-only leaf without a state can serve no hit

    def __init__(self, alpha: float | None = 1.0, depth: float | str | None = None):
        """`depth`: None ranks the host by recency + alpha x FLOPs saved per byte; a number B, or
        "auto" (B fitted from the record), ranks it by `DepthOrder` (alpha unused)."""
        self.alpha = None if alpha is None else check_alpha(alpha)
        if depth is not None and depth != "auto":
            if isinstance(depth, str):
                raise MarconiError(f"host depth {depth!r}: expected a number B or 'auto'")
            depth = check_exponent(depth)
        self.depth = depth
        self.name = "marconi" if depth is None else f"marconi+depth:{depth if depth == 'auto' else f'{depth:g}'}"
        self._fitted = (None, 0.0)  # (the settled rates B was fitted from, B)

    @property
    def ranks_by_depth(self) -> bool:
        """Whether the host ranks by `DepthOrder` (its candidates' value column holds their depth)."""
        return self.depth is not None

    def host_order(self, device_eviction, record=None) -> float | DepthOrder:
        """The host's order now: an alpha (recency + alpha x FLOPs saved per byte), or a
        `DepthOrder` whose B is fixed or fitted from `record`'s settled rates (the same whenever
        it is asked between two settlements: a function of the stream alone)."""
        if self.depth is None:
            return self.host_alpha(device_eviction)
        if self.depth != "auto":
            return DepthOrder(self.depth)
        if record is None:
            return DepthOrder(0.0)
        settled = record.settled_rates
        if self._fitted[0] is not settled:
            self._fitted = (settled, fitted_exponent(*settled))
        return DepthOrder(self._fitted[1])

    @staticmethod
    def depth_of(record, end: int, last_token: int) -> float:
        """A host candidate's depth: that of the finished sequence ending exactly at `end` with
        `last_token` in `record`, 0 if none (or no record)."""
        return 0.0 if record is None else float(record.depth_at(end, last_token))

    def demotion(self, facts: EvictionFacts) -> Demotion:
        if not facts.frees_kv:  # a state alone: its KV stays on the device
            return Demotion(kv=facts.kv_on_host, state=True, ranked=not facts.kept_for_client)
        # dropping this KV would drop the host nodes below it; or a client asked to keep it
        forced = facts.host_descendants or facts.kept_for_client
        keep = facts.has_state or forced
        return Demotion(kv=keep, state=facts.has_state, ranked=keep and not forced)

    def host_alpha(self, device_eviction) -> float:
        if self.alpha is not None:
            return self.alpha
        return device_eviction.alpha if isinstance(device_eviction, FlopAwareEviction) else 0.0


def host_candidate_bytes(rules, *, locked: bool, is_root: bool, kv_on_device: bool, kv_on_host: bool,
                         state_on_device: bool, state_on_host: bool, n_children: int, kv_bytes: int,
                         state_bytes: int) -> int | None:
    """The host bytes evicting one node from the host frees, None if it is no host candidate under
    `rules`: a host-only leaf goes whole (its KV and its state), and, where the rules evict states
    on the host (`host_evicts_states`), a host-only state of a node with at most one child goes
    alone. One rule for the simulator's `TieredPrefixCache` and the served HiCache tree
    (`serving/host_tier.py`)."""
    if locked or is_root:
        return None
    if not kv_on_device and not n_children:
        return (kv_bytes if kv_on_host else 0) + (state_bytes if state_on_host else 0)
    if rules.host_evicts_states and state_on_host and not state_on_device and n_children <= 1:
        return state_bytes
    return None


TIER_RULES = {"sglang+": UpstreamWriteBack, "marconi": MarconiTiering}


def parse_host_depth(text: str, flag: str = "--marconi-host-depth") -> float | str | None:
    """The host tier's continuation signal (`MarconiTiering(depth=...)`) from a flag's text: None from
    'off', 'auto', or a number B (0 <= B <= the depth rule's bound); a bad value raises a one-line
    error naming `flag` and the value."""
    if text in ("off", "auto"):
        return None if text == "off" else text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_EXPONENT:
        raise MarconiError(f"{flag} {text!r}: expected 'off', 'auto' or a number B (0 <= B <= {MAX_EXPONENT:g})")
    return value
