"""Marconi's admission inside SGLang's real cache, in both Mamba radix-cache strategies: a shared
system prompt is reused from its third occurrence, at the branch itself in no_buffer mode (two-pass
prefill ends a chunk there) and at the last state extra_buffer mode can snapshot before it, and no
request leaves more than two SSM states.

no_buffer requests are split at the branch (`chunk_end_for_branch`, what the two-pass hooks make
the scheduler do); extra_buffer requests are not split (the hooks leave that mode's chunks alone)
and run SGLang's own snapshot bookkeeping (`ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`)
with Marconi's tracking hook applied."""

import random

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, build_cache, run_request  # noqa: E402
from sglang_cpu import node_depth as depth  # noqa: E402

from sglang_marconi.serving.admission import admission_mixin, chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.components import marconi_component_overrides  # noqa: E402
from sglang_marconi.serving.eviction_settings import MarconiEvictionSettings  # noqa: E402
from sglang_marconi.serving.two_pass_prefill import (  # noqa: E402
    install_two_pass_prefill_hook,
    uninstall_two_pass_prefill_hook,
)

SYSTEM = list(range(1, 1001))  # 1,000-token system prompt; SGLang's Mamba checkpoint grid is 64


@pytest.fixture
def hooks():
    """The scheduler hooks the plugin registers (two-pass splits, extra_buffer tracking)."""
    install_two_pass_prefill_hook(apply_now=True)
    yield
    uninstall_two_pass_prefill_hook()


def marconi(alpha=0.0, **kwargs):
    settings = MarconiEvictionSettings("nemotron-h-8b", choice=alpha)
    overrides = marconi_component_overrides(settings, mamba_mixins=(admission_mixin(),))
    cc = build_cache(component_registry_override=overrides, **kwargs)
    cc.settings = settings
    return cc


def states_in_tree(cc) -> int:
    return sum(1 for n in cc.nodes() if n.component_data[MAMBA].value is not None)


def state_depths(cc) -> set[int]:
    return {depth(n) for n in cc.nodes() if n.component_data[MAMBA].value is not None}


def admission(cc):
    return cc.cache.marconi.admission


def serve(cc, tokens, n_out, chunk_end=chunk_end_for_branch, **kw):
    """One request as the scheduler runs it in the cache's mode (two-pass chunk ends on the mode's
    grid; `chunk_end=None`: the scheduler without the hooks); returns (hit, states added)."""
    before = states_in_tree(cc)
    req, hit = run_request(cc, tokens, n_out, chunk_end=chunk_end, **kw)
    cc.check_no_leak()
    return hit, states_in_tree(cc) - before


def test_shared_system_prompt_reused_from_third_occurrence():
    cc = marconi()
    results = [serve(cc, SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)), 8) for i in range(4)]
    hits = [h for h, _ in results]
    assert hits == [0, 0, 1000, 1000]  # the branch state sits at 1,000 exactly, not at 960 on the grid
    assert [added for _, added in results] == [1, 2, 1, 1]
    assert admission(cc).grid_lost_tokens == 0


def test_third_request_sharing_a_150_token_prompt_hits_all_150():
    cc = marconi()
    shared = list(range(7, 157))
    hits = [serve(cc, shared + list(range(9000 + 40 * i, 9020 + 40 * i)), 4)[0] for i in range(3)]
    assert hits == [0, 0, 150]  # not 128, the 64-token grid's floor


def test_exact_branch_grid_is_the_page_in_no_buffer_mode_only():
    assert marconi().cache.components[MAMBA].mamba_checkpoint_grid == 1  # page size 1
    assert marconi(extra_buffer=True, mamba_size=64).cache.components[MAMBA].mamba_checkpoint_grid == 64
    assert build_cache().cache.components[MAMBA].mamba_checkpoint_grid == 64  # upstream's own


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
    counters = cc.cache.marconi.admission
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
    counters = cc.cache.marconi.admission
    assert counters.skipped_no_slot == 1 and counters.branch_states_admitted == 0
    cc.cache.unlock(lock)
    holder.output_ids.append(7)
    holder.finished_reason = FINISH_LENGTH(length=1)
    release_kv_cache(holder, cc.cache, checkpoint=True)
    cc.check_no_leak()


def marconi_xbuf(**kwargs):
    return marconi(extra_buffer=True, mamba_size=64, **kwargs)


def test_extra_buffer_mode_reuses_system_prompt_from_third_occurrence(hooks):
    cc = marconi_xbuf()
    results = [serve(cc, SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)), 20) for i in range(4)]
    # The second request's extend is cut at 936, so the next one, [936, ...), snapshots 1,000
    # exactly (one grid step in): the branch state sits on the branch, not at 960 on the grid.
    assert [h for h, _ in results] == [0, 0, 1000, 1000]
    assert all(added <= 2 for _, added in results)
    assert admission(cc).branch_states_admitted == 1 and admission(cc).grid_lost_tokens == 0


def test_extra_buffer_without_the_cut_keeps_the_last_snapshot_before_the_branch(hooks):
    """Without two-pass chunk ends (the scheduler's hooks not applied), one snapshot per extend:
    the second request's, steered to 960, the last 64-token step before its branch at 1,000."""
    cc = marconi_xbuf()
    results = [serve(cc, SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)), 20, chunk_end=None)
               for i in range(4)]
    assert [h for h, _ in results] == [0, 0, 960, 960]
    assert admission(cc).branch_states_admitted == 1 and admission(cc).grid_lost_tokens == 40


@pytest.mark.parametrize("chunk_size", [None, 256])
def test_extra_buffer_mode_keeps_at_most_two_states_per_request(hooks, chunk_size):
    cc = marconi_xbuf()
    upstream = build_cache(extra_buffer=True, mamba_size=64)
    prompts = [SYSTEM + list(range(7000 + 900 * i, 7000 + 900 * i + 700)) for i in range(4)]
    for prompt in prompts:
        _, added = serve(cc, prompt, 300, chunk_size=chunk_size)  # 300 decoded: upstream tracks every 256
        assert added <= 2
    for prompt in prompts:
        run_request(upstream, prompt, 300, chunk_size=chunk_size)
    assert states_in_tree(upstream) > states_in_tree(cc)


def test_extra_buffer_chunks_off_the_grid_are_shifted_onto_the_branchs(hooks):
    """Prefill chunks of 150 tokens start off the 64-token grid, so upstream snapshots each
    chunk's last 64k position (128, 278, ..., 878, then 1028 past the branch at 1,000). Marconi
    ends each chunk where the next starts a whole number of steps before the branch, so the
    branch itself is snapshotted."""
    cc, upstream = marconi_xbuf(), build_cache(extra_buffer=True, mamba_size=64)
    prompts = [SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)) for i in range(3)]
    hits = [serve(cc, p, 20, chunk_size=150)[0] for p in prompts]
    assert hits == [0, 0, 1000]
    assert 1000 in state_depths(cc) and admission(cc).grid_lost_tokens == 0
    for p in prompts[:2]:
        run_request(upstream, p, 20, chunk_size=150)
    assert max(d for d in state_depths(upstream) if d <= 1000) == 878
    assert run_request(upstream, prompts[2], 20, chunk_size=150)[1] == 878


def test_extra_buffer_branch_less_than_a_step_past_the_hit_is_not_cut_for(hooks):
    """No extend can start a whole step before a branch less than 64 tokens past the hit, so the
    chunk is left alone (and no state can be kept between the hit and the branch)."""
    cc = marconi_xbuf()
    x = list(range(1, 641))
    serve(cc, x, 1)  # one extend [0, 640): its snapshot, at its end, is its final state
    serve(cc, x[:576] + list(range(50000, 50100)), 1)  # branch at 576: state there (cut at 512)
    assert {576, 640} <= state_depths(cc)
    hit, _ = serve(cc, x[:620] + list(range(60000, 60100)), 1)  # hit 576, branch 620: 44 past it
    assert hit == 576
    assert not any(576 < d < 620 for d in state_depths(cc))
    assert serve(cc, x[:620] + list(range(61000, 61100)), 1)[0] == 576


def reasoning_turns(cc, user_lens, reasoning=40):
    """A conversation with a reasoning model whose template drops each answer's reasoning from the
    history: every turn's input is the previous input, then fresh tokens (the answer without its
    reasoning, and the next user message), so it leaves the cached sequence where the previous
    input ended. Returns [(hit, previous input's length)] per turn."""
    history, out, fresh = list(SYSTEM), [], 100_000
    for n in user_lens:
        tokens = history + list(range(fresh, fresh + n))
        fresh += n
        hit, _ = serve(cc, tokens, reasoning)
        out.append((hit, len(history)))
        history = tokens
    return out


def test_extra_buffer_keeps_the_state_at_each_turns_input_end_next_to_its_branch_state(hooks):
    """A turn that resumes more than a step before its branch (the previous input's end) is cut a
    step before the branch and again at it: the branch's extend snapshots the branch and the last
    extend its own last step, near the input's end, where the next turn leaves. (With the last
    extend running from a step before the branch to the end, its one snapshot went to the branch,
    and every turn resumed two inputs back.)"""
    cc = marconi_xbuf()
    serve(cc, SYSTEM + list(range(900_000, 900_300)), 40)  # another conversation: the first turn branches at 1,000
    turns = reasoning_turns(cc, [300, 300, 300, 300, 300])
    assert turns[0][0] == 0  # no state at the system prompt's end yet: cut at 936, and at 1,000
    for hit, previous_input in turns[1:]:
        assert previous_input - 64 < hit <= previous_input, turns


@pytest.mark.parametrize("seed", range(6))
def test_extra_buffer_keeps_no_fewer_reusable_states_before_the_branch_than_upstream(hooks, seed):
    """Same first request in both caches (one extend, no decode: both keep its one snapshot), then a second
    one branching off it, prefilled in chunks of a random size: Marconi's branch state is at or
    after the last state upstream keeps at or before the branch, and at or before the branch."""
    rng = random.Random(seed)
    for _ in range(8):
        first = list(range(1, rng.randint(200, 1400)))
        branch = rng.randint(100, len(first) - 1)
        second = first[:branch] + list(range(50000, 50000 + rng.randint(1, 500)))
        chunk = rng.choice([None, 64, 100, 128, 150, 256, 333])
        trees = []
        for cc in (marconi_xbuf(), build_cache(extra_buffer=True, mamba_size=64)):
            run_request(cc, first, 1)  # one token: no decode step, so no decode snapshot
            before = state_depths(cc)
            _, hit = run_request(cc, second, 1, chunk_size=chunk)
            cc.check_no_leak()
            trees.append((hit, {d for d in state_depths(cc) - before if d <= branch}))
        (hit, ours), (upstream_hit, theirs) = trees
        assert hit == upstream_hit  # the same first request left the same state
        assert len(ours) <= 1
        if theirs:
            assert ours and max(ours) >= max(theirs), (first[-1], branch, chunk, ours, theirs)


def test_grid_lost_tokens_reach_the_metrics(hooks):
    from sglang_cpu import build_marconi_serving

    from sglang_marconi.serving.config import MarconiServingConfig

    cc, runtime = build_marconi_serving(MarconiServingConfig(alpha=0.0), extra_buffer=True, mamba_size=64)
    for i in range(2):
        run_request(cc, SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)), 20)
    assert admission(cc).grid_lost_tokens == 40
    assert runtime.metrics(cc.cache)["marconi_branch_tokens_lost_to_grid"] == 40
