"""The depth choices tuned in the server (`--marconi-alpha auto`), on SGLang's real cache with our
components and admission on CPU.

The tuner's served shadows each keep a record of finished sequences from the first request, fed
with what their own last insert kept (`shadow_tuner.served_model`, `served_copy`), as SGLang's
cache feeds its own (`eviction_settings.finished`). So at sample rate 1 the shadow of a depth
choice is SGLang's cache under that fixed choice, request by request and record for record; a
shadow whose record is fed differently (from the fork on, say) parts from it. And the tuned live
cache, which records from its first request on every rank (`shadow_tuner.live_record_for`),
adopts a depth choice at the same release as the simulator's model of it, with the same record.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang_cpu import build_marconi_serving, run_request  # noqa: E402

from sglang_marconi.policy.cost.model_profile import load_profile  # noqa: E402
from sglang_marconi.policy.tuning import shadow_tuner  # noqa: E402
from sglang_marconi.policy.tuning.shadow_tuner import (  # noqa: E402
    ShadowConfig,
    ShadowTuner,
    choice_label,
    is_depth_choice,
)
from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402
from sglang_marconi.serving.runtime import served_pools  # noqa: E402
from sglang_marconi.sim.baselines.served import ServedPolicy  # noqa: E402
from sglang_marconi.sim.synthetic import generate  # noqa: E402
from test_depth_served import REQUESTS_XBUF, two_pass_prefill  # noqa: E402,F401 (its streams; its autouse hook)

PROFILE = load_profile("nemotron-h-8b")
REQUESTS = list(generate("lmsys", sessions=8, scale=0.1, seed=1))


def build(config, requests, kv_tokens, mamba_slots, strategy):
    longest = max(r.input_len + r.output_len for r in requests)
    return build_marconi_serving(config, profile=PROFILE, kv_size=kv_tokens, mamba_size=mamba_slots, max_num_reqs=2,
                                 max_context_len=max(4096, 2 * longest), extra_buffer=strategy == "extra_buffer")


def serve(cc, r) -> int:
    return run_request(cc, r.input_tokens.tolist(), r.output_len, out_tokens=r.output_tokens.tolist(),
                       chunk_end=chunk_end_for_branch, decode_at_once=True, session_id=r.session_id)[1]


def record_state(record):
    return (record.finished, dict(record._by_end),
            [(k, s.length, s.last_token, s.depth, s.continued) for k, s in record._by_prefix.items()])


def shadow_against_fixed(choice: str, requests, strategy: str, kv_tokens=3000, mamba_slots=8):
    """SGLang's cache under the fixed `choice` and the served tuner's shadow of it, fed the same
    stream: per-request hits of both, and both records at the end."""
    config = MarconiServingConfig(eviction=choice, probation=True, tune_workers=0)
    cc, runtime = build(config, requests, kv_tokens, mamba_slots, strategy)
    tuner = ShadowTuner(PROFILE, 1, ShadowConfig(), probation=True, served=served_pools(cc.cache, config))
    index = tuner.choices.index(choice)
    hits = np.zeros((2, len(requests)), dtype=np.int64)  # served, the shadow's
    try:
        for i, r in enumerate(requests):
            hits[0, i] = serve(cc, r)
            tuner.observe(r.session_id, r.input_tokens, r.output_tokens[:-1])
            hits[1, i] = tuner.last_hits[index]
    finally:
        runtime.close()
    cc.check_no_leak()
    assert tuner.log.forked_at is not None and tuner.shadows[index] is not None, "the shadows never forked"
    c = cc.settings.counters
    assert c.evictions_leaf + c.evictions_single_child > 0, "nothing evicted: the rule was never asked"
    return hits, cc.settings.continuation, tuner.shadows[index].cache.continuation


@pytest.mark.parametrize("choice,requests,strategy", [("depth:4", REQUESTS, "no_buffer"),
                                                      ("depth:auto", REQUESTS_XBUF, "extra_buffer")])
def test_the_shadow_of_a_depth_choice_is_the_served_cache_under_it(choice, requests, strategy):
    hits, served_record, shadow_record = shadow_against_fixed(choice, requests, strategy)
    differ = np.flatnonzero(hits[0] != hits[1])
    assert not differ.size, f"request {differ[0]}: served {hits[0, differ[0]]}, shadow {hits[1, differ[0]]}"
    assert served_record.finished > len(requests) // 2  # (extra_buffer: a request whose insert kept nothing is not)
    assert record_state(shadow_record) == record_state(served_record)
    deepest = max(depth for depth, _ in served_record._by_end.values())
    assert deepest >= 2, "no deep sequence recorded: the depth never mattered"


def test_a_shadow_record_fed_from_the_fork_on_is_caught(monkeypatch):
    """The shadows' record started at the fork rather than at the first request: the depth
    shadow no longer stands for the served cache under its choice."""
    original = shadow_tuner.served_model

    def from_the_fork(profile, pools, choice, *, probation, record):
        return original(profile, pools, choice, probation=probation, record=False)

    monkeypatch.setattr(shadow_tuner, "served_model", from_the_fork)
    hits, served_record, shadow_record = shadow_against_fixed("depth:4", REQUESTS, "no_buffer")
    assert record_state(shadow_record) != record_state(served_record) or not np.array_equal(hits[0], hits[1])


def tuned_against_model(requests, strategy: str, kv_tokens=6000, mamba_slots=16, sync_every=8):
    """The tuned runtime (inline tuner) on SGLang's cache and the simulator's model of it: hits per
    request, choices adopted (release, label) on each side, and the two live records."""
    config = MarconiServingConfig(alpha=None, probation=True, tune_workers=0, tune_sync_every=sync_every)
    cc, runtime = build(config, requests, kv_tokens, mamba_slots, strategy)
    assert any(map(is_depth_choice, runtime.choices)) and runtime.settings.continuation is not None
    model = ServedPolicy("marconi", PROFILE, served_pools(cc.cache, config), tuning=config.tuning(), probation=True,
                         sync_every=sync_every)
    assert model.tuner.choices == runtime.choices
    hits = np.zeros((2, len(requests)), dtype=np.int64)  # served, simulated
    try:
        for i, r in enumerate(requests):
            hits[0, i] = serve(cc, r)
            hits[1, i] = model.serve(r).hit_tokens
    finally:
        runtime.close()
    cc.check_no_leak()
    served_choices = [(at, choice_label(c)) for at, c in runtime.adoptions]
    sim_choices = [(at, choice_label(c)) for at, c in model.history[1:]]
    return hits, served_choices, sim_choices, cc.settings.continuation, model.cache.continuation


def test_the_tuned_server_adopts_a_depth_choice_where_the_model_does():
    hits, served_choices, sim_choices, served_record, sim_record = tuned_against_model(REQUESTS, "no_buffer")
    assert any(is_depth_choice(c) for _, c in served_choices), f"no depth choice adopted: {served_choices}"
    assert served_choices == sim_choices
    differ = np.flatnonzero(hits[0] != hits[1])
    assert not differ.size, f"request {differ[0]}: served {hits[0, differ[0]]}, simulated {hits[1, differ[0]]}"
    assert served_record.finished == len(REQUESTS) and record_state(served_record) == record_state(sim_record)
