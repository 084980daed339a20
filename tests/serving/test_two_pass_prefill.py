"""Two-pass prefill against SGLang's REAL scheduler pieces on CPU: `PrefillAdder` built with the
scheduler's arguments, `ScheduleBatch.init_new` + `prepare_for_extend` (alloc_for_extend), the
chunked-request hand-off of `Scheduler.get_new_batch_prefill`, and `stash_chunked_request`
(`checkpoint_kv_cache`), with the hooks applied through SGLang's HookRegistry."""

import types

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, build_cache, make_request, run_request  # noqa: E402
from sglang_cpu import node_depth as depth  # noqa: E402

from sglang_marconi.serving.admission import admission_mixin  # noqa: E402
from sglang_marconi.serving.components import marconi_component_overrides  # noqa: E402
from sglang_marconi.serving.eviction_settings import MarconiEvictionSettings  # noqa: E402
from sglang_marconi.serving.admission import tracked_position_for_branch  # noqa: E402
from sglang_marconi.serving.two_pass_prefill import (  # noqa: E402
    CHUNKED_TARGET,
    SELECT_TARGET,
    TRACK_TARGET,
    TwoPassCounters,
    branch_tracking_active,
    install_two_pass_prefill_hook,
    snapshot_step,
    two_pass_active,
    uninstall_two_pass_prefill_hook,
)

from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

SYSTEM = list(range(1, 1001))  # a branch at 1,000: off SGLang's 64-token Mamba grid, exact for Marconi
MODEL_CONFIG = types.SimpleNamespace(vocab_size=32000, is_encoder_decoder=False)


@pytest.fixture(autouse=True)
def hooks():
    track = "_mamba_radix_cache_v2_req_prepare_for_extend"
    originals = (PrefillAdder._select_prefill_admission, PrefillAdder.add_chunked_req, ScheduleBatch.__dict__[track])
    install_two_pass_prefill_hook(apply_now=True)
    assert PrefillAdder._select_prefill_admission is not originals[0]
    assert ScheduleBatch.__dict__[track] is not originals[2]
    yield
    uninstall_two_pass_prefill_hook()
    assert (PrefillAdder._select_prefill_admission, PrefillAdder.add_chunked_req,
            ScheduleBatch.__dict__[track]) == originals


def marconi(**kwargs):
    settings = MarconiEvictionSettings("nemotron-h-8b", choice=0.0)
    cc = build_cache(component_registry_override=marconi_component_overrides(
        settings, mamba_mixins=(admission_mixin(),)), **kwargs)
    cc.settings = settings
    return cc


class Scheduler:
    """The part of `Scheduler.get_new_batch_prefill` / `process_batch_result_prefill` that
    decides and runs prefill chunks (no model forward: the state copy-on-write the forward pass
    would do is done by hand; every request decodes one token and finishes)."""

    def __init__(self, cc, chunked_prefill_size=8192, max_prefill_tokens=16384, truncation_align_size=None):
        self.cc = cc
        self.truncation_align_size = truncation_align_size
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting = []
        self.chunked_req = None
        self.finished = []
        self.running_batch = ScheduleBatch.init_new(
            [], cc.req_to_token_pool, cc.allocator, cc.cache, MODEL_CONFIG, False, SpeculativeAlgorithm.NONE)

    def submit(self, tokens):
        req = make_request(tokens, 1)
        self.waiting.append(req)
        return req

    def round(self):
        cc = self.cc
        adder = PrefillAdder(
            1, cc.cache, cc.allocator, self.running_batch, 0.7, self.max_prefill_tokens,
            self.chunked_prefill_size, 0, 0, max_prefill_bs=0, max_running_requests=cc.max_num_reqs,
            prefill_max_requests=None, prefill_delayer_single_pass=None, dllm_config=None,
            waiting_queue_len=len(self.waiting), prefill_tile_block_m=64,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            adder.chunked_req_limit = None  # shortest_prefill_chunk_limit under the default policy
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            req.init_next_round_input(cc.cache)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None,
                                    truncation_align_size=self.truncation_align_size)
            if res != AddReqResult.CONTINUE:
                added = len(adder.can_run_list) > 0 and req is adder.can_run_list[-1]
                if not added:
                    req.kv.mamba_cow_src_index = None
                    req.kv.mamba_needs_clear = False
                    if req.kv.holds_mamba:
                        cc.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
                        req.kv.mamba_pool_idx = None
                break
        can_run = list(adder.can_run_list)
        self.waiting = [r for r in self.waiting if r not in can_run]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None  # the scheduler's own invariant
            self.chunked_req = adder.new_chunked_req
        if not can_run:
            return adder, None
        batch = ScheduleBatch.init_new(can_run, cc.req_to_token_pool, cc.allocator, cc.cache, MODEL_CONFIG,
                                       False, SpeculativeAlgorithm.NONE, chunked_req=self.chunked_req)
        batch.prepare_for_extend()
        for req in can_run:  # the forward pass's deferred Mamba copy-on-write
            if req.kv.mamba_cow_src_index is not None:
                cc.req_to_token_pool.copy_mamba_state(req.kv.mamba_cow_src_index.view(-1),
                                                      req.kv.mamba_pool_idx.view(-1))
                req.kv.mamba_cow_src_index = None
            req.kv.mamba_needs_clear = False
        for req in can_run:
            if req is self.chunked_req:
                checkpoint_kv_cache(req, cc.cache)  # stash_chunked_request
            else:
                req.output_ids.append(10_000_000 + len(self.finished))
                req.update_finish_state()
                assert req.finished()
                release_kv_cache(req, cc.cache, checkpoint=True)
                self.finished.append(req)
        return adder, batch

    def drain(self, max_rounds=20):
        for _ in range(max_rounds):
            if not self.waiting and self.chunked_req is None:
                return
            self.round()
        raise AssertionError("scheduler did not drain")


def state_depths(cc) -> list[int]:
    return sorted(depth(n) for n in cc.nodes() if n.component_data[MAMBA].value is not None)


def two_pass(cc) -> TwoPassCounters:
    return cc.cache.marconi.two_pass


def test_hooks_registered_once_through_the_hook_registry():
    install_two_pass_prefill_hook()
    install_two_pass_prefill_hook(apply_now=True)
    for target in (SELECT_TARGET, CHUNKED_TARGET, TRACK_TARGET):
        assert len(HookRegistry._hooks[target]) == 1 and target in HookRegistry._patched


def _hooks_applied_by_load_plugins(queue):
    from sglang.srt.plugins import load_plugins

    from sglang_marconi.serving.two_pass_prefill import install_two_pass_prefill_hook

    install_two_pass_prefill_hook()  # what the plugin's register() does, inside load_plugins()
    load_plugins()  # what every scheduler process does first: runs plugins, applies the hooks
    from sglang.srt.managers.schedule_policy import PrefillAdder

    queue.put([getattr(PrefillAdder, name).__wrapped__.__qualname__
               for name in ("_select_prefill_admission", "add_chunked_req")])


def test_hooks_are_applied_in_a_spawned_process_by_load_plugins():
    from sglang_cpu import result_in_spawned_process

    wrapped = result_in_spawned_process(_hooks_applied_by_load_plugins)
    assert wrapped == ["PrefillAdder._select_prefill_admission", "PrefillAdder.add_chunked_req"]


def test_branch_inside_the_extend_is_split_there_and_continues_as_the_chunked_request():
    cc = marconi()
    s = Scheduler(cc)
    s.submit(SYSTEM + list(range(5000, 5200)))
    s.drain()  # empty tree: no branch, one prefill
    assert two_pass(cc).splits == 0 and state_depths(cc) == [1200]

    req = s.submit(SYSTEM + list(range(6000, 6200)))
    adder, batch = s.round()
    assert req.mamba_branching_seqlen == 1000 and req.prefix_len == 1000  # stashed at the branch
    assert s.chunked_req is req and adder.new_chunked_req is req
    assert batch.extend_num_tokens == 1000 and batch.seq_lens_cpu.tolist() == [1000]
    # Budgets charge exactly the 1,000-token chunk (+ one page), keeping the request's max-new
    # reservation of 1 token (over-reserving, as for a request that finishes its prefill).
    assert adder.memory_budget.current_offset == 1001 and adder.memory_budget.total_offset == 1002
    assert adder.rem_chunk_tokens == 8192 - 1000 and adder.log_input_tokens == 1000
    assert 1000 in state_depths(cc)  # the branch state, admitted by Marconi's admission
    assert two_pass(cc).splits == 1

    adder, batch = s.round()  # the continuation: the rest of the prompt, then it finishes
    assert batch.extend_num_tokens == 200 and s.chunked_req is None and req.finished()
    assert state_depths(cc) == [1000, 1200, 1200]
    cc.check_no_leak()

    third = s.submit(SYSTEM + list(range(7000, 7200)))
    s.drain()
    assert third.cached_tokens == 1000  # reused from the branch state, exactly at the branch
    cc.check_no_leak()


def test_upstream_behaviour_without_the_split_for_comparison():
    cc = marconi()
    cc.cache.marconi = None  # backend not Marconi: hooks inactive
    s = Scheduler(cc)
    reqs = [s.submit(SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i))) for i in range(3)]
    for _ in reqs:
        s.round()
    assert [r.cached_tokens for r in reqs] == [0, 0, 0]


def test_request_without_a_branch_point_is_untouched():
    cc = marconi()
    s = Scheduler(cc)
    first = s.submit(list(range(100, 700)))
    adder, batch = s.round()
    assert first.mamba_branching_seqlen is None and batch.extend_num_tokens == 600
    assert adder.new_chunked_req is None and s.chunked_req is None and first.finished()
    # A continuation hitting a stored state exactly: no branch beyond it either.
    again = s.submit(list(range(100, 700)) + [1, 2, 3])
    adder, batch = s.round()
    assert again.cached_tokens == 600 and again.mamba_branching_seqlen is None
    assert batch.extend_num_tokens == 3 and adder.new_chunked_req is None and again.finished()
    assert two_pass(cc) == TwoPassCounters()
    cc.check_no_leak()


def test_continuing_chunked_request_is_ended_at_its_branch_and_no_second_split():
    cc = marconi(kv_size=16384, max_num_reqs=8)
    s = Scheduler(cc, chunked_prefill_size=1024)
    prompt = list(range(20000, 21600))
    s.submit(prompt)
    s.drain()  # tree: 1600 tokens of KV, final state only
    assert state_depths(cc) == [1600]

    long = s.submit(prompt[:1550] + list(range(30000, 31000)))  # hit 1550 -> branch at 1550
    adder, batch = s.round()  # upstream chunk [0, 1024): the branch is not inside
    assert long.mamba_branching_seqlen == 1550 and batch.extend_num_tokens == 1024
    assert s.chunked_req is long and two_pass(cc).splits == 0

    small = s.submit(prompt[:450] + list(range(40000, 40040)))  # branch at 450, extend 490
    big = s.submit(list(range(50000, 52000)))  # would need a chunk of its own
    adder, batch = s.round()
    # The continuation ends at the branch (526 of the 1024 budget) and stays the chunked request;
    assert long.prefix_len == 1550 and s.chunked_req is long and 1550 in state_depths(cc)
    assert two_pass(cc).continuation_splits == 1
    assert adder.memory_budget.current_offset == 526 + 1 + 490 + 1  # exact charges
    # the small request, branch inside its extend, is admitted whole: its state there is lost;
    assert small.finished() and small.mamba_branching_seqlen == 450
    assert two_pass(cc).skipped_other_chunked == 1
    # the big one would become a second chunked request: refused this round, still queued.
    assert two_pass(cc).deferred_second_chunked == 1 and s.waiting == [big]
    assert batch.extend_num_tokens == 526 + 490

    s.drain()
    assert long.finished() and big.finished()
    cc.check_no_leak()


def test_second_new_request_with_a_branch_is_not_split_in_the_same_round():
    cc = marconi(max_num_reqs=8)
    s = Scheduler(cc)
    s.submit(SYSTEM + list(range(5000, 5200)))
    other = list(range(60000, 60700))
    s.submit(other + [1])
    s.drain()
    a = s.submit(SYSTEM + list(range(6000, 6100)))  # branch 1000
    b = s.submit(other + list(range(61000, 61100)))  # branch 700
    adder, batch = s.round()
    assert s.chunked_req is a and a.prefix_len == 1000
    assert b.finished() and b.mamba_branching_seqlen == 700
    c = two_pass(cc)
    assert (c.splits, c.skipped_other_chunked) == (1, 1)
    s.drain()
    cc.check_no_leak()


def test_nothing_changes_when_the_backend_is_not_marconi():
    cc = build_cache()  # upstream components: no Marconi state on the cache
    s = Scheduler(cc)
    s.submit(SYSTEM + list(range(5000, 5200)))
    s.drain()
    req = s.submit(SYSTEM + list(range(6000, 6200)))
    adder, batch = s.round()
    assert req.mamba_branching_seqlen == 960 and batch.extend_num_tokens == 1200
    assert adder.new_chunked_req is None and req.finished()
    assert getattr(cc.cache, "marconi", None) is None
    cc.check_no_leak()


def test_active_in_both_modes_with_each_modes_grid():
    """no_buffer: cut at the branch (no snapshot grid); extra_buffer: cut on SGLang's 64-token
    snapshot grid; upstream's cache or admission: untouched."""
    no_buffer, extra_buffer = marconi(), marconi(extra_buffer=True, mamba_size=64)
    assert two_pass_active(no_buffer.cache) and snapshot_step(no_buffer.cache) is None
    assert two_pass_active(extra_buffer.cache) and snapshot_step(extra_buffer.cache) == 64
    assert not two_pass_active(build_cache().cache)
    eviction_only = marconi_component_overrides(MarconiEvictionSettings("nemotron-h-8b", choice=0.0))
    assert not two_pass_active(build_cache(component_registry_override=eviction_only).cache)


def test_snapshot_steering_only_with_marconis_admission_in_extra_buffer_mode():
    assert branch_tracking_active(marconi(extra_buffer=True, mamba_size=64).cache)
    assert not branch_tracking_active(marconi().cache)  # no_buffer: two-pass splits instead
    assert not branch_tracking_active(build_cache(extra_buffer=True, mamba_size=64).cache)  # upstream's
    eviction_only = marconi_component_overrides(MarconiEvictionSettings("nemotron-h-8b", choice=0.0))
    assert not branch_tracking_active(build_cache(component_registry_override=eviction_only, extra_buffer=True,
                                                  mamba_size=64).cache)  # --marconi-admission off


@pytest.mark.parametrize("prefix_len,extend_end,branch,expected", [
    (0, 1200, 1000, 960),  # on SGLang's grid from an extend that starts at 0
    (900, 1050, 1000, 964),  # an extend starting off the grid: 64 tokens after its start
    (0, 1200, 960, 960),  # the branch itself when it is a whole number of chunks in
    (1000, 1100, 1036, None),  # less than a chunk in: nothing this extend can snapshot before it
    (0, 900, 1000, None),  # the branch beyond this extend: upstream's snapshot
    (1000, 1200, 1000, None),  # the branch at the extend's start: nothing to add
])
def test_tracked_position_for_branch(prefix_len, extend_end, branch, expected):
    req = types.SimpleNamespace(prefix_len=prefix_len, extend_end=extend_end, mamba_branching_seqlen=branch)
    assert tracked_position_for_branch(req, 64) == expected


def test_unaligned_branch_is_cut_at_the_last_aligned_position_before_it():
    """A truncation alignment (deterministic inference, DSA, DCP) allows chunks of 64k tokens from
    the prefix only: the chunk ends at 960, the last such position before the branch at 1,000,
    and that state is admitted for the branch (40 tokens lost to the alignment, counted)."""
    cc = marconi()
    s = Scheduler(cc, truncation_align_size=64)
    s.submit(SYSTEM + list(range(5000, 5192)))
    s.drain()
    req = s.submit(SYSTEM + list(range(6000, 6192)))
    adder, batch = s.round()
    assert req.mamba_branching_seqlen == 1000 and req.marconi.branch_cut == 960 and req.prefix_len == 960
    assert batch.extend_num_tokens == 960 and 960 in state_depths(cc)
    assert (two_pass(cc).splits, two_pass(cc).aligned_below, two_pass(cc).skipped_unaligned) == (1, 1, 0)
    s.drain()
    admission = cc.cache.marconi.admission
    assert admission.branch_states_admitted == 1 and admission.grid_lost_tokens == 40
    third = s.submit(SYSTEM + list(range(7000, 7192)))
    s.drain()
    assert third.cached_tokens == 960
    cc.check_no_leak()


def test_split_counts_reach_the_metrics():
    from sglang_cpu import build_marconi_serving

    from sglang_marconi.serving.config import MarconiServingConfig

    cc, runtime = build_marconi_serving(MarconiServingConfig(alpha=0.0))
    s = Scheduler(cc)
    for base in (5000, 6000):  # the second request branches at 960, inside its extend
        s.submit(SYSTEM + list(range(base, base + 200)))
        s.drain()
    figures = runtime.metrics(cc.cache)
    assert (figures["marconi_two_pass_splits"], figures["marconi_two_pass_skipped"]) == (1, 0)
    assert figures["marconi_two_pass_deferred"] == 0


@pytest.mark.parametrize("target", ["_cut", "chunk_end_for_branch"])
def test_a_fault_in_two_pass_prefill_costs_a_warning_and_the_round_goes_on_as_upstreams(monkeypatch, caplog, target):
    """An exception in Marconi's part of the prefill hooks: one warning, the settings faulted, the
    admission SGLang chose is used unchanged, and later rounds run upstream's code."""
    import logging

    import sglang_marconi.serving.two_pass_prefill as tpp

    def broken(*args, **kwargs):
        raise RuntimeError(f"injected into {target}")

    cc = marconi()
    s = Scheduler(cc)
    s.submit(SYSTEM + list(range(5000, 5200)))
    s.drain()
    monkeypatch.setattr(tpp, target, broken)
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        req = s.submit(SYSTEM + list(range(6000, 6200)))
        s.drain()
        for i in range(3):
            s.submit(SYSTEM + list(range(7000 + 300 * i, 7100 + 300 * i)))
            s.drain()
    assert cc.settings.faulted is not None and target in cc.settings.faulted
    assert len([r for r in caplog.records if "Marconi fault" in r.getMessage()]) == 1
    assert req.finished() and two_pass(cc).splits == 0  # not split: upstream's single extend
    cc.check_no_leak()


def test_a_fault_in_admission_falls_back_to_upstreams_checkpoints(monkeypatch, caplog):
    import logging

    cc = marconi()
    s = Scheduler(cc, chunked_prefill_size=256)
    component = cc.cache.components[MAMBA]

    def broken(*args, **kwargs):
        raise RuntimeError("injected into _marconi_admits")

    monkeypatch.setattr(type(component), "_marconi_admits", broken)
    with caplog.at_level(logging.WARNING, logger="sglang_marconi"):
        for i in range(3):
            s.submit(SYSTEM + list(range(5000 + 300 * i, 5200 + 300 * i)))
            s.drain()
    assert cc.settings.faulted is not None and "admission" in cc.settings.faulted
    assert len([r for r in caplog.records if "Marconi fault" in r.getMessage()]) == 1
    # Upstream's admission keeps a state per prefill chunk (on its 64-token grid), Marconi's never does.
    assert len(state_depths(cc)) > 3
    cc.check_no_leak()


def test_extra_buffer_ends_the_chunk_one_snapshot_step_before_the_branch_and_at_it():
    """extra_buffer: SGLang snapshots one state per extend, a whole number of 64-token steps into
    it. The second request (hit 0, branch at 1,000) is admitted for [0, 936) only, so its next
    extend has the branch one step in; with 300 tokens to go past the branch (at least
    `INPUT_END_STEPS` steps), that extend ends at the branch, so the last one, [1000, 1300),
    snapshots near the input's end instead of spending its one snapshot on the branch. (The first
    request runs through `run_request`, which plays the forward pass's snapshot; the hits are
    checked in test_sglang_admission.py.)"""
    cc = marconi(extra_buffer=True, mamba_size=64)
    run_request(cc, SYSTEM + list(range(5000, 5200)), 1)
    assert state_depths(cc) == [1152]  # its extend's last 64k snapshot, its final state
    s = Scheduler(cc)
    req = s.submit(SYSTEM + list(range(6000, 6300)))
    adder, batch = s.round()
    assert req.mamba_branching_seqlen == 1000 and batch.extend_num_tokens == 936 and s.chunked_req is req
    assert two_pass(cc).splits == 1
    adder, batch = s.round()  # one grid step, from before the branch to it: snapshots the branch
    assert batch.extend_num_tokens == 64 and s.chunked_req is req and two_pass(cc).continuation_splits == 1
    adder, batch = s.round()  # from the branch to the end
    assert batch.extend_num_tokens == 1300 - 1000 and req.finished()


def test_extra_buffer_does_not_end_the_chunk_at_the_branch_when_the_input_stops_soon_after_it():
    """200 tokens past the branch (fewer than `INPUT_END_STEPS` steps): one extend from a step
    before the branch to the end, its one snapshot at the branch (an input-end state there would
    save little replay for the Mamba slot it takes)."""
    cc = marconi(extra_buffer=True, mamba_size=64)
    run_request(cc, SYSTEM + list(range(5000, 5200)), 1)
    s = Scheduler(cc)
    req = s.submit(SYSTEM + list(range(6000, 6200)))
    adder, batch = s.round()
    assert batch.extend_num_tokens == 936 and s.chunked_req is req
    adder, batch = s.round()
    assert batch.extend_num_tokens == 1200 - 936 and req.finished()
