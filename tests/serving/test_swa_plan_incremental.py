"""Marconi's incremental SWA eviction plan (policy/rules/window_plan.py, kept by the hooks of
serving/swa_component.py) on SGLang's real SWA cache on CPU (`sglang_swa_cpu.py`):

- after any sequence of inserts (SWA KV partly freed, prefixes recovered), matches, locks (with
  early SWA release), unlocks and SWA evictions, every entry of the plan and its next victim
  equal the from-scratch reference (`WindowPlan.check`), and SGLang's pool ledgers balance;
- one eviction step reads a bounded number of tree nodes, whatever the tree's size (the cost
  counter `WindowPlan.visited`; speed itself is a benchmark's business:
  `scripts/bench_sglang_cache.py --tree-nodes`);
- under a flood of short unrelated requests the SWA window of a long shared prompt survives
  under Marconi and is lost under upstream's LRU, on the same request sequence.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

WINDOW = 8

ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 1 << 30)),
    st.tuples(st.just("match"), st.integers(0, 1 << 30)),
    st.tuples(st.just("lock"), st.integers(0, 1 << 30)),
    st.tuples(st.just("release_swa"), st.integers(0, 1 << 30)),
    st.tuples(st.just("unlock"), st.integers(0, 1 << 30)),
    st.tuples(st.just("evict"), st.integers(1, 40)),
), min_size=1, max_size=70)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([1.0, 0.0, 4.0]))
def test_incremental_plan_equals_the_reference_after_every_operation(operations, alpha):
    import random

    from sglang_swa_cpu import build_swa_cache

    cc = build_swa_cache(kv_size=4096, swa_size=160, window=WINDOW, alpha=alpha)
    assert cc.plan is not None and cc.plan.root is cc.tree_core.root_node
    inserted, locks = [], []
    for op, arg in operations:
        rng = random.Random(arg)
        if op == "insert" or not inserted:
            base = rng.choice(inserted) if inserted and rng.random() < 0.7 else []
            tokens = base[:rng.randrange(len(base) + 1)] + [rng.randrange(1, 5) for _ in range(rng.randrange(1, 24))]
            # Most requests keep the window before their end only (SGLang frees the rest as they run).
            evicted = max(0, len(tokens) - WINDOW - rng.randrange(4)) if rng.random() < 0.7 else 0
            if cc.allocator.swa_available_size() < len(tokens) + 1:
                cc.evict_swa(len(tokens) + 1 - cc.allocator.swa_available_size())
            if cc.allocator.swa_available_size() >= len(tokens) and cc.insert(tokens, evicted) is not None:
                inserted.append(tokens)
        elif op == "match":
            cc.match(rng.choice(inserted)[:rng.randrange(1, 30)])
        elif op == "lock" and len(locks) < 3:
            lock = cc.lock(rng.choice(inserted))
            if lock is not None:
                locks.append(lock)
        elif op == "release_swa" and locks:
            cc.release_swa(locks[rng.randrange(len(locks))])
        elif op == "unlock" and locks:
            cc.unlock(locks.pop(rng.randrange(len(locks))))
        elif op == "evict":
            cc.evict_swa(arg)
        cc.plan.check(alpha)
        cc.check_no_leak()
    for lock in locks:
        cc.unlock(lock)
    cc.plan.check(alpha)
    assert cc.settings.faulted is None, cc.settings.faulted


@pytest.mark.parametrize("requests", ["session_requests", "branch_requests"])
def test_an_eviction_step_reads_a_bounded_number_of_nodes_as_the_tree_grows(requests):
    import sglang_swa_cpu

    most = {}
    for nodes in (300, 1200, 4800):
        cc = sglang_swa_cpu.build_swa_cache(kv_size=80 * nodes + 4096, swa_size=40 * nodes + 4096, window=32)
        sglang_swa_cpu.grow_tree(cc, nodes, getattr(sglang_swa_cpu, requests)(32, seed=1))
        plan = cc.plan
        per_step = []
        for _ in range(60):
            before = plan.visited
            cc.evict_swa(1)
            per_step.append(plan.visited - before)
        most[nodes] = max(per_step)
        assert plan.root is cc.tree_core.root_node  # never rebuilt from the whole tree
        assert cc.settings.faulted is None
    # A whole-tree plan reads every node per step; this one a window's worth, at any size.
    assert most[4800] <= 32 and most[4800] <= most[300] + 8, most


def _shared_prompt_after_flood(marconi: bool, flood: int) -> tuple[int, int]:
    """Three users continue a long shared prompt (the second keeps the window before the branch
    point, as SGLang's branch insertion does), then `flood` short unrelated requests go through
    a small SWA pool. Returns the shared prompt's hit for a new user before and after."""
    from sglang_swa_cpu import build_swa_cache

    window = 32
    cc = build_swa_cache(kv_size=20_000, swa_size=400, window=window, marconi=marconi)
    counter = iter(range(1000, 1 << 40))

    def fresh(n):
        return [next(counter) for _ in range(n)]

    def request(tokens, cached):  # a finished request keeps the window before its end
        short = len(tokens) - cached - cc.allocator.swa_available_size()
        if short > 0:
            cc.evict_swa(short + 1)
        assert cc.insert(tokens, evicted=len(tokens) - window, cached=cached) is not None

    shared = fresh(6 * window)
    users = [shared + fresh(120) for _ in range(3)]
    request(users[0], 0)
    request(shared, len(shared) - window)
    for user in users[1:]:
        request(user, len(shared))
    before = cc.match(shared + [7]).device_prefix_len
    for _ in range(flood):
        request(fresh(40), 0)
    after = cc.match(shared + [7]).device_prefix_len
    cc.check_no_leak()
    if marconi:
        cc.plan.check(cc.settings.alpha)
    return before, after


@pytest.mark.parametrize("flood", [12, 60])
def test_a_shared_prompt_survives_a_flood_under_marconi_and_not_under_upstream(flood):
    shared = 6 * 32
    assert _shared_prompt_after_flood(marconi=True, flood=flood) == (shared, shared)
    assert _shared_prompt_after_flood(marconi=False, flood=flood) == (shared, 0)


def test_a_fault_in_the_plan_is_recovered_by_a_rebuild_from_the_tree(caplog):
    import sglang_swa_cpu

    cc = sglang_swa_cpu.build_swa_cache(kv_size=40_000, swa_size=20_000, window=32)
    sglang_swa_cpu.grow_tree(cc, 200, sglang_swa_cpu.session_requests(32, seed=2))
    plan = cc.plan
    original, calls = plan.next_victim, []

    def once(alpha):
        calls.append(alpha)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return original(alpha)

    plan.next_victim = once
    for _ in range(5):
        assert cc.evict_swa(8).swa_num_tokens_evicted >= 8
    assert cc.settings.faulted is None and cc.settings.faults.recovered_count == 1
    assert plan.root is not None  # rebuilt from the tree, still Marconi's
    plan.check(cc.settings.alpha)
    assert sum("Marconi fault" in r.getMessage() for r in caplog.records) == 1
    cc.check_no_leak()


def test_a_persistent_fault_in_the_plan_hands_eviction_to_upstream(caplog):
    import sglang_swa_cpu

    cc = sglang_swa_cpu.build_swa_cache(kv_size=40_000, swa_size=20_000, window=32)
    sglang_swa_cpu.grow_tree(cc, 200, sglang_swa_cpu.session_requests(32, seed=2))
    plan = cc.plan

    def broken(alpha):
        raise RuntimeError("injected")

    plan.next_victim = broken
    for _ in range(5):
        assert cc.evict_swa(8).swa_num_tokens_evicted >= 8  # upstream's walk frees what is asked
    assert "injected" in cc.settings.faulted
    assert plan.root is None  # no longer kept: the hooks are no-ops
    assert sum("Marconi fault" in r.getMessage() for r in caplog.records) == 2  # the rebuild, then the fallback
    cc.check_no_leak()
