"""What an exception in Marconi's own code costs, one protocol for every path (SSM and SWA).

Marconi's code on the scheduler thread is of three kinds, and each fails differently:

- **Rank-local** (the tuner feed, the idle flush, the figures, the metrics exporter and the
  `/server_info` readbacks): it never changes the tree, and it may exist on one rank only (the tuner on the group's leader, the
  exporter on the stats rank). A failure there stops that feature on this rank with one warning
  (`rank_local`); the tree and the eviction rule in force are untouched. Tuning stops on every
  rank of a group at once because only the leader tunes and it tells the others
  (`lockstep.Directive`).
- **Tree-changing, recoverable** (the eviction index's upkeep and its victim choice, the
  sliding-window plan's): the index is derived state, a function of the tree and of the primary
  data recorded on its nodes, which every rank holds identically. A failure there is recovered on
  the spot (`recovered`): the caller drops the index, rebuilds it from the tree and decides
  again, so this rank decides exactly what its peers decide. One warning per cache. Primary data
  (a node's recency stamps, the probation registry) is written outside this guard: a fault
  midway through writing it would leave this rank's data different from its peers', and a
  rebuild would faithfully reproduce the difference.
- **Repeated recoveries escalate.** A fault that comes back is a bug, not bad luck, and each
  recovery costs a whole-tree rebuild: a cache recovers at most `RECOVERY_LIMIT` (3) faults within
  any `RECOVERY_WINDOW` (1,024) consecutive releases (the stream position sync points are counted
  in, the same on every rank; a cache with no runtime counts none, so its bound is 3 in all). The
  next one is unrecoverable, as below: a rank of a group stops the group with one line, never
  goes on alone with upstream's rules.
- **Tree-changing, unrecoverable** (a rebuilt index that fails again, a recovery past the bound,
  primary data: recency stamps and the probation registry, admission, chunking at a branch, a
  sliding-window plan that cannot be rebuilt): `unrecoverable`. A rank alone falls back
  to upstream's eviction and admission from here on (one warning). A rank of a TP / PP group
  cannot: its peers did not fail and would go on with Marconi's rule, so the trees would part
  and the group would hang or serve wrong attention. It raises `MarconiGroupFault`, one line
  naming the rank and the fault, which stops its scheduler and with it the whole server (SGLang
  takes the server down when a scheduler dies). A fault that hits every rank at the same point
  of the stream (a deterministic bug) raises on every rank the same way.

Engine-free: imports neither SGLang nor torch.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Optional

from sglang_marconi.policy.errors import MarconiError

log = logging.getLogger("sglang_marconi")
RECOVERY_LIMIT = 3  # recoveries a cache makes within RECOVERY_WINDOW releases; the next fault escalates
RECOVERY_WINDOW = 1024  # releases


class MarconiGroupFault(MarconiError):
    """Marconi's tree-changing code failed on one rank of a TP / PP group and could not recover:
    going on would make this rank's tree differ from its peers'."""


def _describe(where: str, exc: BaseException) -> str:
    return " ".join(f"{where}: {type(exc).__name__}: {exc}".splitlines())  # one line, whatever exc says


class MarconiFaults:
    """One per cache. `group_size`: ranks sharing one scheduling (1: a rank alone).
    `rank`: this rank's position in the group, for the error message."""

    def __init__(self, group_size: int = 1, rank: int = 0):
        self.group_size = group_size
        self.rank = rank
        self.fallen_back: Optional[str] = None  # why this cache serves upstream's rules (a rank alone)
        self.recovered_count = 0  # faults recovered by rebuilding from the tree
        self.rank_local_failures: dict[str, str] = {}  # feature -> why it stopped on this rank
        self._warned_recovered = False
        self._recent: deque = deque(maxlen=RECOVERY_LIMIT)  # stream positions of the latest recoveries
        # Called once on the first unrecoverable fault of a rank alone (the runtime stops tuning).
        self.on_fall_back: Optional[Callable[[str], None]] = None
        # The stream position: releases so far (the runtime's count, the same on every rank).
        self.position: Callable[[], int] = lambda: 0

    @property
    def healthy(self) -> bool:
        return self.fallen_back is None

    # -- rank-local code ---------------------------------------------------------------------
    def rank_local(self, feature: str, where: str, exc: BaseException, *, stops: bool = True) -> None:
        """`feature` (e.g. "tuning", "metrics") failed in `where`: it stops on this rank (with
        `stops=False`, an on-demand readback, it is tried again at its next call); the tree is
        untouched. One warning per feature."""
        if feature in self.rank_local_failures:
            return
        self.rank_local_failures[feature] = _describe(where, exc)
        log.warning("Marconi %s %s on this rank after a failure in %s (%s: %s); the cache and its "
                    "eviction rule are unchanged", feature, "stopped" if stops else "failed", where,
                    type(exc).__name__, exc)

    def stopped(self, feature: str) -> bool:
        return feature in self.rank_local_failures

    # -- tree-changing code ------------------------------------------------------------------
    def recovered(self, where: str, exc: BaseException) -> bool:
        """A fault in derived state (the eviction index): the caller rebuilds it from the tree,
        which every rank holds identically, and decides again. Past the recovery bound the fault
        is unrecoverable instead: a rank of a group raises `MarconiGroupFault`, a rank alone falls
        back and this returns False (the caller must not decide with Marconi's index again)."""
        if self.fallen_back is not None:
            return False  # upstream's rules are in force: nothing of Marconi's to rebuild
        position = self.position()
        recent = self._recent
        if len(recent) == RECOVERY_LIMIT and position - recent[0] < RECOVERY_WINDOW:
            self.unrecoverable(f"{where}, fault {RECOVERY_LIMIT + 1} within {RECOVERY_WINDOW} releases "
                               "(the recovery bound)", exc)
            return False
        recent.append(position)
        self.recovered_count += 1
        if not self._warned_recovered:
            self._warned_recovered = True
            log.warning("Marconi fault in %s (%s: %s); rebuilt the eviction index from the tree and went on "
                        "(counted in marconi_faults_recovered)", where, type(exc).__name__, exc,
                        exc_info=(type(exc), exc, exc.__traceback__))
        return True

    def unrecoverable(self, where: str, exc: BaseException) -> None:
        """A fault Marconi cannot recover from. A rank alone falls back to upstream from now on
        (first fault only: later ones are covered by the fallback); a rank of a group raises."""
        if self.group_size > 1:
            raise MarconiGroupFault(
                f"Marconi fault on rank {self.rank} of a {self.group_size}-rank TP/PP group that it cannot "
                f"recover from ({_describe(where, exc)}); its prefix tree would differ from the other ranks', "
                "so the group stops here") from exc
        if self.fallen_back is not None:
            return
        self.fallen_back = _describe(where, exc)
        log.warning("Marconi fault in %s (%s: %s); this cache falls back to SGLang's own eviction from now on",
                    where, type(exc).__name__, exc, exc_info=(type(exc), exc, exc.__traceback__))
        callback = self.on_fall_back
        if callback is not None:
            try:
                callback(self.fallen_back)
            except Exception as cb_exc:  # the fallback itself must never take the scheduler down
                log.warning("Marconi: fallback callback failed (%s: %s)", type(cb_exc).__name__, cb_exc)

    def figures(self) -> dict:
        return {"marconi_faults_recovered": self.recovered_count,
                "marconi_rank_local_failures": len(self.rank_local_failures)}
