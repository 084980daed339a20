"""Marconi's FLOP-aware eviction inside SGLang's real UnifiedRadixCache (CPU, no mocks).

Every request goes through the scheduler's own calls (see sglang_cpu.run_request); the
brute-force checks walk SGLang's tree themselves and recompute the paper's utility."""

import random

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang_cpu import FULL, MAMBA, run_request  # noqa: E402

from sglang_marconi.policy.cost.model_profile import load_profile  # noqa: E402
from sglang_marconi.serving.eviction_settings import KV_PRESSURE, MAMBA_PRESSURE  # noqa: E402

PROFILE = load_profile("nemotron-h-8b")
VOCAB = 1 << 30


# -- an independent evaluation of the formula over SGLang's tree --------------------------------

def brute_force(cc, pressure, profile=PROFILE):
    """{node: (recency, flop_efficiency)} for every candidate of `pressure`, from a walk
    of SGLang's tree (nothing read from the Marconi index)."""
    root = cc.tree_core.root_node
    ends, order, stack = {root: 0}, [], [root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            ends[child] = ends[node] + len(child.key)
            order.append(child)
            stack.append(child)

    def has_state(n):
        return n.component_data[MAMBA].value is not None

    def unlocked(n):
        return all(n.component_data[ct].lock_ref == 0 for ct in (FULL, MAMBA))

    def skippable(n):  # merged into its child in the paper's tree
        return n is not root and len(n.children) == 1 and not has_state(n)

    leaves = {n for n in order if not n.children and unlocked(n)}
    assert leaves == set(cc.tree_core.evictable_device_leaves), "SGLang's leaf set disagrees with the tree"
    out = {}
    for n in order:
        leaf = n in leaves
        if pressure == KV_PRESSURE:
            if not leaf:
                continue
        elif not (has_state(n) and n.component_data[MAMBA].lock_ref == 0 and (leaf or len(n.children) == 1)):
            continue
        anchor = n.parent
        while skippable(anchor):
            anchor = anchor.parent
        start, end = ends[anchor], ends[n]
        if has_state(n):
            freed = profile.ssm_state_bytes + (profile.kv_bytes_per_token * (end - start) if leaf else 0)
            eff = profile.prefill_flops(start, end) / freed
        else:
            eff = 0.0
        recency = n.last_access_time if pressure == KV_PRESSURE else getattr(n, "_marconi_state_time", n.last_access_time)
        out[n] = (float(recency), eff)
    return out


def utilities(candidates, alpha):
    nodes = list(candidates)
    t = np.array([candidates[n][0] for n in nodes])
    e = np.array([candidates[n][1] for n in nodes])

    def norm(x):
        span = x.max() - x.min()
        return (x - x.min()) / span if span > 0 else np.zeros_like(x)

    return dict(zip(nodes, norm(t) + alpha * norm(e)))


class VictimChecker:
    """Observer: at each decision, compare the victim with a brute-force evaluation."""

    def __init__(self, lru_only=False):
        self.cc = None
        self.lru_only = lru_only
        self.checked = {KV_PRESSURE: 0, MAMBA_PRESSURE: 0}
        self.kinds = {"leaf": 0, "single_child": 0, "fallback": 0}

    def __call__(self, victim):
        self.kinds[victim.kind] += 1
        candidates = brute_force(self.cc, victim.pressure)
        if victim.kind == "fallback":
            assert not candidates, "fell back to upstream although Marconi candidates exist"
            return
        assert victim.node in candidates, (victim.pressure, victim.kind, "victim is not a candidate")
        if self.lru_only:  # alpha = 0: least recently used candidate
            assert victim.weight == 0
            oldest = min(candidates, key=lambda n: candidates[n][0])
            assert victim.node is oldest, (victim.pressure, candidates[victim.node], candidates[oldest])
        else:
            scores = utilities(candidates, victim.weight)
            best = min(scores.values())
            assert scores[victim.node] <= best + 1e-9, (victim.pressure, scores[victim.node], best)
        self.checked[victim.pressure] += 1


# -- a workload that forces both pressures -------------------------------------------------------

class Workload:
    """Multi-turn sessions, some opening with one of two shared system prompts; random lengths,
    outputs and chunked prefill."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.system = [self.tokens(self.rng.randrange(150, 350)) for _ in range(2)]
        self.sessions = []

    def tokens(self, n):
        return [self.rng.randrange(1, VOCAB) for _ in range(n)]

    def next(self):
        rng = self.rng
        if self.sessions and rng.random() < 0.5:
            i = rng.randrange(len(self.sessions))
            prompt = self.sessions[i] + self.tokens(rng.randrange(10, 120))
        else:
            i = None
            head = rng.choice(self.system) if rng.random() < 0.4 else []
            prompt = head + self.tokens(rng.randrange(20, 200))
        n_out = rng.randrange(1, 25)
        return i, prompt, self.tokens(n_out), rng.choice([None, None, 48, 96])

    def record(self, i, req):
        history = list(req.origin_input_ids) + list(req.output_ids[:-1])
        if i is None:
            self.sessions.append(history)
        else:
            self.sessions[i] = history
        if len(self.sessions[-1 if i is None else i]) > 1400:  # keep prompts within the context
            self.sessions.pop(-1 if i is None else i)


def serve(cc, workload, n, after=None):
    hits = []
    for k in range(n):
        i, prompt, outputs, chunk = workload.next()
        req, hit = run_request(cc, prompt, len(outputs), chunk_size=chunk, out_tokens=outputs)
        workload.record(i, req)
        hits.append(hit)
        if after is not None:
            after(k)
    return hits


def alive(cc, node):
    return cc.tree_core._node_arena.get(node.id) is node


# -- (1) no leak, locks respected ---------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ledgers_balance_and_locked_nodes_survive(marconi_cache, seed):
    victims = []
    cc = marconi_cache(alpha=[0.0, 0.5, 2.0][seed], observer=victims.append,
                       kv_size=2400, mamba_size=10, max_num_reqs=2)
    cache, index = cc.cache, cc.cache.marconi.index
    workload = Workload(seed)
    held = {}

    def after(k):
        cc.check_no_leak()  # available + evictable + protected == pool size, KV and Mamba
        index.check()  # the incremental indexes equal a from-scratch evaluation
        if k == 12:  # lock a state-holding node the way a running request does
            node = max((n for n in cc.nodes() if n.component_data[MAMBA].value is not None),
                       key=lambda n: len(n.key))
            held["node"], held["lock"] = node, cache.lock(node.id)
            held["path"] = []
            while node is not cc.tree_core.root_node:
                held["path"].append(node)
                node = node.parent
            held["victims_before"] = len(victims)
        elif "lock" in held and k < 45:
            node = held["node"]
            assert node.component_data[MAMBA].value is not None
            assert all(alive(cc, n) and n.component_data[FULL].value is not None for n in held["path"])
            assert cache.full_protected_size() >= sum(len(n.key) for n in held["path"])
            assert cache.mamba_protected_size() >= 1
        if k == 45:
            cache.unlock(held.pop("lock"))
            held["victims_after"] = len(victims)
            cc.check_no_leak()
            index.check()
        if k % 15 == 14 and "lock" not in held:
            cache.sanity_check()

    serve(cc, workload, 70, after)
    assert cc.settings.counters.stale_repairs == 0
    # both pressures were exercised, and nothing locked was ever chosen
    pressures = {v.pressure for v in victims}
    assert pressures == {KV_PRESSURE, MAMBA_PRESSURE}, pressures
    assert cc.settings.counters.evictions_single_child > 0
    assert held["victims_after"] > held["victims_before"]
    for v in victims[held["victims_before"]:held["victims_after"]]:
        assert v.node is not held["node"]
    for v in victims:
        if v.kind == "leaf":
            assert all(v.node.component_data[ct].lock_ref == 0 for ct in (FULL, MAMBA))
        else:
            assert v.node.component_data[MAMBA].lock_ref == 0
    # everything can still be evicted, and the pools come back whole
    cache.evict(EvictParams(num_tokens=10**9, mamba_num=10**9))
    assert cc.kv_ledger() == (cc.kv_size, 0, 0) and cc.mamba_ledger() == (cc.mamba_size, 0, 0)
    index.check()
    assert len(index.indexes[0]) == len(index.indexes[1]) == 0


# -- (2) every victim is the brute-force minimum of the formula ---------------------------------

def test_victims_match_brute_force_formula(marconi_cache):
    checker = VictimChecker()
    cc = marconi_cache(alpha=0.7, observer=checker, kv_size=2400, mamba_size=10, max_num_reqs=2)
    checker.cc = cc

    def after(k):
        if k == 40:
            cc.settings.choice = 3.0  # a tuner may change alpha at any time
    serve(cc, Workload(7), 80, after)
    assert checker.checked[KV_PRESSURE] >= 20 and checker.checked[MAMBA_PRESSURE] >= 20, checker.checked
    assert checker.kinds["single_child"] > 0 and checker.kinds["leaf"] > 0
    assert cc.settings.counters.stale_repairs == 0


# -- (3) a long, valuable prefix survives where LRU evicts it -----------------------------------

def _long_prefix_then_fillers(cc, seed=3):
    rng = random.Random(seed)
    doc = [rng.randrange(1, VOCAB) for _ in range(1500)]
    run_request(cc, doc, 1)  # a long document, cached first (so it is the oldest)
    for _ in range(20):  # short unrelated requests that overflow the KV pool
        run_request(cc, [rng.randrange(1, VOCAB) for _ in range(100)], 2)
    cc.check_no_leak()
    _, hit = run_request(cc, doc + [rng.randrange(1, VOCAB) for _ in range(50)], 1)
    return hit


def test_large_alpha_keeps_long_prefix_that_lru_evicts(marconi_cache, upstream_cache):
    sizes = dict(kv_size=2600, mamba_size=64, max_num_reqs=2)
    assert _long_prefix_then_fillers(upstream_cache(**sizes)) == 0
    assert _long_prefix_then_fillers(marconi_cache(alpha=0.0, **sizes)) == 0
    marconi = marconi_cache(alpha=5.0, **sizes)
    assert _long_prefix_then_fillers(marconi) == 1500
    assert marconi.settings.counters.evictions_leaf > 0


# -- (4) alpha = 0 is LRU over the same candidates ----------------------------------------------

def test_alpha_zero_is_lru_over_the_candidates(marconi_cache):
    checker = VictimChecker(lru_only=True)
    cc = marconi_cache(alpha=0.0, observer=checker, kv_size=2400, mamba_size=10, max_num_reqs=2)
    checker.cc = cc
    serve(cc, Workload(11), 60)
    assert checker.checked[KV_PRESSURE] >= 20 and checker.checked[MAMBA_PRESSURE] >= 20, checker.checked


def _tree_paths(cc):
    paths, stack = set(), [(cc.tree_core.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = prefix + tuple(child.key.token_ids)
            paths.add((path, child.component_data[MAMBA].value is not None))
            stack.append((child, path))
    return paths


def test_alpha_zero_evicts_what_upstream_evicts_under_kv_pressure(marconi_cache, upstream_cache):
    # Mamba slots to spare: only KV pressure, where SGLang's own walk is LRU over the same leaves.
    sizes = dict(kv_size=2400, mamba_size=400, max_num_reqs=2)
    ours, theirs = marconi_cache(alpha=0.0, **sizes), upstream_cache(**sizes)
    w_ours, w_theirs = Workload(5), Workload(5)
    for _ in range(50):
        assert serve(ours, w_ours, 1) == serve(theirs, w_theirs, 1)
        assert _tree_paths(ours) == _tree_paths(theirs)
    assert ours.settings.counters.evictions_leaf > 10
    assert ours.settings.counters.evictions_single_child == 0


# -- (5) tombstoning a single-child node's state keeps its KV -----------------------------------

def test_single_child_state_eviction_keeps_kv_matchable(marconi_cache):
    victims = []
    cc = marconi_cache(alpha=0.0, observer=victims.append, kv_size=4096, mamba_size=16, max_num_reqs=2)
    rng = random.Random(4)
    first = [rng.randrange(1, VOCAB) for _ in range(300)]
    second = first + [rng.randrange(1, VOCAB) for _ in range(200)]
    run_request(cc, first, 1)
    _, hit = run_request(cc, second, 1)  # continues `first`: its node gets one child
    assert hit == 300
    root = cc.tree_core.root_node
    (x,) = root.children.values()
    (y,) = x.children.values()
    assert len(x.key) == 300 and len(y.key) == 200
    assert x.component_data[MAMBA].value is not None and y.component_data[MAMBA].value is not None
    kv_before, (m_free, m_evictable, _) = cc.kv_ledger(), cc.mamba_ledger()

    result = cc.cache.evict(EvictParams(num_tokens=0, mamba_num=1))

    assert result.mamba_num_evicted == 1 and result.num_tokens_evicted == 0
    assert [(v.pressure, v.kind, v.node) for v in victims] == [(MAMBA_PRESSURE, "single_child", x)]
    assert alive(cc, x) and x.component_data[FULL].value is not None  # KV kept
    assert x.component_data[MAMBA].value is None  # state tombstoned
    assert cc.kv_ledger() == kv_before
    assert cc.mamba_ledger()[:2] == (m_free + 1, m_evictable - 1)
    assert cc.settings.counters.evictions_single_child == 1
    cc.cache.marconi.index.check()
    # a deeper hit still reads x's KV ...
    _, hit = run_request(cc, second + [rng.randrange(1, VOCAB) for _ in range(30)], 1)
    assert hit == 500
    # ... while a hit ending at x is gone with its state
    _, hit = run_request(cc, first + [rng.randrange(1, VOCAB) for _ in range(30)], 1)
    assert hit == 0
    cc.check_no_leak()


# -- liveness, reset, import hygiene -------------------------------------------------------------

def test_mamba_pressure_without_candidates_falls_back_to_upstreams_choice(marconi_cache):
    victims = []
    cc = marconi_cache(alpha=1.0, observer=victims.append, kv_size=4096, mamba_size=16, max_num_reqs=2)
    rng = random.Random(6)
    stem = [rng.randrange(1, VOCAB) for _ in range(200)]
    run_request(cc, stem, 1)
    run_request(cc, stem + [rng.randrange(1, VOCAB) for _ in range(50)], 1)
    run_request(cc, stem + [rng.randrange(1, VOCAB) for _ in range(60)], 1)
    (x,) = cc.tree_core.root_node.children.values()
    assert len(x.children) == 2 and x.component_data[MAMBA].value is not None
    locks = [cc.cache.lock(y.id) for y in x.children.values()]  # both branches in use
    # x has two children and its branches are locked: no Marconi candidate, yet a slot is needed
    result = cc.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert result.mamba_num_evicted == 1
    assert [(v.pressure, v.kind, v.node) for v in victims] == [(MAMBA_PRESSURE, "fallback", x)]
    assert x.component_data[MAMBA].value is None and x.component_data[FULL].value is not None
    assert all(y.component_data[MAMBA].value is not None for y in x.children.values())
    for lock in locks:
        cc.cache.unlock(lock)
    cc.check_no_leak()
    cc.cache.marconi.index.check()


def test_index_follows_a_cache_reset(marconi_cache):
    cc = marconi_cache(alpha=1.0, kv_size=1500, mamba_size=8, max_num_reqs=2)
    workload = Workload(9)
    serve(cc, workload, 15)
    cc.cache.reset()  # Scheduler.flush_cache
    cc.req_to_token_pool.clear()
    cc.allocator.clear()
    cc.req_to_token_pool.reset_aux_cache_allocator()
    cc.check_no_leak()
    serve(cc, workload, 25, after=lambda k: cc.cache.marconi.index.check())
    assert cc.settings.counters.evictions_leaf > 0 and cc.settings.counters.stale_repairs == 0


def test_importing_the_components_module_loads_no_sglang():
    import subprocess
    import sys

    code = (
        "import sys, sglang_marconi.serving, sglang_marconi.serving.components,"
        " sglang_marconi.serving.eviction_settings as m, sglang_marconi.serving.tree_index;"
        "m.MarconiEvictionSettings('nemotron-h-8b', choice=0.5);"
        "print(sorted(x for x in sys.modules if x.split('.')[0] in ('torch', 'sglang')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- (5) tuning's "lru" choice is SGLang's own LRU ----------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_lru_choice_evicts_exactly_as_upstream(marconi_cache, upstream_cache, seed):
    # With SGLang's LRU chosen, KV pressure is served by the index at alpha 0 and Mamba pressure
    # by upstream's walk; over upstream's admission this must reproduce upstream hit for hit.
    victims = []
    sizes = dict(kv_size=2400, mamba_size=10, max_num_reqs=2)
    ours = marconi_cache(alpha=1.0, observer=victims.append, **sizes)
    ours.settings.choice = "lru"
    theirs = upstream_cache(**sizes)
    hits_ours = serve(ours, Workload(seed), 80, after=lambda k: ours.cache.marconi.index.check())
    hits_theirs = serve(theirs, Workload(seed), 80)
    assert hits_ours == hits_theirs and sum(hits_ours) > 0
    assert (ours.kv_ledger(), ours.mamba_ledger()) == (theirs.kv_ledger(), theirs.mamba_ledger())
    assert victims and all(v.pressure == KV_PRESSURE and v.weight == 0.0 for v in victims)
    assert ours.settings.counters.stale_repairs == 0


@pytest.mark.parametrize("admission", [True, False])
def test_index_upkeep_after_each_release_with_marconi_admission(admission):
    # With Marconi's admission the index is brought up to date when a request is released (off
    # the next allocation's path); with upstream's admission it is left to the next eviction.
    from sglang_cpu import build_marconi_serving

    from sglang_marconi.serving.config import MarconiServingConfig

    cc, runtime = build_marconi_serving(MarconiServingConfig(alpha=0.5, admission=admission),
                                        kv_size=2400, mamba_size=10, max_num_reqs=2)
    index, pending = cc.cache.marconi.index, []
    serve(cc, Workload(0), 40, after=lambda k: pending.append(len(index._dirty) + len(index._struct)))
    assert index.root is not None  # bound at the first eviction
    assert (max(pending[-20:]) == 0) == admission, pending[-20:]
    index.check()
    assert runtime.settings.counters.stale_repairs == 0


def test_nothing_is_recorded_before_the_first_eviction(marconi_cache):
    # A cache that never evicts must not hold on to every node it ever touched.
    cc = marconi_cache(alpha=1.0, kv_size=200_000, mamba_size=400, max_num_reqs=2)
    index = cc.cache.marconi.index
    serve(cc, Workload(3), 40)
    assert index.root is None and not index._dirty and not index._struct
    cc.cache.evict(EvictParams(num_tokens=500))  # the first eviction binds the index
    assert index.root is not None
    index.check()
