"""The simulator's host tier under the continuation signal and clients' hints: `--host-depth`
(`marconi` with a host tier ranks its host by `tier_rules.DepthOrder`), and a trace's `24h` hints
reaching the host tier (`sim/hinted.py` hands the ledger to `TieredPrefixCache.client_hints`)."""

import json

import numpy as np
import pytest
from toy_profile import ToyProfile

from sglang_marconi.sim import hinted
from sglang_marconi.sim.cli import main
from sglang_marconi.sim.hinted import HintedPolicy, with_trace_hints
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.workload import Request

WORKLOAD = "synthetic:lmsys:sessions=12,scale=0.3"
PROBES, LENGTH, FILLERS = 8, 130, 17  # first turns of 130 tokens: two blocks of the record (64 tokens)


def _trace(retention):
    """8 conversations whose second turns all lose their first (so the ledger starts granting),
    then a conversation T (hinted with `retention`, or not), 17 unrelated first turns that push T
    off the device, and T's second turn. The hosts holds the probes' second turns (depth 1)."""
    hint = (lambda key: {"prompt_cache_key": key, "prompt_cache_retention": retention}) if retention else (
        lambda key: {})
    requests = []

    def add(session, turn, inp, out, **kw):
        requests.append(Request(session, turn, float(len(requests)), np.asarray(inp), np.asarray(out), **kw))

    firsts = []
    for p in range(PROBES):
        base = 10_000 * (p + 1)
        add(f"p{p}", 0, base + np.arange(LENGTH), base + 500 + np.arange(5), **hint(f"p{p}"))
        firsts.append(np.concatenate((requests[-1].input_tokens, requests[-1].output_tokens)))
    for p in range(PROBES):
        base = 10_000 * (p + 1)
        add(f"p{p}", 1, np.concatenate((firsts[p], base + 700 + np.arange(10))), base + 800 + np.arange(5),
            **hint(f"p{p}"))
    t_in, t_out = 900_000 + np.arange(LENGTH), 900_500 + np.arange(5)
    add("T", 0, t_in, t_out, **hint("T"))
    for f in range(FILLERS):
        add(f"f{f}", 0, 500_000 + 1000 * f + np.arange(LENGTH), 500_500 + 1000 * f + np.arange(5))
    add("T", 1, np.concatenate((t_in, t_out, 900_700 + np.arange(10))), 900_800 + np.arange(5), **hint("T"))
    return requests


def _t_second_turn(retention, host_capacity=450):
    """T's second turn through Marconi (alpha 0) with a host ranked by depth (B = 16), the
    trace's hints applied (share 1: room for T's credit): (hit tokens, of them from the host)."""
    policy = with_trace_hints(build_policy("marconi:0", ToyProfile(), 400, host_capacity=host_capacity,
                                           host_depth=16.0), share=1.0)
    assert isinstance(policy, HintedPolicy) and policy.cache.client_hints is policy.ledger
    outcomes = [policy.serve(r) for r in _trace(retention)]
    policy.cache.check_invariants()
    policy.ledger.check()
    return outcomes[-1].hit_tokens, outcomes[-1].host_hit_tokens


@pytest.mark.parametrize("host_capacity", [300, 450, 600])
def test_a_24h_hint_keeps_a_conversation_on_the_simulated_host_that_unhinted_traffic_loses(host_capacity):
    """Host contended by deeper conversations: unhinted, T's end (depth 0) is ranked below them
    and dropped as it leaves the device; `in-memory` credits it on the device (it leaves it
    later) but the host still ranks it below; `24h` demotes it whatever it displaces, and its
    second turn loads it back."""
    assert _t_second_turn(None, host_capacity) == (0, 0)
    assert _t_second_turn("in-memory", host_capacity) == (0, 0)
    assert _t_second_turn("24h", host_capacity) == (LENGTH + 5, LENGTH + 5)


def test_without_the_ledger_on_the_host_tier_the_24h_hint_is_lost(monkeypatch):
    """The mutant: HintedPolicy no longer hands its ledger to the host tier."""
    original = hinted.HintedPolicy.__init__

    def unwired(self, policy, **kw):
        original(self, policy, **kw)
        policy.cache.client_hints = None

    monkeypatch.setattr(hinted.HintedPolicy, "__init__", unwired)
    policy = with_trace_hints(build_policy("marconi:0", ToyProfile(), 400, host_capacity=450, host_depth=16.0),
                              share=1.0)
    outcomes = [policy.serve(r) for r in _trace("24h")]
    assert outcomes[-1].host_hit_tokens == 0


def test_host_depth_reaches_the_tier_rule(tmp_path, capsys):
    for depth, name in ((None, "marconi"), (4.0, "marconi+depth:4"), ("auto", "marconi+depth:auto")):
        policy = build_policy("marconi", ToyProfile(), 400, host_capacity=450, host_depth=depth)
        assert policy.cache.rules.name == name and policy.cache.rules.depth == depth
        assert (policy.cache.continuation is not None) == (depth is not None)
    out = tmp_path / "runs.json"
    assert main(["--workload", WORKLOAD, "--capacity", "0.5GB", "--host-capacity", "2GB", "--policies",
                 "sglang+,marconi:1", "--host-depth", "2", "--json", str(out), "--no-progress"]) == 0
    rules = {r["policy"]: r["host_rules"] for r in json.loads(out.read_text())}
    assert rules == {"sglang+": "upstream-write-back", "marconi(alpha=1)+host-depth:2": "marconi+depth:2"}


@pytest.mark.parametrize("value", ["-1", "x", "nan", "1e9", "on"])
def test_a_bad_host_depth_is_named_in_one_line(value, capsys):
    with pytest.raises(SystemExit):
        main(["--workload", WORKLOAD, "--policies", "marconi", "--host-capacity", "1GB", "--host-depth", value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--host-depth" in err and repr(value) in err


def test_host_depth_needs_a_host_tier(capsys):
    assert main(["--workload", WORKLOAD, "--policies", "marconi", "--host-depth", "2", "--no-progress"]) == 2
    assert "--host-capacity" in capsys.readouterr().err
