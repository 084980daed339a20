"""Served probation (`--marconi-probation on`): the state at the end of each input is kept on
probation inside SGLang's real cache, so a prefix used exactly twice in a row (a request, then one
that extends its input: SGLang's `mooncake` generator, multi-turn chat without the reply) hits at
its second use, as upstream's per-extend states do; probationary states never displace a regular
one and go first under Mamba pressure; a reuse confirms one."""

import pytest

pytest.importorskip("sglang")

from sglang_cpu import MAMBA, build_marconi_serving, run_request  # noqa: E402

from sglang_marconi.serving.admission import chunk_end_for_branch  # noqa: E402
from sglang_marconi.serving.config import MarconiServingConfig  # noqa: E402

FIRST = list(range(1, 301))  # 300 tokens; the extra_buffer snapshot grid is 64
SECOND = FIRST + list(range(5000, 5100))


def serve(extra_buffer: bool, probation: bool, admission: bool = True, alpha=0.0, **kwargs):
    config = MarconiServingConfig(alpha=alpha, probation=probation, admission=admission, tune_workers=0)
    cc, runtime = build_marconi_serving(config, extra_buffer=extra_buffer, **kwargs)
    return cc, runtime


def hit_of_second_use(extra_buffer: bool, probation: bool, admission: bool = True) -> int:
    cc, runtime = serve(extra_buffer, probation, admission)
    run_request(cc, FIRST, 8, chunk_end=chunk_end_for_branch)
    _, hit = run_request(cc, SECOND, 8, chunk_end=chunk_end_for_branch)
    cc.check_no_leak()
    runtime.close()
    return hit


@pytest.mark.parametrize("extra_buffer", [False, True])
def test_a_prefix_used_twice_in_a_row_hits_at_its_second_use(extra_buffer):
    upstream = hit_of_second_use(extra_buffer, probation=False, admission=False)
    without = hit_of_second_use(extra_buffer, probation=False)
    with_probation = hit_of_second_use(extra_buffer, probation=True)
    if not extra_buffer:  # Marconi's two states alone: no state at the end of the first input
        assert without == 0  # (extra_buffer: the final state is the last one tracked, 256 here)
    assert with_probation == (300 if not extra_buffer else 256)  # no_buffer exact; extra_buffer its 64-grid
    assert with_probation >= upstream > 0


def test_a_reuse_confirms_and_a_new_input_is_kept_on_probation():
    cc, runtime = serve(False, True)
    run_request(cc, FIRST, 8, chunk_end=chunk_end_for_branch)
    probation = cc.cache.marconi.probation
    (node,) = list(probation)
    assert node.component_data[MAMBA].value is not None and sum(len(n.key) for n in _path(node)) == 300
    run_request(cc, SECOND, 8, chunk_end=chunk_end_for_branch)
    assert node not in probation  # the second request reused it: confirmed
    assert len(probation) == 1  # the second input's end, on probation in turn
    counters = cc.cache.marconi.admission
    assert counters.probationary_admitted == 2
    metrics = runtime.metrics(cc.cache)
    assert metrics["marconi_probationary_states_admitted"] == 2
    runtime.close()


def test_extra_buffer_a_short_decode_makes_the_input_end_state_its_final_state():
    """The input end's state goes to the tree on probation; a decode shorter than the snapshot grid
    tracks no newer state, so that one is the request's final state: confirmed, and counted so."""
    cc, runtime = serve(True, True)
    run_request(cc, FIRST, 8, chunk_end=chunk_end_for_branch)
    counters = cc.cache.marconi.admission
    assert counters.probationary_admitted == 1 and counters.final_states_admitted == 1
    assert not len(cc.cache.marconi.probation)  # confirmed: no longer evicted first
    cc.check_no_leak()
    runtime.close()


def _path(node):
    while node.parent is not None:
        yield node
        node = node.parent


def conversation_among_one_shots(extra_buffer: bool, probation: bool, observer_for=None):
    """A conversation that extends its own input each turn (no reply carried over), among one-shot
    requests, under Mamba-slot pressure; returns (hits of the conversation's turns, runtime)."""
    cc, runtime = serve(extra_buffer, probation, mamba_size=20 if extra_buffer else 10, kv_size=16_000)
    if observer_for is not None:
        runtime.settings.observer = observer_for(cc)
    hits = []
    n_out = 4
    for i in range(40):
        _, hit = run_request(cc, FIRST + [7000 + j for j in range(20 * i)], n_out, chunk_end=chunk_end_for_branch)
        hits.append(hit)
        run_request(cc, [20_000 + 1000 * i + j for j in range(150)], n_out, chunk_end=chunk_end_for_branch)
        cc.check_no_leak()
    runtime.close()
    return hits, runtime


@pytest.mark.parametrize("extra_buffer", [False, True])
def test_probationary_states_go_first_and_never_displace_a_regular_one(extra_buffer):
    victims = []

    def observer_for(cc):
        state = cc.cache.marconi

        def observe(victim):
            unlocked = [n for n in state.probation
                        if n.component_data[MAMBA].value is not None and n.component_data[MAMBA].lock_ref == 0
                        and cc.cache.tree_core._node_arena.get(n.id) is n]
            victims.append((victim.kind, state.walk.probation_only, bool(unlocked)))
        return observe

    hits, runtime = conversation_among_one_shots(extra_buffer, True, observer_for)
    baseline, _ = conversation_among_one_shots(extra_buffer, False)
    if not extra_buffer:  # (extra_buffer: the input end's state is mostly the final one, confirmed)
        assert runtime.settings.counters.evictions_probationary > 0
    if not extra_buffer:
        assert any(kind != "probationary" for kind, _, _ in victims)  # pressure reached regular states too
    for kind, probation_only, probationary_left in victims:
        if probation_only:  # making room for a probationary state: only another one may go
            assert kind == "probationary"
        elif kind != "probationary":  # a regular state went only when no probationary one could
            assert not probationary_left
    # a turn reuses the previous turn's input end (on probation, or confirmed), not the one before;
    # extra_buffer's snapshots sit on its 64-token grid, which these 20-token turns rarely cross
    assert sum(hits) > sum(baseline) if not extra_buffer else sum(hits) >= sum(baseline)


def test_the_runtime_shadows_model_probation():
    cc, runtime = serve(False, True, alpha=None)
    assert runtime.settings.probation
    assert runtime.tuner.tuner.shared.probation  # the shadows keep probationary states too
    cc2, runtime2 = serve(False, True, admission=False)
    assert not runtime2.settings.probation  # upstream's admission keeps its own states
    runtime.close()
    runtime2.close()
