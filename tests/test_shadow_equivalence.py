"""The restructured shadows decide exactly what the original ones did: the package's tuner and the
frozen reference (`reference_shadow_tuner.py`: every shadow a plain `HybridPrefixCache`) are fed
the same streams (contention, branches, probation, two budgets, pages and a checkpoint grid, an
attention-only model, sampling with and without the verifier, pruning and revival, the prior, the
guard) and must return the same choice at every request, and hold bit-identical evidence (scores,
potentials, clustered moments, halves, sessions), since-switch sums (while the guard may read them),
logs, verifier state and shadow contents (bytes, states, clocks, eviction counts) every 50 requests."""

from dataclasses import dataclass, replace

import numpy as np
import pytest
import reference_shadow_tuner as reference
import shadow_streams as streams
from toy_profile import ToyProfile

from sglang_marconi.policy.tuning import shadow_tuner
from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.tuning.sampling import session_in_sample


@dataclass(frozen=True)
class AttentionOnlyToy(ToyProfile):
    """No SSM layers: any cached prefix is reusable, no state is ever checkpointed."""

    name: str = "toy-attention"
    ssm_state_bytes: int = 0


FAST = dict(half_life=60.0, guard_half_life=20.0, dwell=12, persist=300.0, prune_after=40, revive_every=150)


def evidence_state(ev):
    if ev is None:
        return None
    return (ev.scores.copy(), ev.potential.copy(), ev.moments.copy(), ev.halves.copy(), ev.t,
            {s: (d.copy(), t, h, n) for s, (d, t, h, n) in ev.sessions.items()})


def assert_same_evidence(a, b, where):
    if a is None or b is None:
        assert a is None and b is None, where
        return
    for x, y, name in zip(a[:4], b[:4], ("scores", "potential", "moments", "halves")):
        assert np.array_equal(x, y), f"{where}: evidence {name} differ"
    assert a[4] == b[4], where
    assert a[5].keys() == b[5].keys(), where
    for s in a[5]:
        (d1, *r1), (d2, *r2) = a[5][s], b[5][s]
        assert np.array_equal(d1, d2) and r1 == r2, f"{where}: session {s}"


def assert_same_guard_sums(new, ref, where):
    """The guard's two arms (safe and current) hold exactly the reference's sums for them."""
    a, b = new.arms
    assert new.t == ref.t and new.potential == ref.potential[0], where
    assert new.scores == [ref.scores[0, a], ref.scores[0, b]], where
    m = ref.moments[0]
    assert new.moments == [m[a, a], m[b, b], m[a, b]] and m[a, b] == m[b, a], where
    assert new.halves == [[ref.halves[0, h, a], ref.halves[0, h, b]] for h in (0, 1)], where
    assert new.sessions == {key: (d[0, a], d[0, b], h, n) for key, (d, _, h, n) in ref.sessions.items()}, where


def cache_state(cache):
    if cache is None:
        return None
    return cache.kv_tokens, cache.ssm_states, cache.clock, (cache.counters.evictions_leaf,
                                                           cache.counters.evictions_single_child,
                                                           cache.counters.admissions_skipped)


def assert_same_tuners(new, ref, where):
    assert new.current == ref.current, where
    for field in ("decisions", "requests", "sampled", "forked_at", "reverts", "prior", "pruned", "revived"):
        assert getattr(new.log, field) == getattr(ref.log, field), f"{where}: log.{field}"
    assert np.array_equal(new.scores, ref.scores) and new.potential == ref.potential, where
    assert np.array_equal(new.strikes, ref.strikes) and np.array_equal(new._held, ref._held), where
    assert_same_evidence(evidence_state(new.evidence), evidence_state(ref.evidence), f"{where} evidence")
    if new.guard_reads_since():  # else neither tuner reads it before the next switch resets it
        assert_same_guard_sums(new.since, ref.since, f"{where} since")
    assert (new.shared is None) == (ref.shared is None), where
    assert [cache_state(s) for s in new.shadows] == [cache_state(s) for s in ref.shadows], where
    assert (new.mini is None) == (ref.mini is None), where
    if new.mini is not None:
        assert_same_evidence(evidence_state(new.mini.evidence), evidence_state(ref.mini.evidence), f"{where} mini")
        assert [cache_state(s) for s in new.mini.shadows] == [cache_state(s) for s in ref.mini.shadows], where
    assert (new.verifier is None) == (ref.verifier is None), where
    if new.verifier is not None:
        nv, rv = new.verifier, ref.verifier
        assert [a for a, _ in nv.arms] == [a for a, _ in rv.arms], where
        assert [cache_state(c) for _, c in nv.arms] == [cache_state(c) for _, c in rv.arms], where
        assert (nv.mirror, nv.trial, nv.trial_started, nv._held) == (rv.mirror, rv.trial, rv.trial_started, rv._held)
        assert np.array_equal(nv._blocked_until, rv._blocked_until), where
        assert_same_evidence(evidence_state(nv.evidence), evidence_state(rv.evidence), f"{where} verifier")


def run_both(profile, capacity, config, stream, check_every=50, sampled_only_after=None, **kwargs):
    """`sampled_only_after`: from that request on, pass only sampled requests and count the others
    (as the server's background tuner does): the verifier steps aside mid-stream."""
    # The guard on the live cache's stand-in came after the reference, a change of rule on purpose
    # (`test_shadow_tuner.py` tests it): off here, the rest must still match the reference exactly.
    new = shadow_tuner.ShadowTuner(profile, capacity, replace(config, live_guard=False), **kwargs)
    ref = reference.ShadowTuner(profile, capacity, reference.ShadowConfig(**{k: v for k, v in config.__dict__.items() if k in reference.ShadowConfig.__dataclass_fields__}), **kwargs)
    for i, (sid, inp, out) in enumerate(stream):
        if sampled_only_after is not None and i >= sampled_only_after and not session_in_sample(sid, config.sample_rate):
            new.log.requests += 1
            ref.log.requests += 1
            continue
        got, want = new.observe(sid, inp, out), ref.observe(sid, inp, out)
        assert got == want, f"request {i}: switched to {got!r}, the reference to {want!r}"
        if i % check_every == 0:
            assert_same_tuners(new, ref, f"after request {i}")
    assert_same_tuners(new, ref, "at the end")
    for cache in [*new.shadows, *(c for _, c in (new.verifier.arms if new.verifier else []))]:
        if cache is not None:
            cache.check_invariants()
    return new


TOY = ToyProfile()
BASE = shadow_tuner.ShadowConfig()
CASES = {
    # (profile, capacity, config, stream factory, tuner keyword arguments)
    "contended-600": (TOY, 600, BASE, lambda: streams.contended_requests(500), {}),
    "contended-1500-fast": (TOY, 1500, replace(BASE, **FAST), lambda: streams.contended_requests(700, seed=3), {}),
    "conversations-700": (TOY, 700, BASE, lambda: streams.conversations(500), {}),
    "conversations-2000-fast": (TOY, 2000, replace(BASE, **FAST), lambda: streams.conversations(700, seed=4), {}),
    "branching-60": (TOY, 60, BASE, lambda: streams.branching(600), {}),
    "branching-150-fast": (TOY, 150, replace(BASE, **FAST), lambda: streams.branching(800, seed=2), {}),
    "branching-400": (TOY, 400, replace(BASE, **FAST), lambda: streams.branching(600, seed=5, alphabet=3), {}),
    "agent-3000-fast": (TOY, 3000, replace(BASE, **FAST), lambda: streams.agent_sessions(500), {}),
    "revisits-prior": (TOY, 2000, replace(BASE, alpha_grid=(0.0, 5.0), seglen_weights=()),
                       lambda: streams.revisits(250, 12), {}),
    "shift-guard": (TOY, 500, replace(BASE, alpha_grid=(0.0, 5.0), seglen_weights=(100.0,), objective="token_hit_rate"),
                    lambda: streams.shift_to_recency(500), {}),
    "probation-conversations": (TOY, 900, replace(BASE, **FAST), lambda: streams.conversations(600, seed=7),
                                {"probation": True}),
    "probation-branching": (TOY, 120, BASE, lambda: streams.branching(700, seed=8), {"probation": True}),
    "state-slots-conversations": (TOY, 400, replace(BASE, **FAST), lambda: streams.conversations(600, seed=9),
                                  {"state_slots": 6}),
    "state-slots-branching-probation": (TOY, 200, BASE, lambda: streams.branching(600, seed=10),
                                        {"state_slots": 4, "probation": True}),
    "sampled-misleading-verified": (TOY, 1000, replace(BASE, sample_rate=0.25, objective="token_hit_rate"),
                                    lambda: streams.misleading_sample(1500, 0.25), {}),
    "sampled-conversations-fast": (TOY, 1600, replace(BASE, sample_rate=0.5, **FAST),
                                   lambda: streams.conversations(900, sessions=40, seed=11), {}),
    "sampled-verifier-adopts": (TOY, 1500, replace(BASE, sample_rate=0.3, **FAST), lambda: streams.revisits(600, 9), {}),
    "sampled-unverified": (TOY, 1000, replace(BASE, sample_rate=0.25, verify=False, objective="token_hit_rate"),
                           lambda: streams.misleading_sample(1200, 0.25, seed=1), {}),
    "pages-and-grid": (TOY, 800, replace(BASE, **FAST), lambda: streams.branching(600, seed=12, alphabet=2),
                       {"page_size": 4, "checkpoint_grid": 8}),
    "grid-agent-probation": (TOY, 2500, BASE, lambda: streams.agent_sessions(400, seed=13),
                             {"checkpoint_grid": 16, "probation": True}),
    "attention-only": (AttentionOnlyToy(), 300, replace(BASE, **FAST), lambda: streams.conversations(600, seed=14), {}),
    "no-miniatures": (TOY, 700, replace(BASE, prior_scale=0.0, **FAST), lambda: streams.conversations(500, seed=15), {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_decisions_as_the_reference(case):
    profile, capacity, config, stream, kwargs = CASES[case]
    run_both(profile, capacity, config, stream(), **kwargs)


def test_same_decisions_when_the_verifier_steps_aside_after_adopting():
    # the verifier adopts seglen:100 at request ~150 (see the case above); from 300 on the caller
    # passes only sampled requests, so the guard takes over with the sums since that switch
    config = replace(BASE, sample_rate=0.3, **FAST)
    tuner = run_both(TOY, 1500, config, streams.revisits(700, 9), sampled_only_after=300)
    assert tuner.verifier is None and len(tuner.log.decisions) > 1


def test_same_decisions_on_a_real_profile():
    # paper-7b: 64 KiB of KV per token, 26.8 MB per state; real FLOPs (the quadratic attention term)
    profile = load_profile("paper-7b")
    capacity = 40 * profile.ssm_state_bytes
    run_both(profile, capacity, replace(BASE, **FAST), streams.agent_sessions(400, seed=16))
