"""The sliding-window prefix cache and the simulator's furiosa / sglang+ / marconi policies."""

import json

import numpy as np
import pytest

try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.policy.cost.model_profile import AttentionSpec, MlpSpec, ModelProfile, load_profile
from sglang_marconi.policy.tree.window_cache import FURIOSA, MARCONI, SGLANG, WindowPrefixCache
from sglang_marconi.sim import cli
from sglang_marconi.sim.baselines.swa_radix import WindowRadixPolicy, furiosa, marconi_swa, sglang_plus_swa
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.workload import Request

W = 8
_ATT = AttentionSpec(n_heads=2, n_kv_heads=1, head_dim=8, d_in=16, d_out=16)
TINY = ModelProfile(name="tiny-swa", architecture="test", hidden_size=16, dtype_bytes=2, ssm_dtype_bytes=2,
                    n_attention_layers=1, attention=_ATT, n_mlp_layers=4,
                    mlp=MlpSpec(d_model=16, intermediate_size=32), n_swa_layers=3, swa_attention=_ATT,
                    sliding_window=W)
FULL_B, SWA_B = TINY.kv_bytes_per_token, TINY.swa_kv_bytes_per_token  # 32 and 96 bytes per token
BIG = 10**7
RULES = {"furiosa": FURIOSA, "sglang+": SGLANG, "marconi": MARCONI}


def seq(*parts):
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in parts])


@pytest.mark.parametrize("rules", RULES.values(), ids=RULES)
def test_shared_prefix_longer_than_the_window_hits(rules):
    cache = WindowPrefixCache(TINY, BIG, rules, alpha=1.0)
    system = (0, 40)
    assert cache.serve(seq(system, (1000, 1010)), seq((2000, 2005)))[0].hit_tokens == 0
    second, _ = cache.serve(seq(system, (3000, 3010)), seq((4000, 4005)))
    third, _ = cache.serve(seq(system, (5000, 5010)), seq((6000, 6005)))
    # the second request finds the branch at 40 (furiosa kept every window and hits there at once);
    # the window kept there makes the third hit the whole system prompt
    assert third.hit_tokens == 40 and third.end_reason == "token_mismatch"
    assert second.hit_tokens == (40 if rules is FURIOSA else 0)
    assert second.end_reason == ("token_mismatch" if rules is FURIOSA else "broken_window")
    cache.check_invariants()


@pytest.mark.parametrize("rules", RULES.values(), ids=RULES)
def test_multi_turn_hits_the_previous_turn_and_windows_only_are_kept(rules):
    cache = WindowPrefixCache(TINY, BIG, rules)
    turn1_in, turn1_out = seq((0, 30)), seq((100, 110))
    cache.serve(turn1_in, turn1_out)
    lookup, _ = cache.serve(np.concatenate((turn1_in, turn1_out, seq((200, 220)))), seq((300, 305)))
    assert lookup.hit_tokens == 40
    # windows-only policies keep at most a window per kept point; furiosa keeps every token's SWA KV
    if rules is FURIOSA:
        assert cache.swa_tokens == cache.full_tokens == 65
    else:
        assert cache.swa_tokens <= 2 * W and cache.full_tokens == 65
    cache.check_invariants()


def test_verify_hit_rejects_a_broken_window_and_missing_tokens():
    cache = WindowPrefixCache(TINY, BIG, SGLANG)
    cache.serve(seq((0, 39)), seq((39, 40)))  # the window before the last decoded token: [32, 40)
    probe = seq((0, 40), (500, 510))
    cache.verify_hit(probe, 40)  # the window before the end is kept
    with pytest.raises(MarconiError, match="broken window"):
        cache.verify_hit(probe, 20)  # full KV is there, the window before 20 is not
    with pytest.raises(MarconiError, match="only 40 are cached"):
        cache.verify_hit(seq((0, 45), (900, 910)), 45)


class _OverclaimingCache(WindowPrefixCache):
    """A broken lookup: reports the whole token overlap as a hit, windows or not."""

    def lookup(self, input_tokens):
        found = super().lookup(input_tokens)
        return type(found)(min(found.overlap_tokens, len(input_tokens) - 1), found.overlap_tokens, None, "input_end")


def test_the_per_request_check_catches_a_hit_without_its_window():
    policy = WindowRadixPolicy("broken", TINY, BIG, SGLANG)
    policy.cache = _OverclaimingCache(TINY, BIG, SGLANG)
    policy.serve(Request("a", 0, 0.0, seq((0, 40)), seq((100, 101))))
    with pytest.raises(MarconiError, match="broken window"):
        policy.serve(Request("b", 0, 1.0, seq((0, 20), (700, 710)), seq((800, 801))))


def _parent_with_short_branch(rules):
    """A node X = [0, 40) keeping a window at its end, with a child leaf of 4 tokens whose window
    reaches into X, and a second long child; X's window is the only thing inside that branch's
    last window that eviction could tombstone."""
    cache = WindowPrefixCache(TINY, BIG, rules, alpha=0.0)
    cache.serve(seq((0, 40), (100, 120)), seq((150, 151)))
    cache.serve(seq((0, 40), (300, 303)), seq((350, 351)))  # branch at 40: a 4-token leaf
    node = cache.tree.walk(seq((0, 40))).last
    assert node.end == 40 and node.swa > 0
    return cache, node


def test_marconi_never_tombstones_inside_a_branch_last_window():
    cache, node = _parent_with_short_branch(MARCONI)
    assert not cache._window_victim(node)
    sglang, node = _parent_with_short_branch(SGLANG)
    assert sglang._window_victim(node)  # SGLang #35515: it may, and the short branch goes unmatchable


def test_budgets_hold_and_split_pools_are_separate():
    cap = 40 * (FULL_B + SWA_B)
    for rules in RULES.values():
        for share in (None, 0.5):
            cache = WindowPrefixCache(TINY, cap, rules, alpha=20.0, swa_share=share)
            rng = np.random.default_rng(0)
            for i in range(60):
                cache.serve(rng.integers(0, 4, size=int(rng.integers(5, 30))), seq((1000 * i, 1000 * i + 5)))
                cache.check_invariants()
            if share is not None:
                assert cache.swa_tokens * SWA_B <= cap * share and cache.full_tokens * FULL_B <= cap - cap * share
    with pytest.raises(MarconiError, match="holds no SWA window"):
        WindowPrefixCache(TINY, W * SWA_B - 1, SGLANG)
    with pytest.raises(MarconiError, match="swa_share must be in"):
        WindowPrefixCache(TINY, BIG, SGLANG, swa_share=1.5)
    with pytest.raises(MarconiError, match="no sliding-window layers"):
        WindowPrefixCache(load_profile("llama-3-8b"), BIG, SGLANG)


if given is not None:
    @settings(max_examples=60, deadline=None)
    @given(rules=st.sampled_from(sorted(RULES)), share=st.sampled_from([None, 0.6]),
           requests=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=40),
                                       st.integers(0, 6)), min_size=1, max_size=25))
    def test_every_hit_is_valid_and_maximal(rules, share, requests):
        """Each reported hit passes the independent check (inside `serve`), and no longer prefix
        of the input would have: the lookup finds the longest reusable prefix."""
        policy = WindowRadixPolicy(rules, TINY, 30 * (FULL_B + SWA_B), RULES[rules], alpha=1.0, swa_share=share)
        for i, (tokens, out_len) in enumerate(requests):
            inp = np.asarray(tokens, dtype=np.int64)
            lookup = policy.cache.lookup(inp)
            for longer in range(lookup.hit_tokens + 1, min(lookup.overlap_tokens, len(inp) - 1) + 1):
                with pytest.raises(MarconiError):
                    policy.cache.verify_hit(inp, longer)
            policy.serve(Request(str(i % 3), i, float(i), inp, np.arange(out_len, dtype=np.int64) + 10))
            policy.cache.check_invariants()


def test_policies_build_for_swa_models_only():
    p = load_profile("gpt-oss-20b")
    assert build_policy("furiosa", p, 10**9).name == "furiosa"
    assert build_policy("marconi:5", p, 10**9).cache.alpha == 5.0
    with pytest.raises(MarconiError, match="does not model sliding-window layers"):
        build_policy("vllm+", p, 10**9)
    with pytest.raises(MarconiError, match="furiosa models sliding-window hybrids"):
        build_policy("furiosa", load_profile("llama-3-8b"), 10**9)


def test_cli_reports_hit_end_reasons(tmp_path, capsys):
    out = tmp_path / "runs.json"
    code = cli.main(["--model", "gpt-oss-20b", "--workload", "synthetic:system-prompt:sessions=30",
                     "--capacity", "0.2GB", "--policies", "furiosa,sglang+,marconi,marconi:0", "--json", str(out),
                     "--with-requests", "--no-progress"])
    assert code == 0
    runs = {r["policy"]: r for r in json.loads(out.read_text())}
    for r in runs.values():
        reasons = r["per_request"]["hit_end_reason"]
        assert len(reasons) == r["requests"] and set(reasons) <= {"input_end", "token_mismatch", "broken_window"}
    assert runs["marconi"]["token_hit_rate"] > 0
    assert "furiosa" in capsys.readouterr().out


def test_tuned_marconi_adopts_an_alpha_from_its_shadows():
    from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig
    from sglang_marconi.sim.replay import replay
    from sglang_marconi.sim.traces import load_workload

    p = load_profile("gpt-oss-20b")
    wl = load_workload("synthetic:swe-agent", "conversation")
    policy = marconi_swa(p, 2 * 10**9, tuning=ShadowConfig(half_life=200.0, guard_half_life=100.0, dwell=20))
    tuned = replay(wl, policy, p, 2 * 10**9, progress=False)
    lru = replay(wl, sglang_plus_swa(p, 2 * 10**9), p, 2 * 10**9, progress=False)
    assert policy.tuner.decisions and tuned.alpha_history[-1][1] > 0
    assert tuned.token_hit_rate >= lru.token_hit_rate - 0.005
    assert replay(wl, furiosa(p, 2 * 10**9), p, 2 * 10**9, progress=False).requests == len(wl)
