"""Depth-aware eviction: the record of finished sequences (depth without session ids, bounded), the
rule where depth must decide the victim, the self-calibrating variant's fallback to LRU, and the
tuner running both as choices."""

import gc
import inspect
import math
import tracemalloc
import weakref

import numpy as np
import pytest
from toy_profile import ToyProfile

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.rules import continuation
from sglang_marconi.policy.rules.continuation import (BYTES_PER_SEQUENCE, GAP_BINS, HORIZON_MIN_GAPS,
                                                      ContinuationRecord, RecordedDepths, gap_bin, horizon_of,
                                                      prefix_hashes)
from sglang_marconi.policy.rules.eviction import CalibratedDepthEviction, DepthEviction, FlopAwareEviction
from sglang_marconi.policy.rules.eviction.depth import DIRECT_READ, SCAN_FIRST, deepest_oldest, fitted_exponent
from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.tree.hybrid_cache import HybridPrefixCache
from sglang_marconi.policy.tree.small_candidates import SmallCandidateIndex
from sglang_marconi.policy.tuning.shadow_tuner import (DEPTH_AUTO, ShadowConfig, ShadowTuner, adopt_choice,
                                                       choice_of, eviction_for)
from sglang_marconi.policy.tuning.tuner_spec import TunerSpec

PROMPT = np.arange(10_000, 10_016)  # a system prompt every conversation shares (4 blocks of 4)


def turn(history, rng, n):
    return np.concatenate((history, rng.integers(0, 1000, n)))


def test_depth_on_a_known_conversation_tree():
    rng = np.random.default_rng(0)
    record = ContinuationRecord(block_tokens=4)
    a1 = turn(PROMPT, rng, 9)
    a2 = turn(a1, rng, 11)  # extends a1
    b1 = turn(PROMPT, rng, 7)  # another conversation, interleaved, no id tells them apart
    a3 = turn(a2, rng, 6)  # extends a2, which extends a1
    a2_again = turn(a1, rng, 13)  # a second branch off a1
    b2 = turn(b1, rng, 5)
    lone = turn(PROMPT, rng, 3)
    depths = [record.finish(s) for s in (a1, a2, b1, a3, a2_again, b2, lone)]
    assert depths == [0, 1, 0, 2, 1, 1, 0]
    assert record.depth_at(len(a3), int(a3[-1])) == 2 and record.depth_at(len(b1), int(b1[-1])) == 0
    assert record.depth_at(len(a3) + 1, int(a3[-1])) == 0  # an end nothing finished at
    recorded, continued = record.rates()
    assert recorded.round().tolist()[:3] == [3, 3, 1] and continued.round().tolist()[:3] == [2, 1, 0]


def test_a_sequence_that_diverges_inside_its_last_block_extends_nothing():
    rng = np.random.default_rng(1)
    record = ContinuationRecord(block_tokens=4)
    first = turn(PROMPT, rng, 10)  # 26 tokens: its record is keyed by its first 24
    record.finish(first)
    diverged = first.copy()
    diverged[25] += 1  # same 24-token block prefix, another last token
    assert record.finish(np.concatenate((diverged, [1, 2, 3]))) == 0


def test_the_record_takes_tokens_only():
    assert list(inspect.signature(ContinuationRecord.finish).parameters) == ["self", "tokens", "n"]


def test_the_record_is_bounded_and_forgets_the_oldest():
    rng = np.random.default_rng(2)
    record = ContinuationRecord(block_tokens=4, max_sequences=8)
    first = turn(PROMPT, rng, 20)
    record.finish(first)
    for _ in range(200):
        record.finish(turn(PROMPT, rng, int(rng.integers(5, 40))))
        assert len(record) <= 8 and len(record._by_end) <= 8
    assert record.finish(turn(first, rng, 5)) == 0  # its parent was dropped: nothing to extend
    assert record.depth_at(len(first), int(first[-1])) == 0


def test_bytes_per_finished_sequence_within_the_stated_bound():
    rng = np.random.default_rng(3)
    sequences = [turn(PROMPT, rng, 200) for _ in range(2000)]
    record = ContinuationRecord(block_tokens=64, max_sequences=4096)
    record.finish(sequences[0])
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for s in sequences[1:]:
        record.finish(s)
    record._memo = (None, None)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert used / (len(sequences) - 1) <= BYTES_PER_SEQUENCE


def _continued_after(record, rng, gap, conversations):
    """`conversations` two-turn conversations over the prompt: each first turn is continued once
    `gap` first turns have opened after it (their continuations in between); returns the last
    conversation's second turn."""
    opened = []
    for _ in range(conversations + gap):
        if len(opened) >= gap:
            first = opened.pop(0)
            second = turn(first, rng, 6)
            record.finish(second)
        fresh = turn(PROMPT, rng, 12)
        record.finish(fresh)
        opened.append(fresh)
    return second


def test_a_depth_expires_once_it_is_older_than_the_continuation_horizon():
    """Continuations that (nearly) all come the same number of sequences later set the horizon just
    above that number (the upper edge of its half-octave bin); an end recorded longer ago than the
    horizon reads depth 0, and with no quantile it never expires."""
    rng = np.random.default_rng(5)
    record = ContinuationRecord(block_tokens=4)
    assert math.isinf(record.horizon)
    last = _continued_after(record, rng, 12, 300)
    # once 12 first turns are open, 22 sequences finish between a first turn and its continuation
    # (11 later first turns and 11 continuations of earlier ones); the first few waited less
    steady = 22
    assert record.gaps.argmax() == gap_bin(steady) and record.gaps[gap_bin(steady)] > 0.95 * record.gaps.sum()
    assert steady < record.horizon <= steady * math.sqrt(2)
    end = (len(last), int(last[-1]))
    assert record.depth_at(*end) == 1
    for _ in range(int(record.horizon) + 1):  # one-off sequences only: the conversation is abandoned
        record.finish(turn(PROMPT, rng, 12))
    assert record.depth_at(*end) == 0
    never = ContinuationRecord(block_tokens=4, horizon_quantile=None)
    last = _continued_after(never, np.random.default_rng(5), 12, 300)
    for _ in range(10 * steady):
        never.finish(turn(PROMPT, rng, 12))
    assert math.isinf(never.horizon) and never.depth_at(len(last), int(last[-1])) == 1


def test_the_horizon_waits_for_enough_continuations():
    record = ContinuationRecord(block_tokens=4)
    rng = np.random.default_rng(6)
    last = _continued_after(record, rng, 4, int(HORIZON_MIN_GAPS) - 10)
    for _ in range(200):
        record.finish(turn(PROMPT, rng, 12))
    assert math.isinf(record.horizon) and record.depth_at(len(last), int(last[-1])) == 1


def test_the_horizon_is_the_quantile_of_the_gaps():
    gaps = np.zeros(GAP_BINS)
    gaps[[gap_bin(10), gap_bin(100)]] = (90.0, 10.0)
    assert horizon_of(gaps, 0.9) == 2.0 ** ((gap_bin(10) + 1) / 2) and 10 < horizon_of(gaps, 0.9) <= 10 * math.sqrt(2)
    assert horizon_of(gaps, 0.95) == 2.0 ** ((gap_bin(100) + 1) / 2)
    assert math.isinf(horizon_of(gaps, None)) and math.isinf(horizon_of(gaps / 10, 0.9))


def test_prefix_hashes_are_fixed_across_processes():
    """The hash is part of the rule (every rank and the simulator must find the same records)."""
    assert prefix_hashes(np.arange(12), 4).tolist() == [14916341659735094647, 17350910336749559723,
                                                         16218569218801985888]


def test_bad_parameters_are_named():
    with pytest.raises(MarconiError, match="block_tokens"):
        ContinuationRecord(block_tokens=0)
    with pytest.raises(MarconiError, match="horizon_quantile must be .* got 1.5"):
        ContinuationRecord(horizon_quantile=1.5)
    with pytest.raises(MarconiError, match="depth exponent"):
        DepthEviction(-1.0)


def _two_candidates(eviction):
    """Two conversations under a prompt, then a fresh one: room for it only by evicting one
    conversation's end. The deep conversation (three turns) is older than the fresh first turn."""
    toy = ToyProfile()
    cache = HybridPrefixCache(toy, 180, eviction)  # 1 byte per token, 10 per state: a leaf must go
    rng = np.random.default_rng(4)
    deep = turn(PROMPT, rng, 20)
    for _ in range(2):
        cache.serve(deep[:-5], deep[-5:])
        deep = turn(deep, rng, 20)
    cache.serve(deep[:-5], deep[-5:])  # third turn: depth 2, its end the oldest leaf
    shallow = turn(PROMPT, rng, 40)
    cache.serve(shallow[:-5], shallow[-5:])  # depth 0, more recent
    cache.check_invariants()
    newcomer = turn(PROMPT, rng, 40)
    cache.serve(newcomer[:-5], newcomer[-5:])  # needs room: one of the two ends goes
    cache.check_invariants()
    nxt = turn(deep, rng, 10)
    return cache.lookup(nxt).hit_tokens, len(deep)


class _Item:
    def __init__(self, i):
        self.id = i


@pytest.mark.parametrize("index_kind", [CandidateIndex, SmallCandidateIndex])
@pytest.mark.parametrize("seed", range(40))
def test_reading_depths_oldest_first_picks_the_victim_of_every_depth(index_kind, seed):
    """The victim choice reads depths oldest first and stops once no younger candidate can win
    (`_lowest_keep_scanned`); it must pick what scoring every candidate picks, forced ties
    included (few distinct recencies and depths, so that keep scores coincide exactly), and read
    few depths where the oldest candidates are shallow."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    recency = rng.integers(0, int(rng.choice([2, 5, 40, 10_000])), n).astype(float)
    depths = rng.choice([0, 0, 0, 1, 2, 3, 15], n).astype(float) if seed % 3 else np.zeros(n)
    index = index_kind(tie_key=CandidateIndex.node_id)
    for item, t in zip([_Item(int(i)) for i in rng.permutation(10 * n)[:n]], recency):
        index.add(item, t, 0.0)
    reads = []

    def depths_of(slots):
        reads.extend(slots.tolist())
        return depths[slots]

    for exponent in (0.5, 1.0, 4.0, 16.0):
        reads.clear()
        assert deepest_oldest(index, depths_of, exponent) is deepest_oldest(index, depths, exponent)
        assert len(reads) == len(set(reads)), "a depth read twice"
        if seed % 3 == 0 and np.sum(recency == recency.min()) <= SCAN_FIRST:
            assert len(reads) == min(n, SCAN_FIRST), "every depth 0: the oldest decide, in the first read"


class _EndNode:
    made = 0

    def __init__(self, end, last):
        self.end_key = (end, last)
        self.id = _EndNode.made  # unique and never reused, as a cache's node ids are
        _EndNode.made += 1


@pytest.mark.parametrize("seed", range(8))
def test_remembered_depths_are_the_records_depths_as_it_changes(seed, monkeypatch):
    """`RecordedDepths` remembers each node's row between reads; at every read it must give what
    `depth_at` gives now, while the record sets, replaces and drops ends (a small record that
    overflows), its horizon moves, and its log of changed ends is cut short (a reader further
    behind re-reads everything)."""
    monkeypatch.setattr(continuation, "ENDS_LOG_KEPT", int(np.random.default_rng(seed).choice([3, 50, 4096])))
    rng = np.random.default_rng(seed)
    record = ContinuationRecord(block_tokens=4, max_sequences=int(rng.choice([8, 64])))
    reader = RecordedDepths(record, lambda node: node.end_key)
    prompts = [rng.integers(0, 50, 8) for _ in range(6)]
    open_turns, nodes = [], []
    for step in range(1500):
        if open_turns and rng.random() < 0.6:  # a next turn of an open conversation (or a repeat of it)
            history = open_turns[int(rng.integers(len(open_turns)))]
            repeat = rng.random() < 0.1
            seq = history if repeat else np.concatenate((history, rng.integers(0, 50, int(rng.integers(1, 9)))))
        else:
            prompt = prompts[int(rng.integers(len(prompts)))]
            seq = np.concatenate((prompt, rng.integers(0, 50, int(rng.integers(0, 9)))))
        record.finish(seq)
        open_turns = (open_turns + [seq])[-40:]
        nodes.append(_EndNode(len(seq), int(seq[-1])))
        if rng.random() < 0.3:
            nodes.append(_EndNode(int(rng.integers(1, 40)), int(rng.integers(0, 50))))  # an end nobody finished at
        nodes = [node for node in nodes if rng.random() < 0.97]  # evicted
        if step % 7 == 0 and nodes:
            shown = [nodes[i] for i in rng.permutation(len(nodes))[: int(rng.integers(1, len(nodes) + 1))]]
            expected = [record.depth_at(*node.end_key) for node in shown]
            assert reader(shown, len(nodes)).tolist() == expected
    assert math.isfinite(record.horizon), "the horizon never settled: expiry went untested"


def test_depth_decides_the_victim_where_lru_evicts_the_deep_conversation():
    hit, deep_len = _two_candidates(DepthEviction(2.0, ContinuationRecord(block_tokens=4)))
    assert hit == deep_len  # the next turn of the deep conversation reuses it all
    hit_lru, _ = _two_candidates(FlopAwareEviction(0.0))
    assert hit_lru < deep_len  # LRU over the same candidates evicted the deep end, the older one


def _stream(rng, continue_prob, n=3000, conversations=40):
    """Conversations over the prompt: each next request continues one open conversation with
    probability `continue_prob(depth)`, else starts a new one (turns grow the sequence)."""
    open_ = []
    for _ in range(n):
        if open_ and rng.random() < 0.8:
            i = int(rng.integers(len(open_)))
            seq, depth = open_[i]
            if rng.random() < continue_prob(depth):
                nxt = turn(seq, rng, int(rng.integers(4, 12)))
                open_[i] = (nxt, depth + 1)
                yield nxt
                continue
            open_.pop(i)
        seq = turn(PROMPT, rng, int(rng.integers(8, 24)))
        open_.append((seq, 0))
        if len(open_) > conversations:
            open_.pop(0)
        yield seq


def test_remembered_depths_keep_no_node_alive():
    """A served cache's evicted nodes hold SGLang's index tensors: remembering a depth must not
    keep its node."""
    record = ContinuationRecord(block_tokens=4)
    record.finish(np.arange(12))
    reader = RecordedDepths(record, lambda node: node.end_key)
    nodes = [_EndNode(12, 11), _EndNode(8, 7)]
    assert reader(nodes).tolist() == [0.0, 0.0]
    gone = weakref.ref(nodes[0])
    del nodes[0]
    gc.collect()
    assert gone() is None, "a node read once is still referenced"


class _EveryDepthRead(DepthEviction):
    """The rule as defined: every candidate's depth read from the record at every victim choice."""

    largest = 0

    def choose(self, candidates):
        self.largest = max(self.largest, len(candidates))
        depth_at, node_end = self.record.depth_at, self.node_end
        depths = np.fromiter((depth_at(*node_end(node)) for node in candidates.items), dtype=float,
                             count=len(candidates))
        return deepest_oldest(candidates, depths, self.current_exponent())


@pytest.mark.parametrize("exponent, quantile, kept", [(1.0, 0.9, 1 << 16), (4.0, 0.9, 1 << 16), (4.0, None, 64)])
def test_remembered_depths_evict_what_reading_every_depth_evicts(exponent, quantile, kept):
    """`DepthEviction` remembers depths between choices and reads the oldest candidates first once
    they are many; over a conversation stream in a cache of many candidates it must serve every
    request as the rule read plainly does (`_EveryDepthRead`), its own record fed alike: depths that
    expire past the horizon, and a small record that forgets ends (no expiry to hide a stale one)."""
    caches = [HybridPrefixCache(ToyProfile(), 4000, rule(exponent, ContinuationRecord(
        block_tokens=4, max_sequences=kept, horizon_quantile=quantile))) for rule in (DepthEviction, _EveryDepthRead)]
    for seq in _stream(np.random.default_rng(7), lambda depth: 0.7, n=2500, conversations=60):
        hits = [cache.serve(seq[:-4], seq[-4:])[0].hit_tokens for cache in caches]
        assert hits[0] == hits[1]
    plain = caches[1].eviction
    assert plain.largest > 4 * DIRECT_READ, "too few candidates: the remembered depths were not used"
    if quantile is not None:
        assert math.isfinite(plain.record.horizon) and plain.record.finished > plain.record.horizon, "none expired"


@pytest.mark.parametrize("predicts", [False, True])
def test_the_calibrated_rule_learns_b_only_where_depth_predicts(predicts):
    prob = (lambda d: 0.3 if d == 0 else 0.9) if predicts else (lambda d: 0.5)
    record = ContinuationRecord(block_tokens=4)
    for seq in _stream(np.random.default_rng(5), prob):
        record.finish(seq)
    b = fitted_exponent(*record.rates())
    assert (b > 0.3) if predicts else (b == 0.0)


def test_the_calibrated_rule_is_lru_where_depth_does_not_predict():
    toy = ToyProfile()
    seqs = list(_stream(np.random.default_rng(6), lambda d: 0.5, n=1500))
    auto = HybridPrefixCache(toy, 600, CalibratedDepthEviction(ContinuationRecord(block_tokens=4)))
    lru = HybridPrefixCache(toy, 600, FlopAwareEviction(0.0))
    fixed = HybridPrefixCache(toy, 600, DepthEviction(1.0, ContinuationRecord(block_tokens=4)))
    hits = {"auto": [], "lru": [], "fixed": []}
    for seq in seqs:
        for name, cache in (("auto", auto), ("lru", lru), ("fixed", fixed)):
            hits[name].append(cache.serve(seq[:-3], seq[-3:])[0].hit_tokens)
    assert auto.eviction.current_exponent() == 0.0
    assert hits["auto"] == hits["lru"]
    assert hits["fixed"] != hits["lru"]  # the stream does exercise depth: a fixed B changes victims


def test_tuner_runs_the_depth_choices_and_the_live_cache_reads_its_record():
    toy = ToyProfile()
    config = ShadowConfig(alpha_grid=(0.0, 1.0)).with_depth((1.0,))
    assert config.choices[-2:] == ("depth:1", DEPTH_AUTO)
    assert ShadowConfig().choices == ShadowConfig().without_depth().choices  # off unless asked for
    tuner = ShadowTuner(toy, 600, config)
    live = HybridPrefixCache(toy, 600, eviction_for(tuner.current))
    seqs = list(_stream(np.random.default_rng(7), lambda d: 0.2 if d == 0 else 0.9, n=800))
    for i, seq in enumerate(seqs):
        live.serve(seq[:-3], seq[-3:])
        tuner.observe(f"s{i}", seq[:-3], seq[-3:])
    assert tuner.record.finished == len(seqs)
    assert tuner.shadows
    for shadow in filter(None, tuner.shadows):
        shadow.check_invariants()
        if isinstance(shadow.eviction, DepthEviction):
            assert shadow.eviction.record is tuner.record and not shadow.eviction.feeds_record
    adopt_choice(live, "depth:1", tuner.record)
    assert live.eviction.record is tuner.record and choice_of(live.eviction) == "depth:1"
    adopt_choice(live, DEPTH_AUTO, tuner.record)
    assert live.eviction.record is tuner.record and choice_of(live.eviction) == DEPTH_AUTO
    live.serve(seqs[0][:-3], seqs[0][-3:])
    live.check_invariants()
    assert tuner.record.finished == len(seqs)  # the live cache reads the tuner's record, never feeds it


def test_the_served_tuner_runs_the_simulators_depth_choices():
    from sglang_marconi.policy.tuning.shadow_tuner import COVERAGE

    spec = TunerSpec("hybrid", ToyProfile(), 600, ShadowConfig(), dict(served=object()))
    assert spec.choices == ShadowConfig().with_depth().choices + (COVERAGE,)  # and coverage, served only
    named = ShadowConfig().with_depth((2.0,), auto=False)  # a configuration that names its own is kept
    assert TunerSpec("hybrid", ToyProfile(), 600, named, dict(served=object())).choices == named.choices + (COVERAGE,)


def _conversation_workload(n=600, seed=8):
    from sglang_marconi.sim.workload import ListWorkload, Request

    rng = np.random.default_rng(seed)
    open_, requests = {}, []
    for i in range(n):
        sid = int(rng.integers(30))
        seq = open_.get(sid, PROMPT)
        inp = turn(seq, rng, int(rng.integers(4, 12)))
        out = rng.integers(0, 1000, 3)
        open_[sid] = np.concatenate((inp, out)) if rng.random() < 0.7 else PROMPT
        requests.append(Request(f"s{sid}", i, float(i), inp, out))
    return ListWorkload("conversations", requests)


def test_a_shadow_at_rate_one_predicts_exactly_the_full_caches_gain():
    from sglang_marconi.sim.tuning import full_gains, shadow_predictions

    toy, workload = ToyProfile(), _conversation_workload()
    config = ShadowConfig(alpha_grid=(0.0,), seglen_weights=()).with_depth((1.0, 4.0))
    predicted = shadow_predictions(workload, toy, 500, config)
    full = full_gains(workload, toy, 500, config.choices)
    assert predicted == pytest.approx(full, abs=1e-9)
    assert any(abs(v) > 0.1 for v in full.values())  # the choices differ on this stream


def test_with_depth_choices_the_shadows_hold_more_requests():
    from sglang_marconi.sim.tuning import MIN_REQUESTS_HELD_DEPTH, shadow_config_for

    from sglang_marconi.sim.workload import ListWorkload, Request

    toy, rng = ToyProfile(), np.random.default_rng(9)
    workload = ListWorkload("many sessions", [Request(f"s{i}", 0, float(i), rng.integers(0, 1000, 20), [1, 2])
                                              for i in range(4000)])
    lengths = workload.request_lengths()
    footprint = float(lengths.sum(axis=1).mean()) * toy.kv_bytes_per_token + 2 * toy.ssm_state_bytes
    capacity = int(4 * MIN_REQUESTS_HELD_DEPTH * footprint)  # ample: the plain floor alone would sample 1/4 or less
    plain = shadow_config_for(workload, toy, capacity, ShadowConfig(), None, depth=False)
    deep = shadow_config_for(workload, toy, capacity, ShadowConfig(), None)
    assert deep.has_depth and not plain.has_depth
    assert deep.sample_rate >= MIN_REQUESTS_HELD_DEPTH * footprint / capacity > plain.sample_rate


# -- the served cache's model and the served flags -------------------------------------------------

def _served(choice, strategy="no_buffer", kv=400, slots=6):
    from sglang_marconi.policy.tree.served_cache import ServedCache, ServedPools

    return ServedCache(ToyProfile(), ServedPools(kv, slots, strategy, snapshot_step=4, decode_snapshot_step=8), choice)


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_the_served_model_records_what_its_last_insert_kept(strategy):
    cache = _served("depth:1", strategy)
    rng = np.random.default_rng(3)
    first = turn(PROMPT, rng, 150)  # two of the record's 64-token blocks and more
    out = rng.integers(0, 1000, 7)
    cache.serve(first, out)
    kept = np.concatenate((first, out[:-1]))
    ends = sorted(end for end, _ in cache.continuation._by_end)
    final = max(node.end for node in cache.tree.nodes() if node.has_state)
    assert ends == [final]  # the end of the state the release inserted
    if strategy == "no_buffer":
        assert final == len(kept)
    else:  # extra_buffer: the insert is cut at the last tracked state
        assert final < len(kept)
    second = turn(kept, rng, 40)  # its last tracked state lies past the first's
    cache.serve(second, rng.integers(0, 1000, 20))
    assert max(depth for depth, _ in cache.continuation._by_end.values()) == 1  # the next turn extends the first


def test_the_served_model_keeps_its_record_across_a_switch_of_rule():
    cache = _served("depth:4")
    record = cache.continuation
    cache.set_choice(1.0)
    assert cache.kind == "flops" and cache.depth_rule is None and cache.continuation is record
    cache.set_choice("depth:auto")
    assert cache.depth_rule.record is record and cache.kind == "depth"
    assert _served(0.0).continuation is None  # no depth choice yet: nothing recorded


def test_the_served_model_at_b_zero_is_lru_over_the_same_candidates_and_depth_changes_it():
    """depth:0 evicts as alpha 0 does (recency over the same candidates, under both pressures),
    request by request; depth:4 on the same conversations keeps deep ends and hits more."""
    from sglang_marconi.policy.tree.served_cache import ServedPools
    from sglang_marconi.sim.baselines.served import ServedPolicy

    requests = list(_conversation_workload(n=400))
    pools = ServedPools(300, 6, snapshot_step=4, decode_snapshot_step=8)
    policies = {c: ServedPolicy(str(c), ToyProfile(), pools, c) for c in (0.0, "depth:0", "depth:4")}
    hits = {c: np.array([p.serve(r).hit_tokens for r in requests]) for c, p in policies.items()}
    c = policies["depth:4"].cache.counters
    assert c.evictions_leaf > 0 and c.evictions_single_child + c.evictions_probationary > 0
    assert np.array_equal(hits["depth:0"], hits[0.0])
    assert hits["depth:4"].sum() > hits[0.0].sum()
    for p in policies.values():
        p.cache.check_invariants()


def test_the_served_flag_fixes_the_depth_rule():
    import argparse

    from sglang_marconi.serving.config import MarconiServingConfig, add_marconi_args, config_from_args
    from sglang_marconi.serving.eviction_settings import MarconiEvictionSettings

    parser = argparse.ArgumentParser()
    add_marconi_args(parser)
    for value in ("depth:2", "depth:auto"):
        config = config_from_args(parser.parse_args(["--marconi-eviction", value]))
        assert config.fixed_choice == value
        assert MarconiServingConfig.from_env({"SGLANG_MARCONI_CONFIG": config.to_env()}).fixed_choice == value
    for bad in ("depth:x", "depth:99", "depth", "belady"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--marconi-eviction", bad])
    with pytest.raises(MarconiError, match="'depth:1': needs --marconi-admission on"):
        config_from_args(parser.parse_args(["--marconi-eviction", "depth:1", "--marconi-admission", "off"]))
    settings = MarconiEvictionSettings(ToyProfile(), choice="depth:2")
    assert (settings.kind, settings.weight, settings.value_kind, settings.label) == ("depth", 0.0, "seglen", "depth:2")
    record = settings.continuation
    settings.finished(np.arange(40), 0)  # a request whose insert kept nothing
    settings.finished(np.arange(40), 33)
    assert record.finished == 1 and record.depth_at(33, 32) == 0 and (33, 32) in record._by_end
    settings.choice = 0.0
    assert settings.depth_rule is None and settings.value_kind == "flops"
    settings.choice = "depth:auto"
    assert settings.depth_rule.record is record
