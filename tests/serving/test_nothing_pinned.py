"""Nothing pinned, nothing displaced (SGLang's real cache on CPU, the `marconi` backend as served):

- Every per-node entry Marconi keeps (probationary states, the eviction index) goes when its node
  or its state goes, on every path: leaves deleted under KV pressure, states tombstoned under
  Mamba pressure, a reset. After 500 one-shot requests under KV-only pressure, and again under
  Mamba-only pressure, the tree-node objects alive exceed the tree's nodes by fewer than 32
  (probation used to keep every one-shot request's input-end node alive under KV pressure).
- Under one byte budget (SGLang's `--enable-unified-memory` pools, its own `evict_for_alloc`), a
  probationary state goes only into free bytes or bytes freed from other probationary states: its
  reservation never deletes a KV leaf or evicts a regular state (SGLang's FULL donor walk used
  to, and the free-slot check counted slot ids, not bytes).
"""

import gc
import random

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, build_marconi_serving, run_request  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch, free_mamba_slots  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402

PRESSURES = {  # pools that make one resource scarce and leave the other ample
    "kv": dict(kv_size=1200, mamba_size=400),
    "mamba": dict(kv_size=400_000, mamba_size=6),
}


def node_objects():
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeNode

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, UnifiedTreeNode))


def one_shots(cc, n, seed):
    rng = random.Random(seed)
    for i in range(n):
        tokens = [rng.randrange(10_000, 1 << 30) for _ in range(rng.randrange(60, 160))]
        run_request(cc, tokens, rng.randrange(1, 8), chunk_end=chunk_end_for_branch)
    cc.check_no_leak()


@pytest.mark.parametrize("pressure", sorted(PRESSURES))
def test_no_node_outlives_the_tree(pressure):
    baseline = node_objects()
    cc, runtime = build_marconi_serving(MarconiServingConfig(alpha=1.0), max_num_reqs=2, **PRESSURES[pressure])
    one_shots(cc, 500, seed=1)
    counters = runtime.settings.counters
    if pressure == "kv":
        assert counters.evictions_leaf > 300 and runtime.figures.evicted_states > 0
        assert cc.cache.marconi.admission.probationary_admitted > 300  # each one-shot's input end
    else:  # Mamba slots short: states go (their leaves whole), probationary ones first
        assert runtime.figures.evicted_states > 300 and counters.evictions_probationary > 0
    in_tree = len(cc.nodes()) + 1  # and the root
    alive = node_objects() - baseline
    assert alive - in_tree < 32, (alive, in_tree)
    assert all(node in cc.nodes() for node in cc.cache.marconi.probation)
    cc.cache.reset()  # a flush drops every entry with the tree
    assert len(cc.cache.marconi.probation) == 0 and not cc.cache.marconi.index.bound
    runtime.close()


def regular_states_and_leaves(cc):
    probation = cc.cache.marconi.probation
    states = {n.id for n in cc.nodes() if n.component_data[MAMBA].value is not None and n not in probation}
    leaves = {n.id for n in cc.nodes() if not n.children and n not in probation}  # regular KV leaves
    return states, leaves


@pytest.mark.parametrize("mutant", [False, True])
def test_a_probationary_state_never_displaces_anything_under_one_byte_budget(monkeypatch, mutant):
    """Mutant: the FULL walk ignores the reservation's limit (the old behaviour); the same check
    then sees KV leaves deleted for a probationary state, so the check can fail."""
    from sglang_marconi.serving.unified_memory import one_budget_cache_class

    cc, runtime = build_marconi_serving(MarconiServingConfig(alpha=1.0), kv_size=1800, mamba_size=8, max_num_reqs=2,
                                        unified_memory=True, cache_class=one_budget_cache_class())
    component = cc.cache.components[MAMBA]
    reservations = []
    reserve = component._marconi_reserve_slot

    def watched(probation_only=False):
        before, room = regular_states_and_leaves(cc), free_mamba_slots(cc.req_to_token_pool.mamba_allocator)
        granted = reserve(probation_only=probation_only)
        if probation_only:
            after = regular_states_and_leaves(cc)
            reservations.append((room, granted, before[0] - after[0], before[1] - after[1]))
        return granted

    monkeypatch.setattr(component, "_marconi_reserve_slot", watched)
    if mutant:
        from sglang_marconi.serving.cache_state import ANY_WALK

        monkeypatch.setattr(type(cc.cache.marconi), "walk", property(lambda self: ANY_WALK, lambda self, v: None))
    rng = random.Random(3)
    shared = [rng.randrange(10_000, 1 << 30) for _ in range(200)]
    for i in range(120):
        head = shared if i % 3 == 0 else []
        tokens = head + [rng.randrange(10_000, 1 << 30) for _ in range(rng.randrange(80, 220))]
        run_request(cc, tokens, rng.randrange(1, 8), chunk_end=chunk_end_for_branch)
        cc.check_no_leak()
    full = [r for r in reservations if r[0] == 0]  # no room for a state: something had to go, or nothing
    assert len(reservations) > 50 and len(full) > 10, "the buffer never filled: the test would prove nothing"
    displaced = [(states, leaves) for _, _, states, leaves in reservations if states or leaves]
    if mutant:
        assert displaced, "the check cannot tell a displacing reservation"
    else:
        assert not displaced, displaced[:3]
        assert runtime.settings.counters.evictions_probationary > 0  # probationary room was reused
    runtime.close()
