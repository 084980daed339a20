"""The two-tier cache (`policy/tree/tiered_cache.py`) and its rules (`policy/rules/tier_rules.py`): upstream's
write-back rule on hand-built trees, Marconi's demote-or-drop, budgets and bookkeeping on random
streams, and exact load backs."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules.eviction import FlopAwareEviction, LruLeafEviction
from sglang_marconi.policy.tree.host_candidates import HostCandidateIndex
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.rules.tier_rules import Demotion, EvictionFacts, MarconiTiering, UpstreamWriteBack
from sglang_marconi.policy.tree.tiered_cache import TieredPrefixCache

X, Y = list(range(100, 120)), list(range(200, 210))  # a 20-token prefix and a 10-token continuation


def other(k, n):
    return [1000 * k + i for i in range(n)]


def stream(seed, n=150):
    """Sessions that continue their last turn or open on one of a few shared prefixes."""
    rng = np.random.default_rng(seed)
    prefixes = [list(rng.integers(0, 5, rng.integers(1, 30))) for _ in range(6)]
    last = {}
    for _ in range(n):
        s = int(rng.integers(0, 12))
        if s in last and rng.random() < 0.7:
            inp = last[s] + list(rng.integers(0, 5, rng.integers(1, 20)))
        else:
            inp = prefixes[int(rng.integers(0, 6))] + list(rng.integers(0, 5, rng.integers(1, 40)))
        out = list(rng.integers(0, 5, rng.integers(0, 10)))
        last[s] = inp + out
        yield inp, out


RULES = {"upstream": UpstreamWriteBack, "marconi": MarconiTiering}
EVICTIONS = {"lru": LruLeafEviction, "flops": lambda: FlopAwareEviction(1.0)}


# -- the rules, fact by fact ------------------------------------------------------------------------

def facts(**kw):
    base = dict(frees_kv=True, kv_on_host=False, state_on_device=True, state_on_host=False, host_descendants=False)
    return EvictionFacts(**{**base, **kw})


def test_upstream_backs_up_an_unbacked_node_with_its_state():
    assert UpstreamWriteBack().demotion(facts()) == Demotion(kv=True, state=True)
    assert UpstreamWriteBack().demotion(facts(frees_kv=False)) == Demotion(kv=True, state=True)  # InternalStateBackup


def test_upstream_loses_a_device_only_state_over_backed_up_kv():
    assert UpstreamWriteBack().demotion(facts(kv_on_host=True)) == Demotion(kv=True, state=False)
    assert UpstreamWriteBack().demotion(facts(kv_on_host=True, frees_kv=False)) == Demotion(kv=True, state=False)
    assert UpstreamWriteBack().demotion(facts(kv_on_host=True, state_on_host=True)) == Demotion(kv=True, state=True)


def test_marconi_demotes_states_ranked_and_drops_what_saves_nothing():
    rules = MarconiTiering()
    assert rules.demotion(facts(kv_on_host=True)) == Demotion(kv=True, state=True, ranked=True)
    assert rules.demotion(facts(frees_kv=False)) == Demotion(kv=False, state=True, ranked=True)
    assert rules.demotion(facts(state_on_device=False)) == Demotion(kv=False, state=False, ranked=False)
    # host nodes below need this KV: demoted whatever it ranks
    assert rules.demotion(facts(host_descendants=True)) == Demotion(kv=True, state=True, ranked=False)


def test_marconi_host_alpha_follows_the_device_only_when_asked():
    assert MarconiTiering().host_alpha(LruLeafEviction()) == 1.0
    follow = MarconiTiering(None)
    assert follow.host_alpha(FlopAwareEviction(20.0)) == 20.0 and follow.host_alpha(LruLeafEviction()) == 0.0


# -- hand-built trees -------------------------------------------------------------------------------

def test_prefix_evicted_from_device_hits_from_host_exactly(toy):
    """A's path is pushed to the host by an unrelated request, then its continuation hits it from
    the host: the same hit an infinite device gives (warm == cold), the same node and state, and
    what is loaded is what was demoted."""
    for rules in RULES.values():
        c = TieredPrefixCache(toy, 70, 1000, rules(), LruLeafEviction(), verify=True)
        c.serve(X + Y, [])
        c.serve(other(1, 30), [])  # 40 + 40 > 70: A goes to the host
        (node,) = [n for n in c.tree.nodes() if n.end == 30 and n.tokens[0] == X[0]]
        assert (node.kv_dev, node.kv_host, node.st_dev, node.st_host) == (False, True, False, True)
        assert c.counters.bytes_demoted == 30 + 10
        lookup, _ = c.serve(X + Y + [7], [])
        cold = HybridPrefixCache(toy, 10**6, LruLeafEviction())
        cold.serve(X + Y, [])
        assert lookup.hit_tokens == cold.lookup(X + Y + [7]).hit_tokens == 30
        assert lookup.device_hit_tokens == 0 and lookup.host_hit_tokens == 30
        assert lookup.hit_node is node and lookup.loaded_bytes == 30 + 10
        assert node.kv_dev and node.kv_host and node.st_dev and node.st_host  # the host copy stays
        c.check_invariants()


def branch_over_backed_up_kv(toy, rules):
    """A is loaded back (its host copy stays), then D branches inside it: the branch state at 20
    sits on a node whose KV is already on the host. Pressure then evicts the whole path."""
    c = TieredPrefixCache(toy, 70, 1000, rules, LruLeafEviction(), verify=True)
    c.serve(X + Y, [])
    c.serve(other(1, 30), [])
    assert c.serve(X + Y + [7], [])[0].host_hit_tokens == 30
    assert c.serve(X + [8, 8], [])[0].checkpoint_at == 20
    (branch,) = [n for n in c.tree.nodes() if n.end == 20]
    assert (branch.kv_dev, branch.kv_host, branch.st_dev, branch.st_host) == (True, True, True, False)
    c.serve(other(2, 40), [])  # 50 bytes: everything of X goes
    c.check_invariants()
    return c, branch


def test_upstream_write_back_drops_a_branch_state_over_backed_up_kv(toy):
    c, branch = branch_over_backed_up_kv(toy, UpstreamWriteBack())
    assert not branch.kv_dev and branch.kv_host and not branch.has_state  # demoted in place, state lost
    assert c.counters.states_dropped == 1 and c.counters.bytes_dropped == 10
    assert c.serve(X + [9, 9], [])[0].hit_tokens == 0  # the next branch off X finds no state


def test_marconi_demotes_the_branch_state_and_it_hits_from_host(toy):
    c, branch = branch_over_backed_up_kv(toy, MarconiTiering())
    assert not branch.kv_dev and branch.kv_host and branch.st_host
    assert c.counters.states_dropped == 0
    lookup, _ = c.serve(X + [9, 9], [])
    assert (lookup.hit_tokens, lookup.device_hit_tokens) == (20, 0)
    c.check_invariants()


def test_upstream_drops_the_subtree_when_the_host_cannot_take_the_kv(toy):
    """No host room even after its LRU: `drop_subtree_no_host`, the node goes."""
    c = TieredPrefixCache(toy, 70, 5, UpstreamWriteBack(), LruLeafEviction(), verify=True)
    c.serve(X + Y, [])
    c.serve(other(1, 30), [])
    assert not any(n.tokens[0] == X[0] for n in c.tree.nodes())
    assert c.counters.bytes_dropped == 40 and c.host_used_bytes == 0
    c.check_invariants()


def test_marconi_drops_a_victim_the_host_ranks_below_its_own(toy):
    """A full host keeps its long, FLOP-rich state; a short prefix evicted later is dropped rather
    than displace it (FLOPs per byte: 30^2/40 against 5^2/15)."""
    c = TieredPrefixCache(toy, 45, 40, MarconiTiering(alpha=1e6), LruLeafEviction(), verify=True)
    c.serve(X + Y, [])
    c.serve([5] * 5, [])  # A (40 bytes) goes to the host, which it fills
    c.serve(other(1, 30), [])  # the short prefix (15 bytes) is evicted: the host keeps A
    assert c.counters.bytes_evicted_host == 0 and c.counters.bytes_dropped == 15
    assert c.serve(X + Y + [1], [])[0].host_hit_tokens == 30
    c.check_invariants()


@pytest.mark.parametrize("rules", RULES)
def test_duplicates_are_freed_before_anything_is_lost(toy, rules):
    """A full host (A's and C's copies) and a device holding A again (loaded back, a duplicate):
    making room for B's leaf frees A's duplicate KV copy first (30 bytes, nothing lost); only
    when A itself leaves the device and needs that copy again does the host evict C."""
    c = TieredPrefixCache(toy, 70, 80, RULES[rules](), LruLeafEviction(), verify=True)
    c.serve(X + Y, [])
    c.serve(other(1, 30), [])
    c.serve(X + Y + [7], [])  # A loaded back (C demoted): the host is full
    assert c.host_used_bytes == 80 and c.counters.bytes_reclaimed == 0
    c.serve(other(2, 40), [])
    assert c.counters.bytes_reclaimed == 30 and c.counters.bytes_evicted_host == 40
    assert c.serve(X + Y + [7, 5], [])[0].hit_tokens == 31  # A and B's leaf both kept, on the host
    c.check_invariants()


def test_arguments_are_checked(toy):
    with pytest.raises(MarconiError, match="host_capacity_bytes"):
        TieredPrefixCache(toy, 100, -1, UpstreamWriteBack())
    from sglang_marconi.policy.rules.eviction import CoverageEviction

    with pytest.raises(MarconiError, match="coverage"):
        TieredPrefixCache(toy, 100, 10, UpstreamWriteBack(), CoverageEviction())


# -- random streams -----------------------------------------------------------------------------------

@pytest.mark.parametrize("rules", RULES)
@pytest.mark.parametrize("eviction", EVICTIONS)
def test_without_a_host_tier_it_is_the_device_cache(toy, rules, eviction):
    """Host capacity 0: every eviction drops, and the hits, checkpoints and contents are exactly
    `HybridPrefixCache`'s, request for request."""
    for seed in range(8):
        for capacity in (60, 150, 400):
            device = HybridPrefixCache(toy, capacity, EVICTIONS[eviction]())
            tiered = TieredPrefixCache(toy, capacity, 0, RULES[rules](), EVICTIONS[eviction]())
            for inp, out in stream(seed):
                (a, sa), (b, sb) = device.serve(inp, out), tiered.serve(inp, out)
                assert (a.hit_tokens, a.checkpoint_at, sa) == (b.hit_tokens, b.checkpoint_at, sb)
            assert (device.kv_tokens, device.ssm_states) == (tiered.kv_tokens, tiered.ssm_states)


def expected_load(c, inp):
    """What a lookup of `inp` must load from the host: (target end, bytes) or None, checking
    that the host really holds it."""
    walk = c.tree.walk(np.asarray(inp))
    target = on_device = None
    for node in walk.path:
        if node.end > len(inp) - 1:
            break
        if node.has_state:
            target = node
            if node.st_dev:
                on_device = node
    if target is None or target is on_device:
        return None
    path = [n for n in walk.path if n.end <= target.end]
    assert all(n.kv_dev or n.kv_host for n in path) and target.st_host
    return target.end, sum(len(n.tokens) for n in path if not n.kv_dev) * c.kv_bytes_per_token + c.ssm_state_bytes


@pytest.mark.parametrize("rules", RULES)
@pytest.mark.parametrize("eviction", EVICTIONS)
def test_budgets_bookkeeping_and_host_hits_on_random_streams(toy, rules, eviction):
    """Neither budget is ever exceeded; every host hit loads exactly what the host held for it;
    every state's digest is its prefix's (what is loaded back is what was demoted)."""
    for seed in range(6):
        for capacity, host in ((60, 100), (150, 40), (150, 400)):
            c = TieredPrefixCache(toy, capacity, host, RULES[rules](), EVICTIONS[eviction](), verify=True)
            for inp, out in stream(seed):
                expected = expected_load(c, inp)
                lookup, _ = c.serve(inp, out)
                if lookup.loaded_bytes:
                    assert expected == (lookup.hit_tokens, lookup.loaded_bytes)
                assert lookup.device_hit_tokens <= lookup.hit_tokens
                c.check_invariants()


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_with_room_on_the_host_marconi_loses_nothing(toy, eviction):
    """A host that holds everything: Marconi's tiers hit exactly where an infinite device would
    (nothing demoted is ever lost or changed), request for request."""
    for seed in range(6):
        requests = list(stream(seed))
        capacity = 2 * max(len(i) + len(o) for i, o in requests) + 40
        infinite = HybridPrefixCache(toy, 10**9, EVICTIONS[eviction]())
        tiered = TieredPrefixCache(toy, capacity, 10**9, MarconiTiering(), EVICTIONS[eviction](), verify=True)
        for inp, out in requests:
            (a, _), (b, _) = infinite.serve(inp, out), tiered.serve(inp, out)
            assert (a.hit_tokens, a.checkpoint_at) == (b.hit_tokens, b.checkpoint_at)
        assert tiered.counters.load_backs > 0


class RecordingCache(TieredPrefixCache):
    """Records, at each host eviction, the victim's value per byte and every candidate's."""

    def _evict_host(self, node):
        n = len(self.host_index)
        self.events.append((self.host_index.efficiency[node.hslot], self.host_index.efficiency[:n].min()))
        super()._evict_host(node)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), capacity=st.integers(60, 200), host=st.integers(20, 300))
def test_host_pressure_drops_the_cheapest_states_to_recompute_per_byte(toy_profile, seed, capacity, host):
    """Ranked by FLOPs saved per byte (recency a tie-break at a huge alpha), every state the host
    evicts is one of the cheapest to recompute per byte among its candidates at that moment."""
    check_host_evictions(toy_profile, seed, capacity, host)


def check_host_evictions(profile, seed, capacity, host) -> int:
    c = RecordingCache(profile, capacity, host, MarconiTiering(alpha=1e9), FlopAwareEviction(1.0))
    c.events = []
    for inp, out in stream(seed, 100):
        c.serve(inp, out)
    for victim, cheapest in c.events:
        assert victim <= cheapest * (1 + 1e-9) + 1e-12
    return len(c.events)


def test_the_host_eviction_property_is_exercised(toy):
    assert check_host_evictions(toy, 0, 100, 150) > 20


# -- the host candidate index --------------------------------------------------------------------------

def test_bytes_ranked_below_matches_a_brute_force_ranking():
    rng = np.random.default_rng(0)
    index = HostCandidateIndex(initial_capacity=4)
    rows = [(float(rng.integers(0, 50)), float(rng.random()), int(rng.integers(1, 100))) for _ in range(40)]
    for i, (t, e, b) in enumerate(rows):
        index.add(i, t, e, b)
    index.remove(3)
    del rows[3]
    rows.insert(3, rows.pop())  # the last entry moved into the hole
    for alpha in (0.0, 1.0, 7.0):
        for t_in, e_in in ((25.0, 0.5), (0.0, 0.0), (60.0, 2.0)):
            ts = np.array([r[0] for r in rows] + [t_in])
            es = np.array([r[1] for r in rows] + [e_in])
            score = (ts - ts.min()) / np.ptp(ts) + alpha * (es - es.min()) / np.ptp(es)
            expected = sum(r[2] for r, s in zip(rows, score[:-1]) if s < score[-1] - 1e-9)
            assert index.bytes_ranked_below(alpha, t_in, e_in) == pytest.approx(expected)


def test_host_candidate_rule_and_ranked_mask_shared_with_the_served_tier():
    """The two pieces `serving/host_tier.py` calls: `host_candidate_bytes` (which host nodes are
    candidates and what they free) and `HostCandidateIndex.ranked_below` (whom a ranked admission
    may displace: the mask `bytes_ranked_below` sums)."""
    import numpy as np

    from sglang_marconi.policy.tree.host_candidates import HostCandidateIndex
    from sglang_marconi.policy.rules.tier_rules import MarconiTiering, UpstreamWriteBack, host_candidate_bytes

    def facts(**kw):
        base = dict(locked=False, is_root=False, kv_on_device=False, kv_on_host=True, state_on_device=False,
                    state_on_host=True, n_children=0, kv_bytes=100, state_bytes=30)
        return {**base, **kw}

    for rules in (MarconiTiering(), UpstreamWriteBack()):
        assert host_candidate_bytes(rules, **facts()) == 130  # a host-only leaf goes whole
        assert host_candidate_bytes(rules, **facts(locked=True)) is None
        assert host_candidate_bytes(rules, **facts(kv_on_device=True, state_on_host=False)) is None
    alone = facts(kv_on_device=True, n_children=1)  # a host-only state of a node that keeps its KV
    assert host_candidate_bytes(MarconiTiering(), **alone) == 30
    assert host_candidate_bytes(UpstreamWriteBack(), **alone) is None
    assert host_candidate_bytes(MarconiTiering(), **facts(n_children=2, kv_on_device=True)) is None

    rng = np.random.default_rng(0)
    index = HostCandidateIndex(4)
    for i in range(20):
        index.add(i, float(rng.integers(100)), float(rng.random()), int(rng.integers(1, 50)))
    for _ in range(20):
        t, e, alpha = float(rng.integers(100)), float(rng.random()), float(rng.choice([0.0, 1.0, 5.0]))
        mask = index.ranked_below(alpha, t, e)
        assert index.bytes_ranked_below(alpha, t, e) == sum(index.freed_bytes(s) for s in np.flatnonzero(mask))
