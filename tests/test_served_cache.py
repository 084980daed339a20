"""The model of the served cache (`policy/tree/served_cache.py`), engine-free: what the served tests check
in SGLang's real cache holds here too, the ledgers stay whole, the tuner's served shadows are the
model itself, and the simulator runs it from its flags. (`tests/serving/test_sim_equivalence.py`
compares it with SGLang request by request.)"""

import numpy as np
import pytest
from shadow_streams import extending_sessions

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.tree.served_cache import EXTRA_BUFFER, NO_BUFFER, ServedCache, ServedPools
from sglang_marconi.policy.tuning.shadow_tuner import LRU, ShadowConfig, ShadowTuner
from sglang_marconi.sim.synthetic import generate

PROFILE = load_profile("nemotron-h-8b")
SYSTEM = list(range(1, 1001))


def model(kv=100_000, slots=64, strategy=NO_BUFFER, chunk=None, choice=0.0, probation=True):
    return ServedCache(PROFILE, ServedPools(kv, slots, strategy, chunk), choice, probation=probation)


@pytest.mark.parametrize("strategy", [NO_BUFFER, EXTRA_BUFFER])
def test_shared_system_prompt_reused_from_third_occurrence(strategy):
    """As in SGLang's cache (tests/serving/test_sglang_admission.py): the branch state sits on the
    branch, at 1,000, in both strategies (extra_buffer: the chunk cut a step before it)."""
    c = model(strategy=strategy, probation=False)
    hits = [c.serve(SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)), list(range(20))).hit_tokens
            for i in range(4)]
    assert hits == [0, 0, 1000, 1000]
    c.check_invariants()


@pytest.mark.parametrize("strategy,second_hit", [(NO_BUFFER, 300), (EXTRA_BUFFER, 256)])
def test_probation_hits_a_prefix_at_its_second_use(strategy, second_hit):
    """tests/serving/test_probation_served.py's numbers: the input end's state, kept on probation."""
    first, second = list(range(1, 301)), list(range(1, 301)) + list(range(5000, 5100))
    for probation, expected in ((False, 0 if strategy == NO_BUFFER else 256), (True, second_hit)):
        c = model(strategy=strategy, probation=probation)
        c.serve(first, list(range(9000, 9008)))
        assert c.serve(second, list(range(9100, 9108))).hit_tokens == expected
        c.check_invariants()


def test_the_running_request_holds_its_kv_while_it_runs():
    """KV 1,000 slots. The first request leaves 601 tokens (its state at 601). The second shares
    600 of them but no state there (hit 0), so while it runs it holds its own 900 tokens of KV: the
    first request's tokens go, although 901 would fit once it finished (what a cache that admits
    at the end, `HybridPrefixCache`, keeps)."""
    from sglang_marconi.policy.rules.eviction import FlopAwareEviction
    from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache

    first, second = list(range(1, 601)), list(range(1, 601)) + list(range(5001, 5301))
    c = model(kv=1000, slots=8, probation=False)
    c.serve(first, [7, 8])
    assert c.serve(second, [9]).hit_tokens == 0
    assert c.counters.evictions_leaf == 2 and c.tree_kv == 900  # [600, 601) with its state, then [0, 600)
    assert c.serve(second[:700], [9]).hit_tokens == 600  # the branch state, admitted at 600
    c.check_invariants()
    paper = HybridPrefixCache(PROFILE, 1000 * PROFILE.kv_bytes_per_token, FlopAwareEviction(0.0), state_slots=7)
    paper.serve(first, [7])
    paper.serve(second, [])
    assert paper.counters.evictions_leaf == 0 and paper.kv_tokens == 901


def test_pools_must_hold_a_running_request_and_a_state():
    with pytest.raises(MarconiError, match="mamba_slots"):
        ServedPools(1000, 3, EXTRA_BUFFER)  # 1 + 2 tracking slots, and no room for a state
    assert ServedPools(1000, 4, EXTRA_BUFFER).request_slots == 3
    assert ServedPools(1000, 400).scaled(0.5) == ServedPools(500, 200)


@pytest.mark.parametrize("strategy", [NO_BUFFER, EXTRA_BUFFER])
@pytest.mark.parametrize("choice", [LRU, 0.0, 1.0, "seglen:100"])
def test_ledgers_stay_whole_under_pressure(strategy, choice):
    c = model(kv=2500, slots=7, strategy=strategy, chunk=96, choice=choice)
    for r in generate("sharegpt", sessions=8, scale=0.4, seed=5):
        c.serve(r.input_tokens, r.output_tokens)
        c.check_invariants()
    assert c.counters.evictions_leaf > 0


def test_a_copy_is_independent():
    c = model(kv=3000, slots=8)
    requests = list(generate("lmsys", sessions=4, scale=0.1, seed=2))
    for r in requests[:10]:
        c.serve(r.input_tokens, r.output_tokens)
    d = c.copy(LRU)
    assert d.choice == LRU and c.choice == 0.0
    hits = [(c.serve(r.input_tokens, r.output_tokens).hit_tokens, d.serve(r.input_tokens, r.output_tokens).hit_tokens)
            for r in requests[10:]]
    c.check_invariants()
    d.check_invariants()
    assert len(hits) > 0


@pytest.mark.parametrize("strategy", [NO_BUFFER, EXTRA_BUFFER])
@pytest.mark.parametrize("choice", [LRU, 1.0, 20.0, "seglen:100", "depth:1", "coverage"])
def test_served_caches_found_to_hold_the_same_contents_go_on_alike(strategy, choice):
    """`same_contents` of two models of SGLang's cache, the tuner's stand-in merge test, is sound:
    fed one stream, one cache under another choice for a while (as a stand-in forked from another
    choice's shadow), then both under `choice`; once it finds them alike they hit alike on every
    later request and stay alike. Small pools with chunk ends, snapshots and backtrack states
    (extra_buffer); the depth rule reads each cache's own record. (A test of counts alone fails
    here in 24-48 of the 60 runs of each cell but depth:1's, whose caches converge by themselves.)"""
    from sglang_marconi.policy.rules.continuation import ContinuationRecord

    found = 0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        pools = ServedPools(500, 6 if strategy == NO_BUFFER else 9, strategy, 16, snapshot_step=8,
                            decode_snapshot_step=16)
        a, b = ServedCache(PROFILE, pools, choice), ServedCache(PROFILE, pools, 1.0 if choice == LRU else LRU)
        if b.continuation is None:  # a tuner's served shadows keep the stream's record from the start
            b.continuation = ContinuationRecord()
        requests = extending_sessions(rng)
        switch_at, alike = int(rng.integers(5, 40)), False
        for i in range(200):
            if i == switch_at:
                b.set_choice(choice)
            inp, out = next(requests)
            hits = a.serve(inp, out).hit_tokens, b.serve(inp, out).hit_tokens
            if alike:
                assert hits[0] == hits[1] and a.same_contents(b), seed
            elif i >= switch_at and a.same_contents(b):
                alike, found = True, found + 1
    assert found >= 5  # the pasts did converge: the claim was put to the test


def test_the_same_prefixes_touched_in_another_order_are_not_the_same_contents():
    """Two caches with one tree whose prefixes were used in another order evict differently, and
    `same_contents` tells them apart: by the nodes' recency (leaves ranked under KV pressure), and
    by the states' own recency (ranked under state pressure; the trees' stamps equal)."""
    x, y = list(range(1, 201)), list(range(1001, 1201))
    a, b = model(kv=700, slots=5, choice=LRU), model(kv=700, slots=5, choice=LRU)
    for cache, order in ((a, (x, y)), (b, (y, x))):
        for inp in order:
            cache.serve(inp, [7, 8])
    assert a.tree_kv == b.tree_kv and a.tree_states == b.tree_states and a.clock == b.clock
    assert not a.same_contents(b) and a.same_contents(a.copy())
    z = list(range(2001, 2301))  # makes room for itself: the least recent prefix goes
    assert a.serve(z, [9, 9]).hit_tokens == b.serve(z, [9, 9]).hit_tokens
    assert a.serve(x + [5], [1, 1]).hit_tokens != b.serve(x + [5], [1, 1]).hit_tokens

    c = model(kv=100_000, slots=4, choice=LRU, probation=False)  # 3 states fit beside a running request
    for inp in (x, y):
        c.serve(inp, [7, 8])  # a state at the end of each: inp + [7]
    d, e = c.copy(), c.copy()
    for cache, order in ((d, (x, y)), (e, (y, x))):  # the states reused again, in two orders
        for inp in order:
            cache._state_used(cache.tree.walk(np.asarray(inp + [7], dtype=np.int64)).path[-1])
    assert d.clock == e.clock and not d.same_contents(e)
    for cache in (d, e):  # the pool fills, then the least recently used state goes
        for start in (3001, 4001, 5001):
            cache.serve(list(range(start, start + 100)), [1, 1])
    assert d.serve(x + [7, 5], [1, 1]).hit_tokens != e.serve(x + [7, 5], [1, 1]).hit_tokens


@pytest.mark.parametrize("strategy", [NO_BUFFER, EXTRA_BUFFER])
@pytest.mark.parametrize("choice", [LRU, 0.0, 1.0, "seglen:100", "depth:1", "coverage"])
def test_victims_are_those_the_candidate_index_ranks_lowest(strategy, choice):
    """The model ranks its candidates as plain lists (and by recency alone takes the oldest): the
    same evictions, in order, as a `CandidateIndex` holding every candidate (numpy columns, the
    index the policy core's caches and the served index keep; coverage's states ranked by the
    rule's own `lowest_coverage`, as the served index ranks them)."""
    from sglang_marconi.policy.rules.eviction.coverage import lowest_coverage
    from sglang_marconi.policy.tree.candidate_index import CandidateIndex

    class Indexed(ServedCache):
        _ranks_recency_alone = False

        def _lowest_of(self, nodes, recency, values):
            index = CandidateIndex(tie_key=CandidateIndex.node_id)
            for node, stamp, value in zip(nodes, recency, values):
                index.add(node, stamp, value)
            if self.kind == "coverage":
                return lowest_coverage(index)
            return self.depth_rule.choose(index) if self.depth_rule is not None else index.lowest(self.weight)

    pools = ServedPools(3000, 8, strategy, 128)
    direct, indexed = (cls(PROFILE, pools, choice, record=True) for cls in (ServedCache, Indexed))
    for r in generate("lmsys", sessions=8, scale=0.1, seed=3):
        assert direct.serve(r.input_tokens, r.output_tokens) == indexed.serve(r.input_tokens, r.output_tokens)
    assert len(direct.events) > 50 and direct.events == indexed.events


def test_stamps_one_offset_apart_means_exactly():
    """SGLang stamps a match's ancestors a hundred-thousandth older per level, so stamps are not
    integers: a rounded difference can equal the clocks' offset when the exact one does not."""
    from sglang_marconi.policy.tree.core import exactly_offset

    ours, theirs, offset = [2.0**20, 7.5], [1 + 2.0**-40, 7.5 - (2.0**20 - 1)], 2.0**20 - 1
    assert ours[0] - theirs[0] == offset  # rounded
    assert not exactly_offset(ours, theirs, offset)
    assert exactly_offset([2.0**20, 7.5], [1.0, 7.5 - (2.0**20 - 1)], offset)
    assert exactly_offset([], [], 3.0) and not exactly_offset([5.0], [1.0], 3.0)


def test_a_served_stand_in_switching_to_a_depth_choice_reads_the_streams_record():
    """Forked from a shadow that keeps no record (SegLen's), a stand-in that switches to a depth
    choice reads a copy of the stream's record (the safe choice's), as the live cache does, not an
    empty one."""
    from sglang_marconi.policy.tuning.shadow_tuner import served_config

    tuner = ShadowTuner(PROFILE, 1, served_config(ShadowConfig(prune_after=0)), probation=True,
                        served=ServedPools(3000, 8, NO_BUFFER, 128))
    for r in generate("lmsys", sessions=8, scale=0.1, seed=1):
        tuner.observe(r.session_id, r.input_tokens, r.output_tokens[:-1])
    seglen = tuner.choices.index("seglen:100")
    assert tuner.shadows[seglen].cache.continuation is None and "depth:4" in tuner.choices
    tuner.live.cache = None  # not forked (or merged): the switch forks it from SegLen's shadow
    tuner.live.switch(seglen, "depth:4")
    record, stream = tuner.live.cache.cache.continuation, tuner._safe_record()
    assert stream.finished > 50 and record is not stream and record.same_as(stream)


@pytest.mark.parametrize("strategy,kv,slots,merges", [(NO_BUFFER, 20_000, 16, True), (EXTRA_BUFFER, 60_000, 32, False)])
def test_the_served_stand_in_is_the_live_cache_state_for_state_at_rate_one(strategy, kv, slots, merges):
    """Over the model of SGLang's cache the tuner follows the live cache's choices with a stand-in,
    or, once merged, with the current choice's shadow: at rate 1 it holds what the live cache
    holds after every request (`same_contents`), hit for hit, before and after the merge. (In the
    extra_buffer cell SegLen keeps what the LRU-shaped contents held: the stand-in never merges.)"""
    from sglang_marconi.policy.tuning.shadow_tuner import live_record_for
    from sglang_marconi.sim.traces import load_workload

    pools = ServedPools(kv, slots, strategy, 128)
    tuner = ShadowTuner(PROFILE, 1, ShadowConfig(), probation=True, served=pools)
    live = ServedCache(PROFILE, pools, tuner.current, probation=True)
    live.continuation = live_record_for(tuner.choices)
    compared = merged = 0
    for r in load_workload("synthetic:lmsys"):
        out = r.output_tokens
        hit = live.serve_kept(np.concatenate((r.input_tokens, out[:-1])), len(r.input_tokens)).hit_tokens
        if (choice := tuner.observe(r.session_id, r.input_tokens, out[:-1])) is not None:
            live.set_choice(choice)
        if tuner.live is None or tuner.live.since is None:
            continue  # not switched yet
        stand_in = tuner.live.cache
        if stand_in is None:
            stand_in, merged = tuner.shadows[tuner.choices.index(tuner.current)], merged + 1
        elif choice is None:
            assert tuner.live.last_hit == hit
        assert stand_in.cache.same_contents(live), compared
        compared += 1
    assert len(tuner.log.decisions) >= 2 and compared > 500 and (0 < merged < compared if merges else not merged)


@pytest.mark.parametrize("strategy", [NO_BUFFER, EXTRA_BUFFER])
def test_served_shadows_are_the_model(strategy):
    """The tuner given the served pools (sample rate 1): each choice's shadow hits exactly what the
    model with that choice fixed hits, request by request (the shared shadow stands for all until
    a request could evict, then each choice runs its own copy)."""
    pools = ServedPools(3000, 8, strategy, 128)
    config = ShadowConfig(prune_after=0)
    tuner = ShadowTuner(PROFILE, 1, config, probation=True, served=pools)
    fixed = [ServedCache(PROFILE, pools, choice, probation=True) for choice in tuner.choices]
    for r in generate("lmsys", sessions=8, scale=0.1, seed=1):
        out = r.output_tokens
        expected = [c.serve(r.input_tokens, out).hit_tokens for c in fixed]
        tuner.observe(r.session_id, r.input_tokens, out[:-1])
        assert tuner.last_hits == expected
    assert tuner.log.forked_at is not None


def test_the_simulator_runs_the_served_cache_from_its_flags(capsys):
    from sglang_marconi.sim.cli import main

    assert main(["--workload", "synthetic:lmsys:sessions=4,scale=0.1,seed=1", "--model", "nemotron-h-8b",
                 "--kv-tokens", "3000", "--mamba-slots", "8", "--probation", "--chunked-prefill-size", "128",
                 "--mamba-radix-cache-strategy", "extra_buffer", "--policies", "sglang+,marconi:1,marconi",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "sglang+" in out and "marconi(alpha=1)" in out
    assert main(["--workload", "synthetic:lmsys:sessions=2,scale=0.1", "--kv-tokens", "3000",
                 "--policies", "vllm+"]) == 2
    assert "go together" in capsys.readouterr().err


def test_the_simulator_runs_the_served_swa_policy_from_its_flags(capsys):
    """A sliding-window model's served pools: --kv-tokens (full KV) and --swa-tokens (SWA KV)."""
    from sglang_marconi.sim.baselines.swa_radix import served_marconi_swa
    from sglang_marconi.sim.cli import main

    profile = load_profile("gpt-oss-20b")
    policy = served_marconi_swa(profile, 4000, 1500, alpha=1.0)
    assert (policy.cache.kv_pool, policy.cache.swa_pool) == (4000, 1500)
    # as served: the last decoded token is not kept (a continuation hits what SGLang's cache holds)
    request = next(iter(generate("lmsys", sessions=1, scale=0.1, seed=1)))
    first = policy.serve(request)
    assert first.hit_tokens == 0 and policy.cache.tree_full == request.input_len + request.output_len - 1
    assert main(["--workload", "synthetic:lmsys:sessions=4,scale=0.1,seed=1", "--model", "gpt-oss-20b",
                 "--kv-tokens", "4000", "--swa-tokens", "1500", "--policies", "marconi:1,marconi",
                 "--tune-sync-every", "8", "--no-progress"]) == 0
    assert "marconi(alpha=1)" in capsys.readouterr().out
    assert main(["--workload", "synthetic:lmsys:sessions=2,scale=0.1", "--model", "gpt-oss-20b",
                 "--kv-tokens", "4000", "--swa-tokens", "1500", "--policies", "furiosa", "--no-progress"]) == 2
    assert "served SWA cache" in capsys.readouterr().err


def test_the_tree_keeps_split_points_and_tombstones_as_sglang_does():
    """The tree core configured as SGLang's tree (`core.PoolTree`): no compression. A split point
    whose branch is evicted stays a node, and a single-child node that loses its state under state
    pressure keeps its KV and stays too (the paper's compressed tree would fold both into their
    child); the candidate sets stay exact throughout."""
    c = model(kv=1000, slots=8, probation=False)
    first = np.arange(1, 301)
    second = np.concatenate((np.arange(1, 201), np.arange(5000, 5100)))
    c._insert_state(first, probationary=False)
    c._insert_state(second, probationary=False)  # splits the first edge at 200
    split_point, branch = c._whole_edges(second)
    assert (split_point.end, split_point.has_state, len(split_point.children)) == (200, False, 2)
    c._free_up(kv=1)  # the least recently used leaf: the first request's tail
    assert c._whole_edges(first) == [split_point] and c.kv_tokens == 300
    assert [n.end for n in c.tree.nodes()] == [200, 300]  # the stateless single-child node stays
    c._insert_state(np.arange(1, 201), probationary=False)  # a state at the split point
    c.lock_reused(branch)  # a running request holds the branch's state: the split point's goes
    c._free_up(states=1)
    assert not split_point.has_state and c.ssm_states == 1 and c.counters.evictions_single_child == 1
    c.unlock_reused(branch)
    assert [n.end for n in c.tree.nodes()] == [200, 300] and c.kv_tokens == 300  # tombstoned, kept
    c.check_invariants()
