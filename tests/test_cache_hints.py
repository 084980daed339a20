"""The cache-hint rule (`policy/rules/cache_hints.py`) and its use in the simulator (`sim/hinted.py`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sglang_marconi.policy.rules import cache_hints
from sglang_marconi.policy.rules.cache_hints import CacheHint, HintError, HintLedger, parse_hint
from sglang_marconi.policy.rules.eviction import LruLeafEviction
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.tree.served_cache import ServedPools
from sglang_marconi.sim.baselines.hybrid_radix import sglang_plus
from sglang_marconi.sim.baselines.served import ServedPolicy
from sglang_marconi.sim.hinted import HintedPolicy, TreeCoreStamps, with_session_keys
from sglang_marconi.sim.synthetic import generate
from sglang_marconi.sim.workload import ListWorkload, Request
from toy_profile import ToyProfile

PROFILE = ToyProfile()


# -- parsing ---------------------------------------------------------------------------------------
def test_parse_hint_accepts_openai_values():
    assert parse_hint(None) is None
    assert parse_hint("conv-1") == CacheHint("conv-1", "in-memory")
    assert parse_hint("conv-1", "in-memory") == CacheHint("conv-1", "in-memory")
    assert parse_hint("conv-1", "in_memory") == CacheHint("conv-1", "in-memory")
    assert parse_hint("conv-1", "24h") == CacheHint("conv-1", "24h")


@pytest.mark.parametrize("key, retention, named", [
    ("k", "48h", "'48h'"), ("k", 24, "24"), ("k", True, "True"), ("", None, "''"), (7, None, "7"),
    ("x" * 2000, None, "'xxxx"), (None, "24h", "'24h'"),
])
def test_parse_hint_rejects_bad_values_in_one_line_naming_them(key, retention, named):
    with pytest.raises(HintError) as err:
        parse_hint(key, retention)
    message = str(err.value)
    assert "\n" not in message and named in message and "prompt_cache_" in message


# -- the ledger over a stand-in cache ------------------------------------------------------------------
class Stamps:
    """Nodes are names; each has two stamps and may be evicted."""

    def __init__(self):
        self.kv, self.state, self.gone = {}, {}, set()

    def stamps(self, node):
        return self.kv[node], self.state[node]

    def set_stamps(self, node, kv, state):
        self.kv[node], self.state[node] = kv, state

    def alive(self, node):
        return node not in self.gone


def _ledger(share=0.5, horizon=4, kv=100, states=10, open_gate=True):
    """A ledger over stand-in nodes; `open_gate`: after returns that all lost their prefix (at clock
    0, charging nothing), so that it grants."""
    adapter = Stamps()
    ledger = HintLedger(adapter, kv, states, share=share, horizon=horizon)
    if open_gate:
        for turn in range(2):
            for i in range(cache_hints._RETURNS_NEEDED):
                _release(adapter, ledger, 0, f"gate-{i}", f"gate-{i}-{turn}", kv=0, states=0, end=1)
        for credit in ledger.credits():  # what the gate's last return got: taken back
            _release(adapter, ledger, 0, credit.key)
        assert ledger._history.losing() and len(ledger) == 0
    return adapter, ledger


def _release(adapter, ledger, clock, key=None, node=None, kv=10, states=1, retention="in-memory", hit=0, end=None):
    if node is not None:
        adapter.kv.setdefault(node, float(clock))
        adapter.state.setdefault(node, float(clock))
    hint = None if key is None else CacheHint(key, retention)
    ledger.release(float(clock), hint, node, kv, states, hit=hit, end=kv if end is None else end)


def test_a_credit_makes_the_end_younger_by_the_clock_of_a_horizon_then_lapses():
    adapter, ledger = _ledger(horizon=4)
    for clock in range(10):  # unhinted releases, 10 ticks apart
        _release(adapter, ledger, 10 * clock)
    _release(adapter, ledger, 100, "k", "end")
    # the clock moved 40 over the last 4 releases
    assert adapter.stamps("end") == (140.0, 140.0)
    assert ledger.kv_charged == 10 and ledger.states_charged == 1
    for clock in range(11, 14):
        _release(adapter, ledger, 10 * clock)
        assert adapter.stamps("end") == (140.0, 140.0)
    _release(adapter, ledger, 140)  # the fourth release after the grant: it ages out
    assert adapter.stamps("end") == (100.0, 100.0) and len(ledger) == 0
    assert ledger.kv_charged == 0 and ledger.states_charged == 0


def test_24h_lasts_four_horizons():
    adapter, ledger = _ledger(horizon=2)
    for clock in range(10):
        _release(adapter, ledger, clock)
    _release(adapter, ledger, 10, "k", "end", retention="24h")
    assert adapter.stamps("end") == (18.0, 18.0)  # 8 releases of one tick each
    for clock in range(11, 18):
        _release(adapter, ledger, clock)
        assert len(ledger) == 1
    _release(adapter, ledger, 18)
    assert len(ledger) == 0 and adapter.stamps("end") == (10.0, 10.0)


def test_a_lapse_keeps_a_stamp_refreshed_since_and_skips_an_evicted_node():
    adapter, ledger = _ledger(horizon=2)
    for clock in range(3):
        _release(adapter, ledger, clock)
    _release(adapter, ledger, 3, "a", "A")
    _release(adapter, ledger, 3, "b", "B")
    adapter.kv["A"] = 4.0  # a hit refreshed A's KV stamp (not its state's)
    adapter.gone.add("B")
    credited_b = adapter.stamps("B")
    _release(adapter, ledger, 5)
    _release(adapter, ledger, 6)
    assert len(ledger) == 0
    assert adapter.stamps("A") == (4.0, 3.0)
    assert adapter.stamps("B") == credited_b  # evicted: nothing to restore


def test_a_key_holds_one_credit_its_next_request_moves_it():
    adapter, ledger = _ledger(horizon=100)
    for clock in range(3):
        _release(adapter, ledger, clock)
    _release(adapter, ledger, 3, "k", "turn1", kv=20)
    _release(adapter, ledger, 4, "k", "turn2", kv=30, hit=20)
    assert [c.node for c in ledger.credits()] == ["turn2"]
    assert adapter.stamps("turn1") == (3.0, 3.0)  # its credit went back
    assert ledger.kv_charged == 30 and ledger.counters.replaced == 1 + 1  # (one by the gate's opening)


def test_an_adversarial_client_hinting_everything_holds_at_most_the_share():
    """Every request carries a new key: the charges never pass the share, later keys are refused
    (nobody's credit is taken away), and as credits age out new ones are granted."""
    adapter, ledger = _ledger(share=0.3, horizon=50, kv=1000, states=40)
    rng = np.random.default_rng(0)
    granted_late = 0
    for i in range(400):
        before = ledger.counters.granted
        _release(adapter, ledger, i, f"key-{i}", f"n{i}", kv=int(rng.integers(1, 120)),
                 states=int(rng.integers(0, 2)))
        ledger.check()
        assert ledger.kv_charged <= 300 and ledger.states_charged <= 12
        if i > 100:
            granted_late += ledger.counters.granted - before
    assert ledger.counters.refused > 0 and granted_late > 0


def test_a_charge_larger_than_the_whole_share_is_refused():
    adapter, ledger = _ledger(share=0.1, kv=100)
    _release(adapter, ledger, 0, "big", "B", kv=11)
    assert len(ledger) == 0 and ledger.counters.refused == 1 and adapter.stamps("B") == (0.0, 0.0)


def test_when_the_share_is_full_the_earlier_release_keeps_its_credit_whatever_the_key():
    """Two grants that both fit only alone: the one released first wins, however the keys sort or
    hash; a stream replayed with other key names makes the same decisions."""
    def run(first, second):
        adapter, ledger = _ledger(share=0.5, kv=100)
        _release(adapter, ledger, 0)
        _release(adapter, ledger, 1, first, "X", kv=40)
        _release(adapter, ledger, 2, second, "Y", kv=40)
        return [c.node for c in ledger.credits()], adapter.stamps("X"), adapter.stamps("Y")

    assert run("a", "b") == run("b", "a") == run("zz", "a") == (["X"], (2.0, 2.0), (2.0, 2.0))


def test_credits_only_while_returning_conversations_lose_their_prefix():
    """Returns of keys that held no credit decide: no credit before 8 of them were seen; credits once
    they keep losing their prefix; none again once they find it."""
    adapter, ledger = _ledger(horizon=1000, kv=100, states=100, open_gate=False)  # room for 5 credits of 10
    for i in range(20):
        _release(adapter, ledger, i, f"k{i}", f"first{i}", kv=10)
    assert ledger.counters.granted == 0 and ledger.counters.kept_anyway == 20  # no evidence yet
    for i in range(20):  # back, each having lost its prefix
        _release(adapter, ledger, 20 + i, f"k{i}", f"second{i}", kv=10, hit=0)
    # from the 8th return on, credits, until the share is full
    assert [c.key for c in ledger.credits()] == [f"k{i}" for i in range(7, 12)]
    assert ledger.counters.refused == 8
    for i in range(20):  # new keys, back finding their whole previous sequence
        _release(adapter, ledger, 40 + i, f"j{i % 10}", f"j{i}", kv=10, hit=10 if i >= 10 else 0)
    assert not ledger._history.losing()
    granted = ledger.counters.granted
    for i in range(7, 12):  # the credited keys back: their credits go, no new one comes
        _release(adapter, ledger, 60 + i, f"k{i}", f"third{i}", kv=10, hit=0)
    assert len(ledger) == 0 and ledger.counters.granted == granted


def test_the_learned_horizon_is_twice_the_median_return_gap():
    adapter, ledger = _ledger(horizon=None, kv=10**6, states=10**6)
    for i in range(200):  # 5 keys in turn: each returns every 5 releases
        _release(adapter, ledger, i, f"k{i % 5}", f"n{i}", kv=1, hit=0)
    assert ledger.span("in-memory") == 10 and ledger.span("24h") == 40


# -- the simulator's caches ------------------------------------------------------------------------------
def _conversations(sessions=12, turns=6, seed=3, keyed=True, vocab=50_000):
    rng = np.random.default_rng(seed)
    history = {s: rng.integers(0, vocab, 40) for s in range(sessions)}
    requests = []
    for turn in range(turns):
        for s in range(sessions):
            inp = history[s]
            out = rng.integers(0, vocab, 10)
            requests.append(Request(f"s{s}", turn, float(len(requests)), inp, out,
                                    prompt_cache_key=f"s{s}" if keyed else None))
            history[s] = np.concatenate((inp, out, rng.integers(0, vocab, 20)))
    return ListWorkload("conversations", requests)


def _hits(policy, workload):
    return [policy.serve(r).hit_tokens for r in workload]


@pytest.mark.parametrize("make", [
    lambda: sglang_plus(PROFILE, 1500),
    lambda: ServedPolicy("sglang+", PROFILE, ServedPools(1200, 12), "lru"),
    lambda: ServedPolicy("marconi", PROFILE, ServedPools(1200, 12), 1.0),
])
def test_without_hints_the_wrapped_cache_serves_exactly_as_before(make):
    workload = _conversations(keyed=False)
    plain, hinted = make(), HintedPolicy(make())
    assert _hits(hinted, workload) == _hits(plain, workload)
    assert plain.stats() == hinted.stats() and hinted.ledger.counters.granted == 0


def test_keyed_conversations_under_thrashing_keep_their_prefix():
    """12 conversations in turn, a cache holding a few of them: LRU loses every one; keyed,
    a stable set of them keeps its prefix."""
    unkeyed, keyed = _conversations(keyed=False), _conversations(keyed=True)
    plain = sum(_hits(sglang_plus(PROFILE, 600), unkeyed))
    policy = HintedPolicy(sglang_plus(PROFILE, 600))
    hinted = sum(_hits(policy, keyed))
    assert plain == 0 and hinted > 0 and policy.ledger.counters.granted > 0
    policy.cache.check_invariants()


def test_credits_on_the_tree_never_hold_more_than_the_share():
    """Every request keyed (40 keys in turn, none ever continuing its sequence): the bytes of the
    credited sequences still cached stay within the share of the capacity."""
    cache_bytes = 3000
    policy = HintedPolicy(sglang_plus(PROFILE, cache_bytes), share=0.4)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 1000, 30)
    for i in range(300):
        inp = np.concatenate((prompt, rng.integers(0, 50_000, int(rng.integers(5, 200)))))
        policy.serve(Request(f"r{i}", 0, float(i), inp, rng.integers(0, 50_000, 5),
                             prompt_cache_key=f"adv-{i % 40}"))
        ledger = policy.ledger
        ledger.check()
        held = sum(c.kv for c in ledger.credits() if c.node.parent is not None)
        assert held <= 0.4 * cache_bytes
    assert policy.ledger.counters.granted > 0 and policy.ledger.counters.refused > 0


def test_tree_stamps_reach_the_candidate_index():
    cache = HybridPrefixCache(PROFILE, 500, LruLeafEviction())
    cache.serve(np.arange(20), np.arange(100, 105))
    adapter = TreeCoreStamps(cache)
    node, kv, states = adapter.end_node(np.concatenate((np.arange(20), np.arange(100, 105))))
    assert node.end == 25 and kv == 25 + 10 and states == 0
    adapter.set_stamps(node, 99.0, 99.0)
    assert cache.index.last_access[node.slot] == 99.0
    cache.check_invariants()


def test_session_keys_on_a_synthetic_workload():
    workload = generate("sharegpt", sessions=4)
    keyed = list(with_session_keys(workload, "24h"))
    assert [r.prompt_cache_key for r in keyed] == workload.session_ids()
    assert {r.prompt_cache_retention for r in keyed} == {"24h"}
    last = list(with_session_keys(workload, last_turn=False))
    final = {s: i for i, s in enumerate(workload.session_ids())}
    assert [r.prompt_cache_key is None for r in last] == [i in final.values() for i in range(len(last))]


def test_share_and_horizon_are_checked():
    with pytest.raises(cache_hints.MarconiError, match="hinted share 1.5"):
        HintLedger(Stamps(), 10, share=1.5)
    with pytest.raises(cache_hints.MarconiError, match="hint horizon 0"):
        HintLedger(Stamps(), 10, horizon=0)


# -- traces ------------------------------------------------------------------------------------------
def test_trace_hints_are_read_checked_and_saved(tmp_path):
    import json

    from sglang_marconi.policy.errors import TraceError
    from sglang_marconi.sim.traces import load_trace, save_trace

    authors = tmp_path / "authors.jsonl"
    lines = [
        {"session_id": "a", "turn_id": 0, "ts": 0.0, "input_tokens": [1, 2, 3], "output_tokens": 2,
         "prompt_cache_key": "conv-a", "prompt_cache_retention": "24h"},
        {"session_id": "b", "turn_id": 0, "ts": 1.0, "input_tokens": [4, 5], "output_tokens": [9]},
        {"session_id": "a", "turn_id": 1, "ts": 2.0, "input_tokens": [1, 2, 3, 7], "output_tokens": 1,
         "prompt_cache_key": "conv-a"},
    ]
    authors.write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = [(r.prompt_cache_key, r.prompt_cache_retention) for r in load_trace(authors)]
    assert got == [("conv-a", "24h"), (None, None), ("conv-a", "in-memory")]
    again = load_trace(save_trace(load_trace(authors), tmp_path / "saved.jsonl"))
    assert [(r.prompt_cache_key, r.prompt_cache_retention) for r in again] == got

    mooncake = tmp_path / "mooncake.jsonl"
    mooncake.write_text(
        json.dumps({"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 1],
                    "prompt_cache_key": "s1"}) + "\n"
        + json.dumps({"timestamp": 1, "input_length": 10, "output_length": 3, "hash_ids": [2]}) + "\n")
    assert [r.prompt_cache_key for r in load_trace(mooncake)] == [None, "s1"]  # arrival order

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**lines[0], "prompt_cache_retention": "forever"}) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:1: prompt_cache_retention 'forever'"):
        load_trace(bad)


def test_the_simulator_cli_applies_a_trace_s_hints(tmp_path):
    from sglang_marconi.sim.baselines.no_cache import NoCache
    from sglang_marconi.sim.cli import build_parser, run
    from sglang_marconi.sim.hinted import with_trace_hints
    from sglang_marconi.sim.traces import save_trace

    assert isinstance(with_trace_hints(NoCache()), NoCache)  # no model of that cache: left as it is
    assert with_trace_hints(sglang_plus(PROFILE, 600)).name == "sglang+"

    def hit_rate(workload, name):
        path = save_trace(workload, tmp_path / f"{name}.jsonl")
        args = build_parser().parse_args(["--trace", str(path), "--model", "paper-7b", "--capacity", "0.4GB",
                                          "--policies", "sglang+"])
        (result,) = run(args)
        return result.token_hit_rate

    keyed = _conversations(sessions=12, turns=6, keyed=True, vocab=32_000)
    unkeyed = _conversations(sessions=12, turns=6, keyed=False, vocab=32_000)
    plain = hit_rate(unkeyed, "unkeyed")
    assert hit_rate(keyed, "keyed") > plain


def test_server_info_reports_the_credits_granted_refused_lapsed_moved_and_charged():
    from types import SimpleNamespace

    from sglang_marconi.serving.metrics import hint_figures

    adapter, ledger = _ledger(horizon=4, kv=40, states=10)  # the share: 20 KV, 5 states
    before = dataclasses.asdict(ledger.counters)  # (what opening the gate counted)
    _release(adapter, ledger, 1, "a", "a-end", kv=15, states=1)  # granted
    _release(adapter, ledger, 2, "b", "b-end", kv=15, states=1)  # refused: 30 > 20
    _release(adapter, ledger, 3, "a", "a-next", kv=5, states=1)  # moved to a's next turn, granted
    _release(adapter, ledger, 4, "c", "c-end", kv=5, states=1)  # granted
    for clock in (5, 6, 7):  # a's second credit lapses (four releases after its grant); c's is in force
        _release(adapter, ledger, clock)
    cache = SimpleNamespace(marconi=SimpleNamespace(hints=SimpleNamespace(ledger=ledger, broken=None)))
    assert hint_figures(cache) == {
        "marconi_hint_credits_granted": before["granted"] + 3, "marconi_hint_credits_refused": before["refused"] + 1,
        "marconi_hint_credits_lapsed": before["expired"] + 1, "marconi_hint_credits_moved": before["replaced"] + 1,
        "marconi_hint_credits_in_force": 1,
        "marconi_hinted_kv_tokens": 5, "marconi_hinted_states": 1, "marconi_hints_stopped": None}
    assert hint_figures(SimpleNamespace(marconi=SimpleNamespace(hints=None))) == {}  # --marconi-hinted-share 0


# -- retention 24h on a host tier -------------------------------------------------------------------
def test_a_24h_credit_marks_its_node_kept_for_the_host_tier_until_it_lapses_or_moves():
    adapter, ledger = _ledger(horizon=2)
    _release(adapter, ledger, 1, "day", "day-end", retention="24h")
    _release(adapter, ledger, 2, "memory", "memory-end")
    assert ledger.kept_for_day("day-end") and not ledger.kept_for_day("memory-end")
    ledger.check()
    _release(adapter, ledger, 3, "day", "day-next")  # the key's next turn, in-memory: the credit moves
    assert not ledger.kept_for_day("day-end") and not ledger.kept_for_day("day-next")
    _release(adapter, ledger, 4, "day", "day-last", retention="24h")
    for clock in range(5, 12):  # 4 horizons of 2 releases: still kept at the 7th release after it
        _release(adapter, ledger, clock)
        assert ledger.kept_for_day("day-last")
    _release(adapter, ledger, 12)
    assert not ledger.kept_for_day("day-last") and len(ledger) == 0
    ledger.check()


@pytest.mark.parametrize("frees_kv", [True, False], ids=["device-leaf", "state-alone"])
def test_marconi_tiering_demotes_a_node_kept_for_a_client_whatever_it_displaces(frees_kv):
    from sglang_marconi.policy.rules.tier_rules import Demotion, EvictionFacts, MarconiTiering, UpstreamWriteBack

    facts = dict(frees_kv=frees_kv, kv_on_host=False, state_on_device=True, state_on_host=False,
                 host_descendants=False)
    rules = MarconiTiering()
    plain, kept = rules.demotion(EvictionFacts(**facts)), rules.demotion(EvictionFacts(**facts, kept_for_client=True))
    assert plain.ranked and plain.state  # ranked against the host's candidates: may be dropped
    assert kept == Demotion(kv=plain.kv, state=True, ranked=False)  # the host makes room for it
    if frees_kv:  # upstream's write-back backs up every device leaf, kept or not
        upstream = UpstreamWriteBack()
        assert upstream.demotion(EvictionFacts(**facts)) == upstream.demotion(
            EvictionFacts(**facts, kept_for_client=True)) == Demotion(kv=True, state=True)


# -- a fault in the served hint step -------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [1, 2])
def test_a_fault_in_the_served_hint_step_stops_hints_alone_and_stops_a_group(group_size, monkeypatch):
    """A rank alone stops hints and serves on; a rank of a TP / PP group raises, since the stamps
    moved before the fault could order its evictions differently from the other ranks'."""
    from types import SimpleNamespace

    from sglang_marconi.serving import cache_hints as served
    from sglang_marconi.serving.faults import MarconiFaults, MarconiGroupFault

    cache = SimpleNamespace(marconi=SimpleNamespace(faults=MarconiFaults(group_size=group_size)))
    hints = served.ServedHints(cache, (1000, 10))

    def fail(*args, **kwargs):
        raise RuntimeError("ledger fault midway through a release")

    monkeypatch.setattr(hints.ledger, "release", fail)
    monkeypatch.setattr(served, "sglang_clock", lambda: 1.0)
    req = SimpleNamespace(kv_hints=None)
    if group_size > 1:
        with pytest.raises(MarconiGroupFault, match="cache hints"):
            hints.on_release(cache, req)
    else:
        hints.on_release(cache, req)
    assert hints.broken == "RuntimeError: ledger fault midway through a release"
    assert cache.marconi.faults.fallen_back is None  # a rank alone keeps Marconi's eviction
    hints.on_release(cache, req)  # stopped: no second fault, no second raise
