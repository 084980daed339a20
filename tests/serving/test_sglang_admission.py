"""Marconi's admission inside SGLang's real cache (no_buffer mode): a shared system prompt is
reused from its third occurrence, and no request leaves more than two SSM states."""

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, build_cache, run_request  # noqa: E402

from sglang_marconi.serving.admission import admission_mixin, chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.eviction_components import (  # noqa: E402
    MarconiEvictionSettings,
    marconi_component_overrides,
)

SYSTEM = list(range(1, 1001))  # 1,000-token system prompt; the Mamba checkpoint grid is 64


def marconi(alpha=0.0, **kwargs):
    settings = MarconiEvictionSettings("nemotron-h-8b", alpha=alpha)
    overrides = marconi_component_overrides(settings, mamba_mixins=(admission_mixin(),))
    cc = build_cache(component_registry_override=overrides, **kwargs)
    cc.settings = settings
    return cc


def states_in_tree(cc) -> int:
    return sum(1 for n in cc.nodes() if n.component_data[MAMBA].value is not None)


def serve(cc, tokens, n_out, **kw):
    before = states_in_tree(cc)
    req, hit = run_request(cc, tokens, n_out, chunk_end=chunk_end_for_branch, **kw)
    cc.check_no_leak()
    return hit, states_in_tree(cc) - before


def test_shared_system_prompt_reused_from_third_occurrence():
    cc = marconi()
    results = [serve(cc, SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)), 8) for i in range(4)]
    hits = [h for h, _ in results]
    assert hits == [0, 0, 960, 960]  # the branch at 1,000 lands on the 64-token grid at 960
    assert [added for _, added in results] == [1, 2, 1, 1]


def test_upstream_no_buffer_never_reuses_the_system_prompt():
    cc = build_cache()
    hits = [run_request(cc, SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)), 8)[1] for i in range(4)]
    assert hits == [0, 0, 0, 0]


@pytest.mark.parametrize("chunk_size", [None, 128, 256])
def test_no_request_leaves_more_than_two_states(chunk_size):
    cc = marconi(mamba_size=64)
    upstream = build_cache(mamba_size=64)
    prompts = [SYSTEM + list(range(7000 + 900 * i, 7000 + 900 * i + 700)) for i in range(5)]
    for prompt in prompts:
        _, added = serve(cc, prompt, 20, chunk_size=chunk_size)
        assert added <= 2
    for prompt in prompts:
        run_request(upstream, prompt, 20, chunk_size=chunk_size)
    if chunk_size is not None:  # upstream keeps a state per prefill chunk
        assert states_in_tree(upstream) > states_in_tree(cc)
    counters = cc.cache.components[MAMBA].marconi_admission_counters
    assert counters.branch_states_admitted >= 1 and counters.final_states_admitted == 5


def test_multi_turn_continuation_hits_after_last_decoded_token():
    cc = marconi()
    req, _ = run_request(cc, list(range(100, 700)), 30, chunk_end=chunk_end_for_branch)
    turn2 = list(req.origin_input_ids) + list(req.output_ids) + list(range(9000, 9100))
    hit, added = serve(cc, turn2, 5)
    assert hit == len(req.origin_input_ids) + len(req.output_ids) - 1 and added == 1


def test_branch_state_skipped_when_no_mamba_slot_can_be_had():
    # Two Mamba slots: the tree holds one state and a request in flight holds the other, so the
    # next request's branch state cannot get a slot. It is skipped and counted; the request
    # still finishes and nothing leaks.
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang_cpu import _extend, make_request

    cc = marconi(mamba_size=3, max_num_reqs=2)
    serve(cc, SYSTEM + [1, 2, 3], 4)  # leaves one state in the tree
    holder = make_request(list(range(40000, 40100)), 4)
    holder.init_next_round_input(cc.cache)
    _extend(cc, holder, len(holder.full_untruncated_fill_ids))  # in flight: holds a Mamba slot
    (stateful,) = [n for n in cc.nodes() if n.component_data[MAMBA].value is not None]
    lock = cc.cache.lock(stateful.id)  # nothing in the tree may be evicted for the branch state
    run_request(cc, SYSTEM + list(range(20000, 20040)), 4, chunk_end=chunk_end_for_branch)
    counters = cc.cache.components[MAMBA].marconi_admission_counters
    assert counters.skipped_no_slot == 1 and counters.branch_states_admitted == 0
    cc.cache.unlock(lock)
    holder.output_ids.append(7)
    holder.finished_reason = FINISH_LENGTH(length=1)
    release_kv_cache(holder, cc.cache, checkpoint=True)
    cc.check_no_leak()


def marconi_xbuf(**kwargs):
    return marconi(extra_buffer=True, mamba_size=64, **kwargs)


def test_extra_buffer_mode_reuses_system_prompt_from_third_occurrence():
    cc = marconi_xbuf()
    results = [serve(cc, SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)), 20) for i in range(4)]
    assert [h for h, _ in results] == [0, 0, 960, 960]
    assert all(added <= 2 for _, added in results)


@pytest.mark.parametrize("chunk_size", [None, 256])
def test_extra_buffer_mode_keeps_at_most_two_states_per_request(chunk_size):
    cc = marconi_xbuf()
    upstream = build_cache(extra_buffer=True, mamba_size=64)
    prompts = [SYSTEM + list(range(7000 + 900 * i, 7000 + 900 * i + 700)) for i in range(4)]
    for prompt in prompts:
        _, added = serve(cc, prompt, 300, chunk_size=chunk_size)  # 300 decoded: upstream tracks every 256
        assert added <= 2
    for prompt in prompts:
        run_request(upstream, prompt, 300, chunk_size=chunk_size)
    assert states_in_tree(upstream) > states_in_tree(cc)
