"""Marconi's tier rule with the continuation signal (`tier_rules.MarconiTiering(depth=...)`,
`DepthOrder`) in the simulator's two-tier cache, and the `24h` client hint on its host tier."""

import numpy as np
import pytest
from toy_profile import ToyProfile

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules import tier_rules
from sglang_marconi.policy.rules.continuation import SETTLE_EVERY, ContinuationRecord
from sglang_marconi.policy.rules.eviction import FlopAwareEviction
from sglang_marconi.policy.rules.eviction.depth import DepthEviction, deepest_oldest, fitted_exponent
from sglang_marconi.policy.rules.tier_rules import DepthOrder, MarconiTiering
from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.tree.host_candidates import HostCandidateIndex, ranked_below_across
from sglang_marconi.policy.tree.tiered_cache import TieredPrefixCache


class _Item:
    def __init__(self, i):
        self.id = i


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("exponent", [0.0, 1.0, 4.0])
def test_the_hosts_depth_order_is_the_device_depth_rule(seed, exponent):
    """The host's first victim under `DepthOrder(B)` is the device depth rule's
    (`deepest_oldest`) over the same candidates, forced ties included (few distinct recencies and
    depths): one rule on both tiers."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    recency = rng.integers(0, int(rng.choice([3, 50])), n).astype(float)  # exact ties, or a spread of ages
    depths = rng.integers(0, 6, n).astype(float)
    ids = rng.permutation(1000)[:n]
    host, device = HostCandidateIndex(tie_key=CandidateIndex.node_id), CandidateIndex(tie_key=CandidateIndex.node_id)
    items = [_Item(int(i)) for i in ids]
    for item, t, d in zip(items, recency, depths):
        host.add(item, t, d, freed_bytes=1, units=1)
        device.add(item, t, 0.0)
    assert host.lowest(DepthOrder(exponent)) is deepest_oldest(device, depths, exponent)


@pytest.mark.parametrize("seed", range(6))
def test_ranked_below_by_depth_compares_keep_scores_with_the_newest_of_all(seed):
    """A ranked demotion under `DepthOrder` displaces exactly the candidates whose keep score is
    strictly below the incoming node's, ages counted from the newest of the candidates of both
    pools and the incoming node."""
    rng = np.random.default_rng(seed)
    order = DepthOrder(float(rng.choice([0.0, 1.0, 3.0])))
    indexes, rows = [], []
    for pool in range(2):
        index = HostCandidateIndex()
        for k in range(int(rng.integers(0, 12))):
            t, d = float(rng.integers(0, 30)), float(rng.integers(0, 4))
            index.add(_Item(100 * pool + k), t, d, freed_bytes=1, units=1)
            rows.append((pool, t, d))
        indexes.append(index)
    t_in, d_in = float(rng.integers(0, 40)), float(rng.integers(0, 4))
    newest = max([t for _, t, _ in rows] + [t_in])

    def keep(t, d):
        return order.exponent * np.log1p(d) - np.log(newest - t + 1.0)

    expected = [[keep(t, d) < keep(t_in, d_in) for p, t, d in rows if p == pool] for pool in range(2)]
    masks = ranked_below_across(indexes, order, t_in, d_in)
    assert [list(m) for m in masks] == expected


def test_bad_depth_settings_are_refused_in_one_line():
    for bad in ("deep", -1.0, 99.0, True):
        with pytest.raises(MarconiError) as err:
            MarconiTiering(depth=bad)
        assert "\n" not in str(err.value) and "depth" in str(err.value)


def test_auto_fits_b_from_the_records_settled_rates():
    """`depth="auto"`: B is `fitted_exponent` of the record's settled rates (0 without a record);
    fixed B is B whatever the record."""
    record = ContinuationRecord(block_tokens=4)
    rules = MarconiTiering(depth="auto")
    assert rules.host_order(None, None) == DepthOrder(0.0)
    assert rules.host_order(None, record) == DepthOrder(0.0)  # too few sequences: plain recency
    # first turns continued one time in five, and then conversations eight turns deep
    rng = np.random.default_rng(0)
    for s in range(6 * SETTLE_EVERY):
        seq = [int(x) for x in rng.integers(1, 10**6, 8)]
        record.finish(seq)
        if s % 5 == 0:
            for _ in range(8):
                seq = seq + [int(x) for x in rng.integers(1, 10**6, 8)]
                record.finish(seq)
    b = fitted_exponent(*record.settled_rates)
    assert b > 0
    assert rules.host_order(None, record) == DepthOrder(b)
    assert MarconiTiering(depth=2.0).host_order(None, record) == DepthOrder(2.0)
    assert MarconiTiering(0.5).host_order(FlopAwareEviction(0.0), record) == 0.5  # no depth: its alpha


# -- the two-tier cache ---------------------------------------------------------------------------
FIRST = list(range(1, 13))
SECOND_NEW = list(range(20, 28))


def _continued_conversation(rules, *, mutate=None):
    """A two-turn conversation (its second turn: depth 1), then first turns of others until the host
    must evict: the host tokens the conversation's third turn loads back."""
    cache = TieredPrefixCache(ToyProfile(), 80, 100, rules, FlopAwareEviction(0.0),
                              continuation=ContinuationRecord(block_tokens=4), verify=True)
    if mutate:
        mutate(cache)
    cache.serve(FIRST, [501, 502])
    second = FIRST + [501, 502] + SECOND_NEW
    cache.serve(second, [601, 602])
    for k in range(6):
        cache.serve([1000 * (k + 1) + i for i in range(24)], [9, 9])
        cache.check_invariants()
    assert cache.counters.bytes_evicted_host > 0, "the host never had to choose"
    lookup, _ = cache.serve(second + [601, 602, 70, 71], [1])
    return lookup.host_hit_tokens, cache


def test_the_host_keeps_a_continued_conversation_by_depth_and_recency_does_not():
    """Host pressure with a conversation's second turn (depth 1) the oldest on the host: ranked by
    depth (B = 4) it outlives the newer first turns of others and its third turn loads it back; by
    recency (B = 0, or the FLOP rule at alpha 0) it is evicted first."""
    kept, cache = _continued_conversation(MarconiTiering(depth=4.0))
    assert kept == len(FIRST) + 2 + len(SECOND_NEW) + 2
    assert cache.continuation.depth_at(kept + 3, 1) == 2  # the third turn extended a depth-1 sequence
    assert _continued_conversation(MarconiTiering(depth=0.0))[0] == 0
    assert _continued_conversation(MarconiTiering(0.0))[0] == 0


@pytest.mark.parametrize("mutant", ["keep ignores depth", "record never fed"])
def test_mutants_of_the_depth_order_lose_the_conversation(mutant, monkeypatch):
    if mutant == "keep ignores depth":
        monkeypatch.setattr(tier_rules.DepthOrder, "keep",
                            lambda self, recency, depths, newest: -np.log(newest - np.asarray(recency, float) + 1.0))
        mutate = None
    else:
        def mutate(cache):
            monkeypatch.setattr(cache, "_observe", lambda seq, n: None)
    assert _continued_conversation(MarconiTiering(depth=4.0), mutate=mutate)[0] == 0


@pytest.mark.parametrize("device_depth", [False, True])
def test_the_record_is_fed_once_per_request(device_depth):
    """One record per stream: a device `DepthEviction` feeding its own record shares it with the
    host's order; either way each request is recorded once."""
    eviction = DepthEviction(1.0) if device_depth else FlopAwareEviction(0.0)
    cache = TieredPrefixCache(ToyProfile(), 80, 100, MarconiTiering(depth=1.0), eviction)
    assert (cache.continuation is getattr(eviction, "record", None)) == device_depth
    for k in range(7):
        cache.serve([100 * k + i for i in range(20)], [1])
    assert cache.continuation.finished == 7
    assert TieredPrefixCache(ToyProfile(), 80, 100, MarconiTiering(1.0), eviction).continuation is None


# -- the `24h` client hint -------------------------------------------------------------------------
class _KeepPrefix:
    """A stand-in for the hint ledger: a `24h` credit in force on the nodes under one first token."""

    def __init__(self, first_token):
        self.first_token = first_token

    def kept_for_day(self, node) -> bool:
        while node.parent is not None and node.parent.parent is not None:
            node = node.parent
        return int(node.tokens[0]) == self.first_token


@pytest.mark.parametrize("hinted", [False, True])
def test_a_24h_hint_keeps_a_prefix_the_ranked_host_would_drop(hinted):
    """A short prefix (little prefill saved per byte) leaves the device while the host holds a long
    one that ranks above it: the ranked admission drops it; with a `24h` credit in force on it it is
    demoted whatever it displaces, and its next request hits from the host."""
    cache = TieredPrefixCache(ToyProfile(), 70, 55, MarconiTiering(3.0), FlopAwareEviction(0.0), verify=True)
    short = list(range(2000, 2008))
    if hinted:
        cache.client_hints = _KeepPrefix(2000)
    cache.serve(list(range(1000, 1040)), [1])
    cache.serve(short, [1])
    cache.serve([3000 + i for i in range(40)], [1])  # the long prefix goes to the host
    cache.serve([5000 + i for i in range(8)], [1])  # the short one leaves the device
    cache.check_invariants()
    lookup, _ = cache.serve(short + [1, 2], [1])
    assert lookup.host_hit_tokens == (len(short) + 1 if hinted else 0)
