"""The model of the served cache (`policy/tree/served_cache.py`), engine-free: what the served tests check
in SGLang's real cache holds here too, the ledgers stay whole, the tuner's served shadows are the
model itself, and the simulator runs it from its flags. (`tests/serving/test_sim_equivalence.py`
compares it with SGLang request by request.)"""

import numpy as np
import pytest

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
