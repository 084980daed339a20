"""Client cache hints in the simulator: the rule of `policy/rules/cache_hints.py` applied to the
caches the simulator runs, and workloads whose requests carry hints.

`HintedPolicy` wraps a policy whose `cache` is the policy core's hybrid tree (`TreeCore`:
SGLang+, Marconi, coverage; with a host tier, `TieredPrefixCache`) or the model of the served
cache (`ServedCache`). A cache with a host tier is handed the ledger as its `client_hints`, so
a node a `24h` credit is in force on is kept on the host (`tier_rules`). After the wrapped
policy serves a request, the ledger sees the release; a hinted request's credit goes to the
deepest node of its sequence that holds a state (the one its next turn hits; with no SSM layers,
the deepest cached node), charged the tokens up to that node's end plus its state. A request
without a hint only advances the ledger's clock record, so an unhinted workload replays exactly as
through the wrapped policy.

`with_session_keys(workload)`: each request keyed by its session, as a client naming its
conversation does; `last_turn=False` leaves each session's last request unhinted (a client that
knows the conversation ends, as an agent loop does).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.cache_hints import (
    DEFAULT_HINTED_SHARE, HintLedger, IN_MEMORY, parse_hint,
)
from sglang_marconi.sim.policy_api import Outcome
from sglang_marconi.sim.workload import Request, Workload


class TreeCoreStamps:
    """The policy core's tree: one recency stamp per node (`last_access`), the candidate index
    refreshed when it moves."""

    def __init__(self, cache):
        self.cache = cache

    @staticmethod
    def stamps(node) -> tuple[float, float]:
        return node.last_access, node.last_access

    def set_stamps(self, node, kv: float, state: float) -> None:
        node.last_access = kv
        if node.slot >= 0 or getattr(node, "hslot", -1) >= 0:  # a device or a host candidate
            self.cache._refresh(node)

    @staticmethod
    def alive(node) -> bool:
        return node.parent is not None


    def end_node(self, seq):
        """The deepest node along `seq` whose prefix a next turn would reuse, and its charge."""
        cache = self.cache
        reusable = cache.attention_only
        end = None
        for node in cache.tree.walk(seq).path:
            if node.has_state or reusable:
                end = node
        if end is None:
            return None, 0, 0
        if cache.state_slots is None:
            return end, cache.bytes_of(end.end, int(end.has_state)), 0
        return end, end.end * cache.kv_bytes_per_token, int(end.has_state)


class ServedCacheStamps:
    """The model of the served cache: KV recency (`last_access`) and the state's (`state_time`);
    its victim indexes are built from them at each eviction."""

    def __init__(self, cache):
        self.cache = cache

    @staticmethod
    def stamps(node) -> tuple[float, float]:
        state_time = getattr(node, "state_time", None)
        return node.last_access, (state_time if state_time is not None else node.last_access)

    @staticmethod
    def set_stamps(node, kv: float, state: float) -> None:
        node.last_access = kv
        if getattr(node, "state_time", None) is not None:
            node.state_time = state

    @staticmethod
    def alive(node) -> bool:
        return node.parent is not None


    def end_node(self, seq):
        end = None
        for node in self.cache._whole_edges(seq):
            if _holds_state(node):
                end = node
        return (None, 0, 0) if end is None else (end, end.end, 1)


def ledger_for(cache, *, share: float = DEFAULT_HINTED_SHARE, horizon: int | None = None):
    """The hint ledger over `cache` (a `TreeCore` configuration or a `ServedCache`), with its adapter;
    `horizon` None: learned from the stream."""
    if hasattr(cache, "pools"):
        adapter = ServedCacheStamps(cache)
        return HintLedger(adapter, cache.pools.kv_tokens, cache.pools.mamba_slots, share=share, horizon=horizon)
    if not hasattr(cache, "tree"):
        raise MarconiError(f"cache hints apply to the hybrid tree and the served cache, not {type(cache).__name__}")
    adapter = TreeCoreStamps(cache)
    return HintLedger(adapter, cache.capacity_bytes, cache.state_slots, share=share, horizon=horizon)


def _holds_state(node) -> bool:
    stated = getattr(node, "has_state", None)
    return node.state if stated is None else stated


def cache_clock(cache) -> float:
    """The cache's recency clock (SGLang's counter in the served-cache model)."""
    clock = getattr(cache, "clock", None)
    # a model that keeps SGLang's counter to itself: its last match stamped the root with it
    return cache.root.last_access if clock is None else clock


class HintedPolicy:
    """`policy` with the hints its requests carry applied to its cache."""

    def __init__(self, policy, *, share: float = DEFAULT_HINTED_SHARE, horizon: int | None = None):
        self.policy = policy
        self.name = f"{policy.name}+hints"
        self.ledger = ledger_for(policy.cache, share=share, horizon=horizon)
        if hasattr(policy.cache, "client_hints"):  # a host tier keeps what a `24h` credit is in force on
            policy.cache.client_hints = self.ledger
        if hasattr(policy, "tier_summary"):  # a host tier's figures, as the replay reports them
            self.tier_summary = policy.tier_summary

    @property
    def cache(self):
        return self.policy.cache

    def serve(self, request: Request) -> Outcome:
        outcome = self.policy.serve(request)
        hint = parse_hint(request.prompt_cache_key, request.prompt_cache_retention)
        cache = self.policy.cache
        if hint is None:
            self.ledger.release(cache_clock(cache))
            return outcome
        seq = request.full_sequence()
        if hasattr(cache, "pools") and request.output_len:
            seq = seq[:-1]  # the served cache keeps input + output[:-1]
        node, kv, states = self.ledger.adapter.end_node(seq)
        self.ledger.release(cache_clock(cache), hint, node, kv, states, hit=outcome.hit_tokens,
                            end=0 if node is None else node.end)
        return outcome

    def stats(self):
        return self.policy.stats()

    def close(self) -> None:
        if hasattr(self.policy, "close"):
            self.policy.close()


class SessionKeyed(Workload):
    """`workload` with each request's `prompt_cache_key` set to its session."""

    def __init__(self, workload: Workload, retention: str = IN_MEMORY, last_turn: bool = True):
        parse_hint("session", retention)
        self.base, self.retention, self.last_turn = workload, retention, last_turn
        self.name = f"{workload.name}+keys({retention}{'' if last_turn else ',not last'})"
        self._last: set[int] | None = None
        if not last_turn:
            sessions = workload.session_ids()
            final: dict[str, int] = {s: i for i, s in enumerate(sessions)}
            self._last = set(final.values())

    def __len__(self) -> int:
        return len(self.base)

    def session_ids(self) -> list[str]:
        return self.base.session_ids()

    def request_lengths(self):
        return self.base.request_lengths()

    def __iter__(self) -> Iterator[Request]:
        for i, r in enumerate(self.base):
            if self._last is not None and i in self._last:
                yield r
            else:
                yield dataclasses.replace(r, prompt_cache_key=r.session_id, prompt_cache_retention=self.retention)


def with_session_keys(workload: Workload, retention: str = IN_MEMORY, *, last_turn: bool = True) -> Workload:
    return SessionKeyed(workload, retention, last_turn)


def with_trace_hints(policy, *, share: float = DEFAULT_HINTED_SHARE):
    """`policy` applying the hints its requests carry, where the rule has a model of its cache (the
    hybrid tree, with or without a host tier, the served cache); else `policy` itself. Keeps the
    policy's name: a workload without hints replays exactly as through `policy`."""
    cache = getattr(policy, "cache", None)
    if type(cache).__name__ not in ("HybridPrefixCache", "TieredPrefixCache", "ServedCache"):
        return policy
    hinted = HintedPolicy(policy, share=share)
    hinted.name = policy.name
    return hinted
