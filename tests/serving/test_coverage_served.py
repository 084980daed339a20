"""SGLang PR #38000's coverage rule served (`--marconi-eviction coverage`: Marconi's admission, the
state covering the fewest tree positions evicted first, ties to the least recently used) inside
SGLang's real UnifiedRadixCache on CPU, through the scheduler's calls.

The rule lives once, in the policy core (`policy/rules/eviction/coverage.py`); the served index only
keeps its value column current. Checked here: the index equals a from-scratch evaluation after
every request while the coverage of a state changes with what is inserted and evicted below it;
every Mamba-pressure victim is the brute-force minimum over SGLang's tree (an evaluation written
here, independent of the policy core's); the PR's case: a chain thinned from its deep end so
that a fork at its shallow state still hits, where LRU over the same candidates loses it; and the
simulator's model of the served cache under the same rule (`ServedCache`, choice `coverage`),
request by request (`scripts/check_sim_vs_served.py`), fixed and as the served tuner adopts it
(its choices carry coverage: `shadow_tuner.served_config`), on the chain / fan-out stress
(`sim/stress.chain_fanout`), where coverage keeps the shallow states of long chains that later
fan-outs come back to.
"""

import random

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, run_request  # noqa: E402
from test_sglang_eviction import Workload, serve  # noqa: E402

from sglang_marconi.serving.eviction_settings import MAMBA_PRESSURE  # noqa: E402
from sglang_marconi.policy.cost.model_profile import load_profile  # noqa: E402
from sglang_marconi.policy.tree.served_cache import ServedPools  # noqa: E402
from sglang_marconi.sim.baselines.served import ServedPolicy  # noqa: E402
from sglang_marconi.sim.stress import chain_fanout  # noqa: E402

VOCAB = 1 << 30


def coverage_by_brute_force(cc) -> dict:
    """{node: (recency, positions covered)} for every Mamba-pressure candidate of SGLang's tree."""
    root = cc.tree_core.root_node

    def has_state(n):
        return n.component_data[MAMBA].value is not None

    def uncovered(n):  # positions below n whose nearest state at or above them is n's
        total = 0
        for child in n.children.values():
            total += len(child.key) - 1 if has_state(child) else len(child.key) + uncovered(child)
        return total

    leaves = set(cc.tree_core.evictable_device_leaves)
    out, stack = {}, list(root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if has_state(n) and n.component_data[MAMBA].lock_ref == 0 and (n in leaves or len(n.children) == 1):
            out[n] = (float(getattr(n, "_marconi_state_time", n.last_access_time)), 1 + uncovered(n))
    return out


class CoverageChecker:
    def __init__(self):
        self.cc = None
        self.checked = 0
        self.single_child = 0

    def __call__(self, victim):
        if victim.pressure != MAMBA_PRESSURE or victim.kind in ("fallback", "probationary"):
            return
        candidates = coverage_by_brute_force(self.cc)
        assert victim.node in candidates
        least = min(c for _, c in candidates.values())
        ties = [n for n, (_, c) in candidates.items() if c == least]
        oldest = min(ties, key=lambda n: candidates[n][0])
        assert candidates[victim.node][1] == least, (candidates[victim.node], least)
        assert victim.node is oldest, (candidates[victim.node], candidates[oldest])
        self.checked += 1
        self.single_child += victim.kind == "single_child"


@pytest.mark.parametrize("seed", [0, 1])
def test_index_stays_exact_and_every_victim_covers_least(marconi_cache, seed):
    checker = CoverageChecker()
    cc = marconi_cache(alpha="coverage", observer=checker, kv_size=2400, mamba_size=10, max_num_reqs=2)
    checker.cc = cc
    index = cc.cache.marconi.index

    def after(_):
        cc.check_no_leak()
        if index.bound:
            index.check()  # coverage reaches up: a change below a state re-scores it

    serve(cc, Workload(seed), 70, after)
    assert index.value_kind == "coverage"
    assert checker.checked >= 10 and checker.single_child > 0, (checker.checked, checker.single_child)
    assert cc.settings.counters.stale_repairs == 0


def _fork_after_a_chain(cc, seed=5) -> int:
    """A document, a conversation that extends it four turns (a chain of states), unrelated
    requests that press on the Mamba pool, then a fork at the document's end: its hit."""
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    doc = tokens(400)
    run_request(cc, doc, 1)  # the document alone: its state at 400
    history = doc
    for _ in range(4):
        history = history + tokens(60)
        run_request(cc, history, 1)
    for _ in range(5):
        run_request(cc, tokens(80), 1)
    cc.check_no_leak()
    _, hit = run_request(cc, doc + tokens(30), 1)
    return hit


def test_a_fork_at_a_thinned_chain_hits_where_lru_loses_it(marconi_cache):
    """Coverage evicts the chain's deep end first (a leaf covers one position), so the document's
    state, the oldest, outlives the pressure; LRU over the same candidates evicts it first."""
    sizes = dict(kv_size=20_000, mamba_size=8, max_num_reqs=2)  # pressure: 3-5 states go (LRU: 0 from 10 on)
    coverage = marconi_cache(alpha="coverage", **sizes)
    lru = marconi_cache(alpha=0.0, **sizes)
    assert _fork_after_a_chain(coverage) == 400
    assert _fork_after_a_chain(lru) < 400
    assert coverage.settings.counters.evictions_leaf + coverage.settings.counters.evictions_single_child > 0


def test_the_flag_fixes_the_choice_and_turns_tuning_off():
    import argparse

    from sglang_marconi.serving.config import add_marconi_args, config_from_args

    parser = argparse.ArgumentParser()
    add_marconi_args(parser)
    config = config_from_args(parser.parse_args(["--marconi-eviction", "coverage"]))
    assert config.fixed_choice == "coverage" and config.eviction == "coverage"
    assert config_from_args(parser.parse_args([])).fixed_choice is None  # the default: tuned online
    with pytest.raises(SystemExit):  # argparse names the bad value and the choices, in one line
        parser.parse_args(["--marconi-eviction", "belady"])


def test_settings_name_the_rule():
    from sglang_marconi.serving.eviction_settings import MarconiEvictionSettings

    settings = MarconiEvictionSettings("nemotron-h-8b", choice="coverage")
    assert (settings.kind, settings.weight, settings.value_kind, settings.label) == ("coverage", 0.0, "coverage", "coverage")
    assert not settings.use_upstream_lru and settings.alpha == 0.0


def test_the_backend_as_built_serves_coverage_untuned():
    """What `--radix-cache-backend marconi --marconi-eviction coverage` builds (components,
    admission, runtime): the coverage rule in force, no tuner, and it stays so past sync points."""
    from sglang_cpu import build_marconi_serving

    from sglang_marconi.serving.config import MarconiServingConfig

    cc, runtime = build_marconi_serving(MarconiServingConfig(eviction="coverage", tune_sync_every=4),
                                        kv_size=2400, mamba_size=10, max_num_reqs=2)
    serve(cc, Workload(4), 30)
    assert runtime.settings.kind == "coverage" and runtime.tuner is None
    assert cc.cache.marconi.index.value_kind == "coverage"
    assert runtime.settings.counters.evictions_leaf + runtime.settings.counters.evictions_single_child > 0
    runtime.close()


# The simulator's model of the served cache under coverage, request by request.
KV_TOKENS, MAMBA_SLOTS, CHUNK = 10_000, 24, 512  # tight: most requests evict under one pressure or both


@pytest.fixture(scope="module")
def check():
    from test_sim_equivalence import _check_script

    return _check_script()


@pytest.fixture(scope="module")
def stress_requests():
    return list(chain_fanout(300))


def test_fixed_coverage_is_the_model_request_by_request(check, stress_requests):
    report = check.run(stress_requests, "nemotron-h-8b", KV_TOKENS, MAMBA_SLOTS, "extra_buffer", CHUNK, "coverage",
                       workload_name="coverage-stress-xbuf")
    print("\n".join(report.lines()))
    assert report.ok and report.agree == report.requests, "\n".join(report.lines())
    # the rule is in force: the model under LRU's choice hits otherwise on the same pools
    pools = ServedPools(KV_TOKENS, MAMBA_SLOTS, "extra_buffer", CHUNK)
    lru = ServedPolicy("lru", load_profile("nemotron-h-8b"), pools, "lru")
    assert sum(lru.serve(r).hit_tokens for r in stress_requests) != report.served_hits


def test_the_tuned_server_adopts_coverage_where_the_model_does(check, stress_requests):
    report = check.run(stress_requests, "nemotron-h-8b", KV_TOKENS, MAMBA_SLOTS, "no_buffer", CHUNK, "auto",
                       workload_name="coverage-stress-nobuf-auto", sync_every=32)
    print("\n".join(report.lines()))
    assert report.ok and report.agree == report.requests, "\n".join(report.lines())
    served, simulated = report.config["served_choices"], report.config["sim_choices"]
    assert served == simulated and "coverage" in [choice for _, choice in served], served
