"""Leak and lock invariants of the whole Marconi serving cache (admission + FLOP-aware eviction +
runtime) under randomized request sequences that force evictions, in both buffer modes."""

import random

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, build_marconi_serving, run_request  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402

PREFIXES = [list(range(1, 301)), list(range(1, 151)) + list(range(2000, 2150)), list(range(5000, 5600))]


@pytest.mark.parametrize("extra_buffer", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_leak_and_locked_nodes_survive(extra_buffer, seed):
    rng = random.Random(seed)
    probation = seed == 0  # seed 1: Marconi's two states only
    config = MarconiServingConfig(alpha=rng.choice([0.0, 0.8, 2.0]), probation=probation)
    cc, runtime = build_marconi_serving(config, kv_size=3500, mamba_size=24 if extra_buffer else 14,
                                        extra_buffer=extra_buffer)
    locked = None
    for i in range(45):
        prefix = rng.choice(PREFIXES)
        tokens = prefix[: rng.randint(50, len(prefix))] + [rng.randint(10_000, 10_050) for _ in range(rng.randint(1, 200))]
        admission = cc.cache.marconi.admission if i else None
        on_probation = admission.probationary_admitted if admission else 0
        before = sum(1 for n in cc.nodes() if n.component_data[MAMBA].value is not None)
        run_request(cc, tokens, rng.randint(1, 40), chunk_size=rng.choice([None, 128]), chunk_end=chunk_end_for_branch)
        cc.check_no_leak()  # available + evictable + protected == pool size, KV tokens and Mamba slots
        after = sum(1 for n in cc.nodes() if n.component_data[MAMBA].value is not None)
        admission = cc.cache.marconi.admission
        probationary = admission.probationary_admitted - on_probation
        from sglang_marconi.policy.rules.backtrack_states import default_setting

        # at most one at the end of the input, plus the backtrack states' bound (on in extra_buffer)
        assert probationary <= int(probation) * (1 + default_setting(extra_buffer))
        assert after - before <= 2 + probationary  # Marconi's two (branch and final), plus them
        for node in cc.cache.marconi.probation:  # every entry is a live state: gone ones are forgotten
            assert cc.cache.tree_core._node_arena.get(node.id) is node and node.component_data[MAMBA].value is not None
        if locked is None and i == 10:
            node = next(n for n in cc.nodes() if n.component_data[MAMBA].value is not None and not n.children)
            locked = (node, cc.cache.lock(node.id), node.component_data[MAMBA].value.clone())
        if locked is not None:  # a locked node keeps its KV and its state through every eviction
            node = locked[0]
            assert node.parent is not None and node.component_data[MAMBA].value is not None
            assert (node.component_data[MAMBA].value == locked[2]).all()
    counters = runtime.settings.counters
    assert counters.evictions_leaf + counters.evictions_single_child + counters.evictions_probationary > 0  # evictions happened
    cc.cache.unlock(locked[1])
    cc.check_no_leak()
