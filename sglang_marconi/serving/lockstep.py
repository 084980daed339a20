"""The ranks that run one scheduling on identical trees, and how they agree.

SGLang runs the same scheduling on every rank of an attention-TP group (and every attention-CP
rank and PP stage), each on its own tree, and marks `match_prefix`, `insert` and `evict`
`@rank_consensus(same_results)`: the trees must never differ. Every Marconi decision that changes
a tree is a function of the request stream, and the two that are not by nature (the tuner's pace,
a local failure) are settled at sync points: every `sync_every` releases each rank calls `agree`,
one small all-reduce (MAX) per group over SGLang's CPU (gloo) groups, the groups SGLang's own
rank-consensus checker uses. The group's first rank runs the only tuner and contributes its
choice; any rank's tuner failure or Marconi fault makes the whole group fall back together.

Imports torch lazily (only for a group of more than one rank).
"""

from __future__ import annotations

from dataclasses import dataclass

NO_CHOICE = -1


@dataclass(frozen=True)
class Agreement:
    choice: int  # index of the choice the group adopts, or NO_CHOICE
    tuner_failed: bool
    faulted: bool


class RankGroup:
    """`groups`: torch.distributed process groups (CPU), any of them None; those of one rank are
    ignored. With none left the group is this rank alone and `agree` communicates nothing."""

    def __init__(self, groups=()):
        groups = [g for g in groups if g is not None]
        if groups:
            import torch.distributed as dist

            groups = [g for g in groups if dist.get_world_size(g) > 1]
            self.is_leader = all(dist.get_rank(g) == 0 for g in groups)
        else:
            self.is_leader = True
        self.groups = groups

    @classmethod
    def from_cache_params(cls, params) -> RankGroup:
        """The ranks sharing one tree: attention-CP x attention-TP (the TP group where SGLang gives
        no attention-TP group) x PP, as `Scheduler.init_rank_consensus_checker` checks them."""
        tp = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
        return cls([getattr(params, "attn_cp_cache_group", None), tp, getattr(params, "pp_cache_group", None)])

    @property
    def single(self) -> bool:
        return not self.groups

    def agree(self, choice: int, tuner_failed: bool, faulted: bool) -> Agreement:
        """Collective: every rank of the group calls it at the same point of the request stream."""
        if not self.groups:
            return Agreement(choice, tuner_failed, faulted)
        import torch
        import torch.distributed as dist

        t = torch.tensor([choice, int(tuner_failed), int(faulted)], dtype=torch.int64)
        for group in self.groups:  # MAX along each axis of the grid = MAX over the whole group
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return Agreement(int(t[0]), bool(t[1]), bool(t[2]))
