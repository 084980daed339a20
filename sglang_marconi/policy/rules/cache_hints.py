"""Client cache hints as an eviction rule: OpenAI's `prompt_cache_key` and `prompt_cache_retention`.

A request that names a key says its conversation goes on: the sequence it leaves in the cache
(its KV and the state at its end) is what the key's next request will reuse. The rule gives that
end node a bounded recency credit: its eviction stamps look younger by the cache's own clock
advance over the last `horizon` releases (4 x `horizon` for retention `24h`), so under a ranking
by recency (LRU; Marconi's score in proportion to its recency weight) it outlives unhinted
entries of its age, then ages out like any other entry.

- Horizon: twice the median number of releases between a key's requests, learned from the
  stream (`KeyHistory`), unless fixed.
- Only when it helps: credits are granted only while the cache is losing conversations, i.e. at
  least `LOSS_NEEDED` of the latest returns of keys that held no credit found less than the prefix
  their previous request left. A cache that keeps conversations anyway is served exactly as
  without hints.
- One credit per key: a key's next hinted request moves its credit to its own end (the
  conversation moved on).
- Aging: a credit lapses a horizon after it was granted; its stamps go back to what they were (a
  stamp a hit or an insert refreshed since is kept).
- Bounded share: a credit is charged its sequence's whole length (KV up to its end, plus the end
  state); at most `share` of each pool may be charged at once, and a grant that does not fit is
  refused until credits lapse or move. Refusing new keys (rather than lapsing the oldest credit)
  keeps a stable set of conversations whole under thrashing, which is where a credit pays;
  lapsing the oldest first is LRU over keys again and gained nothing on the synthetic traces.
  A shared prefix is charged once per credit, so the KV that credits keep is at most what they
  are charged: no client, however many keys it sends, holds more than `share` of a pool.

A request without a hint changes no stamp: the ledger only records the clock at each release.
Every decision is a function of the request stream (keys, retentions, hits, release order and the
cache's own clock), identical on every rank; lapses happen in grant order.

Engine-free: a cache hands the ledger an adapter over its nodes (`HintAdapter`); the simulator's
trees (`sim/hinted.py`) and the served cache (`serving/cache_hints.py`) each bring one.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Protocol

from sglang_marconi.policy.errors import MarconiError

IN_MEMORY, DAY = "in-memory", "24h"
RETENTIONS = (IN_MEMORY, DAY)
# OpenAI spells the default `in-memory`; `in_memory` is accepted as the same retention.
_RETENTION_ALIASES = {IN_MEMORY: IN_MEMORY, "in_memory": IN_MEMORY, DAY: DAY}
HORIZON_FACTOR = {IN_MEMORY: 1, DAY: 4}
DEFAULT_HORIZON = 256  # releases a credit lasts under retention in-memory, until the stream says otherwise
DEFAULT_HINTED_SHARE = 0.5
MAX_KEY_CHARS = 1024


class HintError(MarconiError, ValueError):
    """A hint the client sent that the rule cannot take (one line naming the bad value)."""


@dataclass(frozen=True, slots=True)
class CacheHint:
    key: str
    retention: str = IN_MEMORY


def parse_hint(key: Any, retention: Any = None) -> CacheHint | None:
    """The hint a request carries, or None without a key. A retention needs a key."""
    if retention is not None and (isinstance(retention, bool) or not isinstance(retention, str)
                                  or retention not in _RETENTION_ALIASES):
        raise HintError(f"prompt_cache_retention {retention!r}: expected one of {', '.join(RETENTIONS)}")
    if key is None:
        if retention is not None:
            raise HintError(f"prompt_cache_retention {retention!r} without a prompt_cache_key")
        return None
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        shown = key if not isinstance(key, str) else key[:80]
        raise HintError(f"prompt_cache_key {shown!r}: expected a non-empty string of at most {MAX_KEY_CHARS} "
                        f"characters")
    return CacheHint(key, _RETENTION_ALIASES[retention] if retention is not None else IN_MEMORY)


def check_share(share: Any) -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise MarconiError(f"hinted share {share!r}: expected a number in [0, 1]")
    return float(share)


def check_horizon(horizon: Any) -> int | None:
    if horizon is None:
        return None
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        raise MarconiError(f"hint horizon {horizon!r}: expected a positive integer (requests)")
    return horizon


MAX_HORIZON = 4096
# Credits are granted only while at least this share of the latest returns without a credit
# (a key's next request) found less than the prefix its previous request left.
LOSS_NEEDED = 0.9
_RETURNS_SEEN = 64
_RETURNS_NEEDED = 8
_GAP_SAMPLES = 256
_KEYS_REMEMBERED = 1 << 16


class KeyHistory:
    """What the latest returns of keys (a key's next hinted request) say, from the request stream:
    - the horizon: twice the median number of releases between a key's requests
      (DEFAULT_HORIZON until 16 returns were seen), within [8, MAX_HORIZON];
    - whether the cache is losing conversations: among the latest returns of keys that held no
      credit, the share whose hit fell short of where the key's previous request ended (not losing
      until `_RETURNS_NEEDED` such returns were seen: a credit granted without evidence would
      squeeze the keys without one, whose losses would then keep credits coming)."""

    def __init__(self):
        self._last: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (release, end)
        self._gaps: deque[int] = deque(maxlen=_GAP_SAMPLES)
        self._lost: deque[bool] = deque(maxlen=_RETURNS_SEEN)
        self._horizon = DEFAULT_HORIZON

    def saw(self, key: str, release: int, hit: int, end: int, credited: bool) -> None:
        """Key `key` came at release `release`, reused `hit` tokens and left a sequence ending at
        `end`; `credited`: its previous sequence held a credit until now."""
        last = self._last.pop(key, None)
        self._last[key] = (release, end)
        if len(self._last) > _KEYS_REMEMBERED:
            self._last.popitem(last=False)
        if last is None:
            return
        previous_release, previous_end = last
        self._gaps.append(release - previous_release)
        if len(self._gaps) >= 16:
            median = sorted(self._gaps)[len(self._gaps) // 2]
            self._horizon = min(MAX_HORIZON, max(8, 2 * median))
        if not credited and previous_end > 0:
            self._lost.append(hit < previous_end)

    def horizon(self) -> int:
        return self._horizon

    def losing(self) -> bool:
        lost = self._lost
        return len(lost) >= _RETURNS_NEEDED and sum(lost) >= LOSS_NEEDED * len(lost)


class HintAdapter(Protocol):
    """A cache's nodes as the rule sees them: two eviction stamps (KV recency and the end state's
    recency; a cache with one stamp returns it twice) and whether the node is still cached."""

    def stamps(self, node) -> tuple[float, float]: ...

    def set_stamps(self, node, kv: float, state: float) -> None: ...

    def alive(self, node) -> bool: ...


@dataclass(slots=True)
class Credit:
    key: str
    node: Any
    plain: tuple[float, float]  # the stamps the node had when credited
    credited: tuple[float, float]  # the stamps it was given
    kv: int  # charge against the KV pool (tokens or bytes, as the cache counts)
    states: int  # charge against the state pool
    expires_at: int  # the release count at which it lapses
    serial: int
    retention: str = IN_MEMORY


@dataclass(slots=True)
class HintCounters:
    granted: int = 0
    kept_anyway: int = 0  # not needed: returning conversations find their prefix
    refused: int = 0  # no room left in the share
    replaced: int = 0  # the key's next turn took the credit
    expired: int = 0


class HintLedger:
    """The credits in force over one cache. `kv_capacity` / `state_capacity`: the pools the share
    is taken of (`state_capacity` None: one budget, the charge's `kv` counts everything)."""

    def __init__(self, adapter: HintAdapter, kv_capacity: int, state_capacity: int | None = None, *,
                 share: float = DEFAULT_HINTED_SHARE, horizon: int | None = None):
        self.adapter = adapter
        self.share = check_share(share)
        self.horizon = check_horizon(horizon)
        self.kv_budget = self.share * kv_capacity
        self.state_budget = None if state_capacity is None else self.share * state_capacity
        self.kv_charged = 0
        self.states_charged = 0
        self.releases = 0
        self._history = KeyHistory()
        self._clock_at: deque[float] = deque(maxlen=(self.horizon or MAX_HORIZON) * max(HORIZON_FACTOR.values()) + 1)
        self._credits: OrderedDict[str, Credit] = OrderedDict()  # oldest grant first
        self._day_nodes: dict[int, int] = {}  # id(node) -> `24h` credits on it (their credits hold the nodes)
        self._expiry: list[tuple[int, int, str]] = []  # (expires_at, serial, key), stale entries skipped
        self._serial = 0
        self.counters = HintCounters()

    def __len__(self) -> int:
        return len(self._credits)

    def credits(self) -> list[Credit]:
        return list(self._credits.values())

    def kept_for_day(self, node) -> bool:
        """A `24h` credit is in force on `node`: a host tier keeps it (`tier_rules.MarconiTiering`)."""
        return id(node) in self._day_nodes

    # -- the request stream --------------------------------------------------------------------
    def release(self, now: float, hint: CacheHint | None = None, node=None, kv: int = 0, states: int = 0, *,
                hit: int = 0, end: int = 0) -> None:
        """One request released into the cache at clock `now` (every request, hinted or not).
        With a hint: `hit` the prefix it reused, `node` where the sequence it left ends (None:
        nothing of it was cached), `end` that node's length in tokens, and (`kv`, `states`) what
        crediting it charges."""
        self.releases += 1
        self._clock_at.append(now)
        self._expire()
        if hint is None:
            return
        old = self._credits.pop(hint.key, None)
        self._history.saw(hint.key, self.releases, hit, end if node is not None else 0, old is not None)
        if old is not None:
            self._lapse(old)
            self.counters.replaced += 1
        if node is None:
            return
        if not self._history.losing():
            self.counters.kept_anyway += 1  # returning conversations find their prefix without credits
            return
        ticks = self.credit_ticks(hint.retention)
        if not self._room(kv, states):
            self.counters.refused += 1
            return
        plain = self.adapter.stamps(node)
        credited = (plain[0] + ticks, plain[1] + ticks)
        self.adapter.set_stamps(node, *credited)
        self._serial += 1
        credit = Credit(hint.key, node, plain, credited, kv, states,
                        self.releases + self.span(hint.retention), self._serial, hint.retention)
        self._credits[hint.key] = credit
        if hint.retention == DAY:
            self._day_nodes[id(node)] = self._day_nodes.get(id(node), 0) + 1
        heapq.heappush(self._expiry, (credit.expires_at, credit.serial, hint.key))
        self.kv_charged += kv
        self.states_charged += states
        self.counters.granted += 1

    def credit_ticks(self, retention: str) -> float:
        """How far the cache's clock moved over the last horizon's releases (all of them while
        fewer have been seen): the credit a grant now gets."""
        clocks = self._clock_at
        if not clocks:
            return 0.0
        span = self.span(retention)
        return clocks[-1] - clocks[-1 - span if len(clocks) > span else 0]

    def span(self, retention: str) -> int:
        """Releases a credit granted now lasts."""
        horizon = self.horizon if self.horizon is not None else self._history.horizon()
        return horizon * HORIZON_FACTOR[retention]

    def _room(self, kv: int, states: int) -> bool:
        return (self.kv_charged + kv <= self.kv_budget
                and (self.state_budget is None or self.states_charged + states <= self.state_budget))

    def _expire(self) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= self.releases:
            _, serial, key = heapq.heappop(expiry)
            credit = self._credits.get(key)
            if credit is not None and credit.serial == serial:
                del self._credits[key]
                self._lapse(credit)
                self.counters.expired += 1

    def _lapse(self, credit: Credit) -> None:
        """The credit ends: its charge is returned, and its node gets its plain stamps back unless
        something touched it since (each stamp on its own: a hit may refresh one and not the other)."""
        self.kv_charged -= credit.kv
        self.states_charged -= credit.states
        node, adapter = credit.node, self.adapter
        if credit.retention == DAY:
            held = self._day_nodes.pop(id(node)) - 1
            if held:
                self._day_nodes[id(node)] = held
        if not adapter.alive(node):
            return
        kv, state = adapter.stamps(node)
        restored = (credit.plain[0] if kv == credit.credited[0] else kv,
                    credit.plain[1] if state == credit.credited[1] else state)
        if restored != (kv, state):
            adapter.set_stamps(node, *restored)

    def check(self) -> None:
        """Raise AssertionError if the charges disagree with the credits or exceed the share."""
        assert self.kv_charged == sum(c.kv for c in self._credits.values())
        assert self.states_charged == sum(c.states for c in self._credits.values())
        assert self.kv_charged <= self.kv_budget
        assert self.state_budget is None or self.states_charged <= self.state_budget
        assert all(c.expires_at > self.releases for c in self._credits.values())
        day = {}
        for c in self._credits.values():
            if c.retention == DAY:
                day[id(c.node)] = day.get(id(c.node), 0) + 1
        assert day == self._day_nodes
