"""The ranks that run one scheduling on identical trees, and how their Marconi caches stay alike.

SGLang runs the same scheduling on every rank of an attention-TP group (and every attention-CP
rank and PP stage), each on its own tree, and requires the trees never to differ. Every Marconi
decision that changes a tree is a function of what every rank sees in the same order: the
requests, and the *directives* the group's leader adds to them.

- The leader (rank 0 of every axis: the rank that reads requests from the tokenizer) runs the
  only tuner. At a sync point it turns the tuner's verdict into a `Directive` (adopt a choice,
  stop tuning) and sends it with the requests it hands the other ranks anyway: SGLang broadcasts
  each iteration's requests from that rank across attention TP / CP and relays them from stage
  to stage under PP (`serving/group_channel.py`). Every rank applies it when it processes that
  iteration's requests, so every rank changes its eviction rule at the same point of its stream.
  No rank ever waits on another for it, and no collective runs on the batch path.
- Marconi faults never need agreeing: `serving/faults.py` keeps a rank in step by rebuilding
  what it derived from the tree, or stops the group loudly.
- At start-up every rank agrees on a digest of the Marconi settings it was given
  (`agree_on_settings`), one all-gather per axis while the cache is built (every rank builds it at
  the same point of its start-up), and all refuse to start, in one line, when they differ.

A rank alone delivers its directives to itself at once (`LocalChannel`). Imports torch lazily
(only for a group of more than one rank).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Optional

from sglang_marconi.policy.errors import MarconiError


@dataclass(frozen=True)
class Directive:
    """What the leader tells every rank, applied where it arrives in the request stream.
    `seq` counts the leader's directives (a rank that sees a gap knows one was lost)."""

    seq: int
    choice: Optional[int] = None  # index into the tuner's choices to adopt, or None
    stop_tuning: Optional[str] = None  # why the group stops tuning (the choice in force stays)


class RankGroup:
    """`groups`: torch.distributed process groups (CPU), any of them None; those of one rank are
    ignored. With none left the group is this rank alone."""

    def __init__(self, groups=()):
        groups = [g for g in groups if g is not None]
        self.size, self.rank = 1, 0
        if groups:
            import torch.distributed as dist

            groups = [g for g in groups if dist.get_world_size(g) > 1]
            self.is_leader = all(dist.get_rank(g) == 0 for g in groups)
            for g in groups:  # position in the grid of the axes, row-major
                self.rank = self.rank * dist.get_world_size(g) + dist.get_rank(g)
                self.size *= dist.get_world_size(g)
        else:
            self.is_leader = True
        self.groups = groups

    @classmethod
    def from_cache_params(cls, params) -> RankGroup:
        """The ranks sharing one tree: attention-CP x attention-TP (the TP group where SGLang gives
        no attention-TP group) x PP, as SGLang's rank-consensus checker groups them."""
        tp = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
        return cls([getattr(params, "attn_cp_cache_group", None), tp, getattr(params, "pp_cache_group", None)])

    @property
    def single(self) -> bool:
        return not self.groups

    def agree_on_settings(self, digest: str, what: str = "Marconi settings",
                           remedy: str = "start every rank with the same SGLANG_MARCONI_CONFIG and flags") -> None:
        """Start-up collective: every rank of the group passes the digest of what it was given;
        every rank raises the same one-line error when they differ."""
        if not self.groups:
            return
        import torch.distributed as dist

        for group in self.groups:
            seen = [None] * dist.get_world_size(group)
            dist.all_gather_object(seen, digest, group=group)
            if len(set(seen)) > 1:
                ranks = ", ".join(f"rank {r}: {d}" for r, d in enumerate(seen))
                raise MarconiError(f"the ranks of one TP/PP group were given different {what} ({ranks}); {remedy}")


def settings_digest(*parts) -> str:
    """A short digest of everything that decides how a rank's Marconi cache behaves."""
    text = "\x1f".join(repr(p) for p in parts)
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:12]


class LocalChannel:
    """A rank alone: a directive takes effect as it is sent."""

    def __init__(self, apply: Callable[[Directive], None]):
        self._apply = apply

    def send(self, directive: Directive) -> None:
        self._apply(directive)

    def drain(self) -> list:
        return []


class GroupChannel:
    """A rank of a group. The leader's directives wait in `outbox` until they come back to it
    through the broadcast that hands every rank the iteration's requests (`group_channel.py` in
    a server, a test's broadcast elsewhere): `drain` hands out copies of every pending one at
    each poll, and only `receive` takes one out, on the leader, as it applies it. A poll whose
    list never reaches the broadcast (SGLang skips a receive) so loses nothing: the next poll
    hands the same directives out again. `receive` applies each directive once, in order, on
    whichever rank it reaches; a second copy is ignored.

    Bounded: a directive handed out `bound` times without coming back, or `bound` directives
    pending at once, stop the leader with one error naming the oldest. A skipped receive
    keeps a directive out at most `--scheduler-recv-interval` polls with SGLang's default
    skipper weights (a receive when the weights of the polls since the last one reach the
    interval; every weight >= 1), and the runtime sends at most one directive per sync point,
    so the default bound is reached only when directives are not getting through at all."""

    DEFAULT_BOUND = 100_000

    def __init__(self, apply: Callable[[Directive], None], bound: int = DEFAULT_BOUND):
        if bound < 1:
            raise ValueError(f"GroupChannel bound must be >= 1, got {bound}")
        self._apply = apply
        self.bound = bound
        self.outbox: list[Directive] = []  # sent here, not yet back: oldest first
        self.handed_out = 0  # polls the oldest pending directive has gone out on
        self.applied = -1  # seq of the last directive applied here

    def send(self, directive: Directive) -> None:
        if len(self.outbox) >= self.bound:
            self._stuck(f"{len(self.outbox)} directives are pending")
        self.outbox.append(directive)

    def drain(self) -> list:
        """Every pending directive, in order; they stay pending until `receive` sees them."""
        if not self.outbox:
            return []
        if self.handed_out >= self.bound:
            self._stuck(f"it went out on {self.handed_out} polls")
        self.handed_out += 1
        return list(self.outbox)

    def _stuck(self, why: str) -> None:
        raise MarconiError(f"Marconi directive {self.outbox[0].seq} never came back through the request "
                           f"broadcast ({why}): the leader's directives do not reach the group's ranks")

    def receive(self, directive: Directive) -> None:
        if directive.seq <= self.applied:
            return  # a copy already applied (handed out again after a skipped receive, or relayed twice)
        if directive.seq != self.applied + 1:
            raise MarconiError(f"Marconi directive {directive.seq} arrived after {self.applied}: "
                               "one was lost between the group's ranks")
        self.applied = directive.seq
        while self.outbox and self.outbox[0].seq <= directive.seq:  # back at the leader: done
            del self.outbox[0]
            self.handed_out = 0
        self._apply(directive)
