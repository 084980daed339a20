"""One byte budget (`--enable-unified-memory`): victims across kinds, and the shadow tuner's budget.

SGLang's real tree on CPU (`sglang_cpu.build_cache`, Marconi's components). With the index's
`byte_budget` set, as `serving/unified_memory.py` sets it for a Mamba byte shortfall, the FULL walk
picks each victim over the union of the KV leaves and the SSM-state candidates by Marconi's
utility (FLOPs saved per byte freed, with recency), checked against a brute-force evaluation.
The live server under `--enable-unified-memory` is `tests/server/test_live_unified_memory.py`.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang_cpu import FULL, MAMBA, run_request  # noqa: E402
from test_sglang_eviction import VOCAB, Workload, alive, brute_force, serve, utilities  # noqa: E402

from sglang_marconi.policy.cost.model_profile import load_profile  # noqa: E402
from sglang_marconi.serving.cache_state import EvictionWalk, marconi_evict_params  # noqa: E402
from sglang_marconi.serving.eviction_settings import BYTE_PRESSURE, KV_PRESSURE, MAMBA_PRESSURE  # noqa: E402,F401
from sglang_marconi.serving.runtime import shadow_budget  # noqa: E402


class UnionChecker:
    """Observer: each victim of a byte-budget walk is the lowest utility over both kinds."""

    def __init__(self):
        self.cc = None
        self.kinds = {"leaf": 0, "single_child": 0, "fallback": 0, "probationary": 0}

    def __call__(self, victim):
        if victim.pressure != BYTE_PRESSURE:  # a Mamba-ID walk: Mamba candidates only, as before
            return
        self.kinds[victim.kind] += 1
        union = {}
        for pressure in (KV_PRESSURE, MAMBA_PRESSURE):
            for node, value in brute_force(self.cc, pressure).items():
                union[(pressure, node)] = value
        scores = utilities(union, victim.weight)
        best = min(scores.values())
        mine = min(s for (p, n), s in scores.items() if n is victim.node)
        assert mine <= best + 1e-9, (victim.kind, mine, best)


def every_walk_funds_bytes():
    """The Marconi cache with every eviction call treated as a byte shortfall (the rule's check;
    SGLang's own unified-memory path is in tests/server/test_live_unified_memory.py)."""
    from sglang_marconi.serving.cache import marconi_cache_class

    class EveryWalkFundsBytes(marconi_cache_class()):
        def _marconi_walk_for(self, params, allocation_reclaim_satisfied):
            return EvictionWalk(byte_budget=True)

    return EveryWalkFundsBytes


def test_a_byte_shortfall_tombstones_the_cheapest_state_before_deleting_a_leaf(marconi_cache):
    victims = []
    cc = marconi_cache(alpha=0.0, observer=victims.append, kv_size=4096, mamba_size=16, max_num_reqs=2)
    rng = random.Random(4)
    first = [rng.randrange(1, VOCAB) for _ in range(300)]
    second = first + [rng.randrange(1, VOCAB) for _ in range(200)]
    run_request(cc, first, 1)
    run_request(cc, second, 1)  # x (300 tokens, state) -> y (200 tokens, state, leaf)
    (x,) = cc.tree_core.root_node.children.values()
    (y,) = x.children.values()
    index = cc.cache.marconi.index
    # x's state is the least recently used candidate of either kind (alpha 0): a byte shortfall
    # takes its bytes first (KV kept), where a KV walk could only delete leaf y.
    assert index.choose_across(0.0) is x
    cc.cache.evict(marconi_evict_params(num_tokens=1, walk=EvictionWalk(byte_budget=True)))
    assert [(v.pressure, v.kind, v.node) for v in victims] == [
        (BYTE_PRESSURE, "single_child", x), (BYTE_PRESSURE, "leaf", y)]
    assert alive(cc, x) and x.component_data[FULL].value is not None and x.component_data[MAMBA].value is None
    index.check()
    cc.check_no_leak()


@pytest.mark.parametrize("alpha", [0.0, 0.7, 5.0])
def test_byte_budget_victims_are_the_lowest_utility_over_both_kinds(marconi_cache, alpha):
    checker = UnionChecker()
    cc = marconi_cache(alpha=alpha, observer=checker, kv_size=2400, mamba_size=10, max_num_reqs=2,
                       cache_class=every_walk_funds_bytes())
    checker.cc = cc
    serve(cc, Workload(11), 50)
    assert checker.kinds["leaf"] + checker.kinds["single_child"] > 20, checker.kinds  # the check ran
    assert cc.settings.counters.stale_repairs == 0
    cc.cache.marconi.index.check()
    cc.check_no_leak()


def test_shadow_budget_is_one_byte_budget_under_unified_memory():
    profile = load_profile("nemotron-h-8b")
    two_pools = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(size=1000),
                                req_to_token_pool=SimpleNamespace(mamba_pool=SimpleNamespace(size=24)))
    assert shadow_budget(two_pools, profile) == (int(1000 * profile.kv_bytes_per_token), 24)
    # A unified allocator: `size` moves with the Mamba band; the budget is the whole buffer in KV
    # tokens (`size_full`), and no separate slot count.
    unified = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(unified_buffer=object(), size=10,
                                                                        size_full=5000),
                              req_to_token_pool=None)
    assert shadow_budget(unified, profile) == (int(5000 * profile.kv_bytes_per_token), None)
