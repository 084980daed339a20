"""Each rule the server calls is written once: replacing its one implementation with a mutant
changes the simulator's model of the served cache (`policy/tree/served_cache.ServedCache`) and
SGLang's real cache with the `marconi` backend (its components and admission on CPU) alike,
request by request.

Rules: the eviction score (`policy/rules/score.scorer`), the value (Eq. 1,
`policy/rules/value.flops_saved_per_byte`) and the compressed-tree anchor the value counts from
(`policy/rules/value.anchor_end`). For each, one trace on tight pools (every request evicts) is
replayed through both caches, unmutated and under the mutant: the mutant must change some
request's hit (else it proves nothing), and both caches must report the same hits, request by
request, under it. `test_a_rule_patched_in_one_place_only_is_caught` shows that the comparison
can fail: a mutant patched into the simulator's binding only makes the two disagree.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang_cpu import build_marconi_serving, run_request  # noqa: E402

from sglang_marconi.policy.cost.model_profile import load_profile  # noqa: E402
from sglang_marconi.policy.rules import score  # noqa: E402
from sglang_marconi.policy.rules import value as value_rule  # noqa: E402
from sglang_marconi.policy.tree import served_cache  # noqa: E402
from sglang_marconi.policy.tree.served_cache import ServedCache  # noqa: E402
from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402
from sglang_marconi.serving.runtime import served_pools  # noqa: E402
from sglang_marconi.serving.two_pass_prefill import (  # noqa: E402
    install_two_pass_prefill_hook,
    uninstall_two_pass_prefill_hook,
)
from sglang_marconi.sim.synthetic import generate  # noqa: E402

PROFILE = load_profile("nemotron-h-8b")
# Tight pools: KV and Mamba pressure on most requests; a FLOP-aware choice that weighs value.
KV_TOKENS, MAMBA_SLOTS, ALPHA = 3000, 8, 2.0


@pytest.fixture(scope="module")
def requests():
    return list(generate("lmsys", sessions=8, scale=0.1, seed=1))


@pytest.fixture(scope="module", autouse=True)
def two_pass_prefill():
    install_two_pass_prefill_hook(apply_now=True)  # what the plugin registers in a scheduler
    yield
    uninstall_two_pass_prefill_hook()


def replay(requests):
    """Per-request hits of SGLang's cache (Marconi's components) and of the simulator's model."""
    config = MarconiServingConfig(alpha=ALPHA, probation=True, tune_workers=0)
    longest = max(r.input_len + r.output_len for r in requests)
    cc, runtime = build_marconi_serving(config, profile=PROFILE, kv_size=KV_TOKENS, mamba_size=MAMBA_SLOTS,
                                        max_num_reqs=2, max_context_len=max(4096, 2 * longest))
    sim = ServedCache(PROFILE, served_pools(cc.cache, config), ALPHA, probation=True)
    served, simulated = [], []
    try:
        for r in requests:
            _, hit = run_request(cc, r.input_tokens.tolist(), r.output_len, out_tokens=r.output_tokens.tolist(),
                                 chunk_end=chunk_end_for_branch, decode_at_once=True)
            served.append(hit)
            simulated.append(sim.serve(r.input_tokens, r.output_tokens).hit_tokens)
    finally:
        runtime.close()
    cc.check_no_leak()
    c = cc.settings.counters
    assert c.evictions_leaf + c.evictions_single_child > 0, "nothing evicted: the rules were never asked"
    return np.array(served), np.array(simulated)


@pytest.fixture(scope="module")
def unmutated(requests):
    served, simulated = replay(requests)
    assert np.array_equal(served, simulated), first_difference(served, simulated)
    return served


def first_difference(a, b) -> str:
    differ = np.flatnonzero(a != b)
    return "identical" if not differ.size else f"request {differ[0]}: {a[differ[0]]} vs {b[differ[0]]} ({differ.size} differ)"


# -- the mutants: each changes the rule, not the code around it ---------------------------------

def value_first(original):
    """Score: the value's weight reversed (the most valuable candidate goes first)."""
    def scorer(s):
        return original(s._replace(w_e=-s.w_e) if s.w_e else s)
    return scorer


def flops_not_per_byte(original):
    """Eq. 1 without its denominator's KV: a leaf's freed KV no longer lowers its value."""
    def flops_saved_per_byte(flops, state_bytes, leaf_kv_bytes=0):
        return original(flops, state_bytes, 0)
    return flops_saved_per_byte


def uncompressed(original):
    """The anchor is always the parent: the paper's compression of single-child chains forgotten."""
    def anchor_end(node, root, is_anchor, end_of):
        return end_of(node.parent)
    return anchor_end


MUTANTS = {
    "score": (score, "scorer", value_first),
    "value": (value_rule, "flops_saved_per_byte", flops_not_per_byte),
    "anchor": (value_rule, "anchor_end", uncompressed),
}


@pytest.mark.parametrize("rule", list(MUTANTS))
def test_a_mutant_rule_changes_simulator_and_server_alike(requests, unmutated, monkeypatch, rule):
    module, name, mutant = MUTANTS[rule]
    monkeypatch.setattr(module, name, mutant(getattr(module, name)))
    served, simulated = replay(requests)
    assert not np.array_equal(served, unmutated), f"the {rule} mutant changed no hit: it proves nothing"
    assert np.array_equal(served, simulated), f"{rule} mutant: served vs simulated: {first_difference(served, simulated)}"


def test_a_rule_patched_in_one_place_only_is_caught(requests, unmutated, monkeypatch):
    """The anchor mutant given to the simulator's model alone (a private copy of the rule, as the
    server's and the simulator's were before): the two caches part ways, which the test above
    would report."""
    private = types.SimpleNamespace(**{k: getattr(value_rule, k) for k in ("flops_saved_per_byte", "end_position")},
                                    anchor_end=uncompressed(value_rule.anchor_end))
    monkeypatch.setattr(served_cache, "value_rule", private)
    served, simulated = replay(requests)
    assert np.array_equal(served, unmutated)  # the server's rule is untouched
    assert not np.array_equal(served, simulated), "a rule changed on one side only went unnoticed"
