"""The depth rule (`policy/rules/eviction/depth.py`) served by the `marconi` backend: SGLang's real
cache with our components and admission on CPU, under `--marconi-eviction depth:B|depth:auto`,
against the simulator's model of it (`ServedCache` under the same choice), request by request.

Both sides call the one rule (`DepthEviction.choose` -> `deepest_oldest`) over the same candidates
and feed their record of finished sequences (`rules/continuation.py`) at the same point of the
request stream with what each request's last insert kept. A mutant of the rule changes both alike;
a rule changed on one side only, or a record fed differently, makes them part ways.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang_cpu import build_marconi_serving, run_request  # noqa: E402

from sglang_marconi.policy.cost.model_profile import load_profile  # noqa: E402
from sglang_marconi.policy.rules.continuation import ContinuationRecord  # noqa: E402
from sglang_marconi.policy.rules.eviction import depth  # noqa: E402
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
KV_TOKENS, MAMBA_SLOTS = 3000, 8  # tight: most requests evict under one pressure or both


@pytest.fixture(scope="module")
def requests():
    return list(generate("lmsys", sessions=8, scale=0.1, seed=1))


REQUESTS_XBUF = list(generate("lmsys", sessions=8, scale=0.1, seed=2))


@pytest.fixture(scope="module", autouse=True)
def two_pass_prefill():
    install_two_pass_prefill_hook(apply_now=True)  # what the plugin registers in a scheduler
    yield
    uninstall_two_pass_prefill_hook()


def replay(requests, choice: str, strategy: str = "no_buffer"):
    """Per-request hits of SGLang's cache and of the simulator's model under `choice`, and the two
    records of finished sequences."""
    config = MarconiServingConfig(eviction=choice, probation=True, tune_workers=0)
    longest = max(r.input_len + r.output_len for r in requests)
    cc, runtime = build_marconi_serving(config, profile=PROFILE, kv_size=KV_TOKENS, mamba_size=MAMBA_SLOTS,
                                        max_num_reqs=2, max_context_len=max(4096, 2 * longest),
                                        extra_buffer=strategy == "extra_buffer")
    assert cc.settings.choice == choice and cc.settings.depth_rule is not None
    sim = ServedCache(PROFILE, served_pools(cc.cache, config), choice, probation=True)
    hits = np.zeros((2, len(requests)), dtype=np.int64)  # served, simulated
    try:
        for i, r in enumerate(requests):
            hits[0, i] = run_request(cc, r.input_tokens.tolist(), r.output_len, out_tokens=r.output_tokens.tolist(),
                                     chunk_end=chunk_end_for_branch, decode_at_once=True)[1]
            hits[1, i] = sim.serve(r.input_tokens, r.output_tokens).hit_tokens
        # fixed, as the flag asks: no tuner, the rule still in force past the sync points
        assert runtime.tuner is None and cc.settings.choice == choice and runtime.released == len(requests)
    finally:
        runtime.close()
    cc.check_no_leak()
    c = cc.settings.counters
    assert c.evictions_leaf + c.evictions_single_child > 0, "nothing evicted: the rule was never asked"
    return hits[0], hits[1], cc.settings.continuation, sim.continuation


def first_difference(served, simulated) -> str:
    differ = np.flatnonzero(served != simulated)
    if not differ.size:
        return "identical"
    i = differ[0]
    return f"request {i}: served {served[i]}, simulated {simulated[i]} ({differ.size} differ)"


def same_record(a, b) -> bool:
    return (a.finished == b.finished and a._by_end == b._by_end
            and [(k, s.length, s.last_token, s.depth, s.continued) for k, s in a._by_prefix.items()]
            == [(k, s.length, s.last_token, s.depth, s.continued) for k, s in b._by_prefix.items()])


@pytest.fixture(scope="module")
def depth4(requests):
    served, simulated, served_record, sim_record = replay(requests, "depth:4")
    assert np.array_equal(served, simulated), f"depth:4 no_buffer: {first_difference(served, simulated)}"
    assert served_record.finished == len(requests) and same_record(served_record, sim_record)
    deepest = max(depth for depth, _ in served_record._by_end.values())
    assert deepest >= 2, "no deep sequence recorded: the depth never mattered"
    return served


def test_server_and_model_agree_request_by_request(depth4):
    """no_buffer (the fixture's checks), and extra_buffer, where the last insert is cut at the last
    tracked state, so the record holds that, on both sides."""
    served, simulated, served_record, sim_record = replay(REQUESTS_XBUF, "depth:auto", "extra_buffer")
    assert np.array_equal(served, simulated), f"depth:auto extra_buffer: {first_difference(served, simulated)}"
    assert same_record(served_record, sim_record)
    served, simulated, _, _ = replay(REQUESTS_XBUF, "depth:4", "extra_buffer")
    assert np.array_equal(served, simulated), f"depth:4 extra_buffer: {first_difference(served, simulated)}"


def test_the_depth_rule_is_in_force(requests, depth4):
    served, simulated, _, _ = replay(requests, "depth:0")  # B = 0: recency alone over the same candidates
    assert np.array_equal(served, simulated), first_difference(served, simulated)
    assert not np.array_equal(depth4, served), "depth:4 evicted as B = 0 does: the rule is not in force"


def oldest_deepest_first(original):
    """The exponent's sign flipped: deep candidates go first."""
    def deepest_oldest(candidates, depths, exponent, *rest):
        return original(candidates, depths, -exponent, *rest)
    return deepest_oldest


def test_a_mutant_rule_changes_server_and_model_alike(requests, depth4, monkeypatch):
    monkeypatch.setattr(depth, "deepest_oldest", oldest_deepest_first(depth.deepest_oldest))
    served, simulated, _, _ = replay(requests, "depth:4")
    assert not np.array_equal(served, depth4), "the mutant changed no hit: it proves nothing"
    assert np.array_equal(served, simulated), f"mutant: served vs simulated: {first_difference(served, simulated)}"


def test_a_record_fed_differently_on_one_side_is_caught(requests, monkeypatch):
    """The model's record fed with the whole sequence instead of what the last insert kept (in
    extra_buffer mode the two differ): the two caches part ways."""
    class WholeSequence(ContinuationRecord):
        def finish(self, tokens, n=None):
            return super().finish(tokens, len(tokens))

    original = served_cache.depth_rule_of

    def depth_rule_of(choice, record, node_end=depth.core_node_end):
        return original(choice, record if record is not None else WholeSequence(), node_end)

    monkeypatch.setattr(served_cache, "depth_rule_of", depth_rule_of)
    served, simulated, _, _ = replay(requests, "depth:4", "extra_buffer")
    assert not np.array_equal(served, simulated), "a record fed differently on one side went unnoticed"
