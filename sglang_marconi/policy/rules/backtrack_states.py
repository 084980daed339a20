"""States where backtracks land: a bounded number of extra SSM states per request, at the chunk ends
its prefill checkpoints anyway, kept on probation. Engine-free; one rule, written once.

Marconi admits about two states per request (the branch state and the final one). An agent that
comes back to an earlier point of a long trajectory (a retried step, a chat template that strips
earlier reasoning, or simply its deep state evicted while other work ran) then finds the nearest
state far back, often at the shared system prompt, and replays everything after it. Upstream keeps
a state at every chunk end and so lands near the point it comes back to.

The rule: when a request replays a long stretch (from the state it resumed at to the end of its
input), a checkpoint at a chunk end inside that stretch offers its state as a *backtrack state*,
admitted when

- the request has admitted fewer than `per_request` of them, and fewer states in all than upstream
  keeps for it (one per prefill extend and the final state: `upstream_states`);
- the replay it saves is worth its slot: the FLOPs from the request's previous state on its path
  (the state it resumed at, or the last one it admitted) to this position are at least
  1 / (`per_request` + 1) of the FLOPs of the whole stretch. So the states cut the stretch into
  near-equal FLOP parts: a return that lands anywhere in it replays at most about one part (the
  coverage each state gives, times the FLOPs per byte of its slot, is then about equal). A
  replay shorter than a chunk has no chunk end inside it, and keeps none;
- the pool has room for the request's locked state and one more (`applies`).

Admitted states are probationary (`rules/probation.py`): kept only in free room or room freed from
other probationary states, evicted first, confirmed into regular states by a return that reuses
one. Under pressure they are what goes first, so they never displace a state Marconi would keep.

Nor do they displace a branch state (`bars_resume`). In extra_buffer an extend snapshots states
only a whole snapshot step (64) or more past where it starts, so a request that resumes less than
a step before its branch can never snapshot the branch. Chunk ends sit wherever a cold prefill
put them, often inside what later turns out to be a shared prompt: resuming at such a state, every
later request through the shared prompt would replay its tail again, the branch state never
written. So a match does not resume at a backtrack state still on probation that lies less than a
step before where the input leaves the tree; it resumes at the deepest other state, as it would
without the rule, and the branch state is written where Marconi alone writes it. Which
probationary states are backtrack states, `BacktrackMarks` records.

Callers: the simulator's model of the served cache (`policy/tree/served_cache.py`) and the served
admission (`serving/admission.py`), each with its own request's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sglang_marconi.policy.errors import MarconiError

DEFAULT_PER_REQUEST = 3


def default_setting(extra_buffer: bool) -> int:
    """What a cache runs without a setting (the served config's extra["backtrack_states"], the
    served-pools model's `ServedPools.backtrack_states` left None), the same on both sides:
    `DEFAULT_PER_REQUEST` in extra_buffer, where without it backtracking agents fall more than
    2 points below upstream under a tight pool (docs/benchmarks.md); off in no_buffer, where
    Marconi's admission is at or above upstream without it and the rule gains too little to pay
    for its states."""
    return DEFAULT_PER_REQUEST if extra_buffer else 0


def upstream_states(input_len: int, resumed_at: int, chunk: int | None) -> int:
    """States upstream keeps for one request: a state at the end of each prefill extend (chunks
    of `chunk` tokens from `resumed_at`; one extend when `chunk` is None) and the final one."""
    replay = max(0, input_len - resumed_at)
    extends = 1 if chunk is None else max(1, -(-replay // chunk))
    return extends + 1


@dataclass(frozen=True)
class BacktrackStates:
    """The rule's bound: at most `per_request` backtrack states per request."""

    per_request: int = DEFAULT_PER_REQUEST

    def __post_init__(self):
        n = self.per_request
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise MarconiError(f"backtrack states per request must be a positive integer, got {n!r}")

    @staticmethod
    def applies(state_slots: int, request_slots: int) -> bool:
        """Whether a pool of `state_slots` runs the rule, a running request holding `request_slots`:
        only with room for the state it holds locked (the one it reused or last inserted; a
        backtrack state moves the lock, never adds one) and one more, so its branch state always
        finds a slot. A smaller pool has no room for a branch state once the lock sits on a state,
        and a backtrack state there would steer which states it holds into that case."""
        return state_slots >= request_slots + 2

    def admits(self, position: int | None, previous: int, resumed_at: int, input_len: int, taken: int,
               admitted: int, chunk: int | None, flops: Callable[[int, int], float]) -> bool:
        """Is the state a checkpoint offers at `position` a backtrack state to keep? `previous`:
        the request's last state on its path (the one it resumed at, or the last it admitted);
        `resumed_at`: the state its match reused; `taken`: backtrack states it admitted so far;
        `admitted`: states of any kind it admitted so far; `flops(start, end)`: prefill FLOPs."""
        if position is None or not previous < position < input_len or taken >= self.per_request:
            return False
        if admitted + 2 > upstream_states(input_len, resumed_at, chunk):  # this one, and a final state
            return False
        return flops(previous, position) * (self.per_request + 1) >= flops(resumed_at, input_len)


def bars_resume(state_end: int, kv_match: int, step: int | None) -> bool:
    """May a match not resume at a backtrack state still on probation that ends `state_end` tokens
    in, the input's KV match ending at `kv_match` (on the page grid)? extra_buffer (`step`: the
    snapshot grid): barred when the match ends less than a step past it, where an extend starting
    at it could not snapshot the branch. no_buffer (`step` None): never (two-pass prefill ends a
    chunk at the branch from any state)."""
    return step is not None and kv_match - step < state_end < kv_match


class BacktrackMarks:
    """Which of one tree's probationary states are backtrack states (the others are input-end
    states). A mark counts only while its node is on probation (`ProbationRegistry`): confirmed
    or evicted, the state is a regular one or gone. Every probationary state is marked or unmarked
    as it is admitted, so a node back on probation carries the right mark. Keyed by node id,
    holding the node (an id reused by another node is not confused with it)."""

    def __init__(self):
        self._nodes: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def mark(self, node, backtrack: bool, probation) -> None:
        """`node`'s new probationary state is a backtrack state (or, not `backtrack`, an input-end one)."""
        if not backtrack:
            self._nodes.pop(node.id, None)
            return
        self._nodes[node.id] = node
        if len(self._nodes) > 2 * len(probation) + 64:  # drop marks that no longer count
            self._nodes = {i: n for i, n in self._nodes.items() if n in probation}

    def nodes(self):
        """The nodes marked (some may no longer be on probation)."""
        return self._nodes.values()

    def bars(self, node, state_end: int, kv_match: int, step: int | None, probation) -> bool:
        """Is `node`'s state (ending `state_end` in) a backtrack state on probation that a match
        ending at `kv_match` may not resume at (`bars_resume`)?"""
        return (bars_resume(state_end, kv_match, step) and self._nodes.get(node.id) is node
                and node in probation)


def backtrack_rule_of(setting) -> BacktrackStates | None:
    """The rule for a setting: None / 0 / "off" (none), an integer B or "on" (B =
    `DEFAULT_PER_REQUEST`); a bad value raises a one-line error naming it."""
    if setting is None or setting is False or setting == 0 or setting == "off":
        return None
    if setting is True or setting == "on":
        return BacktrackStates()
    if isinstance(setting, BacktrackStates):
        return setting
    if isinstance(setting, str) and setting.isdigit():
        setting = int(setting)
    if isinstance(setting, int) and not isinstance(setting, bool):
        return BacktrackStates(setting)
    raise MarconiError(f"backtrack states must be on, off or a count per request, got {setting!r}")


def parse_backtrack_states(text: str, flag: str = "--marconi-backtrack-states") -> int | None:
    """B from 'auto' (None: the rule's default for the Mamba strategy) or an integer >= 0 (0: off);
    a bad value raises a one-line error naming `flag` and the value."""
    if text == "auto":
        return None
    if not (text.isascii() and text.isdigit()):  # digits only: no sign, no fraction
        raise MarconiError(f"{flag} {text!r}: expected 'auto' or an integer >= 0")
    return int(text)
