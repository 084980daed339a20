"""The test-only platform stand-in for SGLang's Mamba state snapshots (`tests/cpu_engine/
snapshot_platform.py`), which lets the CPU engine run `--mamba-radix-cache-strategy extra_buffer`,
checked against SGLang's no_buffer path:

- decode-time snapshots (`track_mamba_states_if_needed` / `track_mamba_states_all_layers`
  stand-ins) against `MambaPool.copy_from`, the copy no_buffer mode makes of a request's state;
- prefill-time snapshots (the gated-delta-rule prefill's per-chunk states `h`, the Mamba2 scan's
  tracked states off its chunk grid), selected the way SGLang's backend selects them
  (`build_prefill_track_plan`), against the state a no_buffer prefill that ends at the tracked
  position leaves in its slot: bitwise equal, so a hit on a snapshot reproduces the uncached
  output exactly;
- the platform answer itself, in a process started as the live server is (and refused without).

Each comparison also checks that the snapshot differs from a state one token off, so a wrong
offset cannot pass.
"""

import pytest

pytest.importorskip("sglang")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from test_cpu_kernels import stand_ins  # noqa: E402

gated_delta_rule, mamba2_scan, state_snapshot = stand_ins("gated_delta_rule", "mamba2_scan", "state_snapshot")


# ---------------------------------------------------------------- decode-time snapshots


def _mamba_pool(slots=12, seed=0):
    """SGLang's MambaPool for a small Mamba2 hybrid (6 Mamba layers), every state random."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=2, head_dim=16,
                                    state_size=16, conv_kernel=4)
    layers = [0, 1, 2, 4, 5, 6]
    pool = HybridReqToTokenPool(
        size=4, mamba_size=slots, mamba_spec_state_size=4, max_context_len=256, device="cpu",
        enable_memory_saver=False, cache_params=Mamba2CacheParams(shape=shape, layers=layers),
        mamba_layer_ids=layers, enable_mamba_extra_buffer=True, speculative_num_draft_tokens=None,
    ).mamba_pool
    g = torch.Generator().manual_seed(seed)
    cache = pool.mamba_cache
    for t in (*cache.conv, cache.temporal):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def _states(pool):
    return [t.clone() for t in (*pool.mamba_cache.conv, pool.mamba_cache.temporal)]


# A decode batch of 5 requests: their slots, which of them cross a track boundary this step, and
# the ping-pong slots their snapshots go to (SGLang's ScheduleBatch.prepare_for_decode).
CACHE_INDICES = torch.tensor([1, 2, 3, 4, 5])
TRACK_MASK = torch.tensor([True, False, True, True, False])
TRACK_INDICES = torch.tensor([7, 8, 9, 10, 11])


def _no_buffer_copy(pool):
    """What no_buffer mode does to keep a request's state: MambaPool.copy_from, slot to slot."""
    pool.copy_from(CACHE_INDICES[TRACK_MASK], TRACK_INDICES[TRACK_MASK])


def test_all_layers_snapshot_equals_sglang_no_buffer_copy():
    snapshot, reference = _mamba_pool(), _mamba_pool()
    before = _states(snapshot)
    cache = snapshot.mamba_cache
    state_snapshot.track_mamba_states_all_layers(cache.conv[0], cache.temporal, CACHE_INDICES, TRACK_MASK,
                                                 TRACK_INDICES, len(CACHE_INDICES))
    _no_buffer_copy(reference)
    for ours, theirs, old in zip(_states(snapshot), _states(reference), before):
        assert torch.equal(ours, theirs)
        assert not torch.equal(ours, old)  # something was copied
    # Unmasked rows' destinations (8, 11) are untouched.
    assert torch.equal(cache.temporal[:, [8, 11]], before[-1][:, [8, 11]])


def test_per_layer_snapshot_equals_sglang_no_buffer_copy():
    snapshot, reference = _mamba_pool(), _mamba_pool()
    cache = snapshot.mamba_cache
    for layer in range(cache.temporal.shape[0]):  # what a layer-wise backend call does
        state_snapshot.track_mamba_states_if_needed(cache.conv[0][layer], cache.temporal[layer], CACHE_INDICES,
                                                    TRACK_MASK, TRACK_INDICES, len(CACHE_INDICES))
    _no_buffer_copy(reference)
    assert all(torch.equal(a, b) for a, b in zip(_states(snapshot), _states(reference)))


def test_snapshot_skips_freed_slots_when_asked():
    pool = _mamba_pool()
    before = _states(pool)
    cache = pool.mamba_cache
    src = torch.tensor([1, -1, 3])
    dst = torch.tensor([7, 8, -1])
    state_snapshot.track_mamba_states_all_layers(cache.conv[0], cache.temporal, src, torch.ones(3, dtype=torch.bool),
                                                 dst, 3, check_freed_slots=True)
    assert torch.equal(cache.temporal[:, 7], before[-1][:, 1])
    assert torch.equal(cache.temporal[:, [0, 2, 3, 4, 5, 6, 8, 9, 10, 11]],
                       before[-1][:, [0, 2, 3, 4, 5, 6, 8, 9, 10, 11]])


# ---------------------------------------------------------------- prefill-time snapshots


def _gdn_inputs(T, H=2, HV=4, K=16, V=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    inp = dict(q=rand(T, H, K), k=rand(T, H, K), v=rand(T, HV, V), a=rand(T, HV), b=rand(T, HV),
               A_log=rand(HV) * 0.5, dt_bias=rand(HV))
    return inp, rand(6, HV, V, K) * 0.5


def _gdn_prefill(inp, lengths, pool, slots, start=0):
    """chunk_gated_delta_rule as SGLang's GDN backend calls it on CPU; returns h [NT, HV, V, K]."""
    sl = lambda t: t[start:start + sum(lengths)]
    g, beta = gated_delta_rule.fused_gdn_gating(inp["A_log"], sl(inp["a"]), sl(inp["b"]), inp["dt_bias"])
    _, _, h = gated_delta_rule.chunk_gated_delta_rule(
        sl(inp["q"])[None], sl(inp["k"])[None], sl(inp["v"])[None], g, beta, initial_state=pool,
        initial_state_indices=torch.tensor(slots), cu_seqlens=torch.tensor([0, *lengths]).cumsum(0),
        use_qk_l2norm_in_kernel=True)
    return h[0]


def _plan(track_lens, extend_lens, chunk, mamba2):
    from sglang.srt.layers.attention.mamba.prefill_track_metadata import build_prefill_track_plan

    return build_prefill_track_plan([True] * len(track_lens), track_lens, extend_lens, [0] * len(track_lens),
                                    chunk, mamba2=mamba2)


def test_gdn_prefill_snapshots_equal_no_buffer_prefills_ending_there():
    """A batch of three extends (150, 200, 70 tokens from three slots); SGLang tracks 128, 64 and
    64 tokens into them (`_force_track_h` asks for position + 1, so h is read), and reads
    h[h_src]. Each must equal the state a no_buffer prefill of exactly that many tokens leaves."""
    lengths, slots, tracked = [150, 200, 70], [1, 2, 4], [128, 64, 64]
    inp, pool = _gdn_inputs(sum(lengths))
    h = _gdn_prefill(inp, lengths, pool.clone(), slots)
    plan = _plan([t + 1 for t in tracked], lengths, gated_delta_rule.CHUNK_SIZE, mamba2=False)
    assert plan.h_rows == [0, 1, 2]
    start = 0
    for row, (length, slot, position) in enumerate(zip(lengths, slots, tracked)):
        snapshot = h[plan.h_src[row]]
        ended = pool.clone()
        _gdn_prefill(inp, [position], ended, [slot], start)  # no_buffer: a prefill ending there
        one_more = pool.clone()
        _gdn_prefill(inp, [position + 1], one_more, [slot], start)
        assert torch.equal(snapshot, ended[slot])
        assert not torch.equal(snapshot, one_more[slot])
        start += length


def _ssm_inputs(T, H=4, P=8, G=2, N=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    inp = dict(x=rand(T, H, P), dt=rand(T, H), A=-torch.exp(rand(H) * 0.5), B=rand(T, G, N), C=rand(T, G, N),
               D=rand(H), dt_bias=rand(H) * 0.5)
    return inp, rand(3, H, P, N) * 0.5


def _ssm_prefill(inp, lengths, initial_states, chunk, start=0, track_seq_idx=None, track_end_locs=None):
    """mamba_chunk_scan_combined as mamba.py calls it; returns (chunk-grid states, finals, tracked)."""
    T = sum(lengths)
    sl = lambda t: t[start:start + T][None]
    H, P = inp["x"].shape[1:]
    grid, finals, tracked = mamba2_scan.mamba_chunk_scan_combined(
        sl(inp["x"]), sl(inp["dt"]), inp["A"], sl(inp["B"]), sl(inp["C"]), chunk, D=inp["D"], dt_bias=inp["dt_bias"],
        cu_seqlens=torch.tensor([0, *lengths]).cumsum(0), initial_states=initial_states, return_varlen_states=True,
        return_track_states=True, track_seq_idx=track_seq_idx, track_end_locs=track_end_locs, dt_softplus=True,
        out=torch.empty(1, T, H, P), state_dtype=torch.float32)
    return grid[0], finals, tracked


def test_mamba2_prefill_snapshots_equal_no_buffer_prefills_ending_there():
    """A batch of three extends (20, 27, 13 tokens, chunk 8): the first starts on the flat chunk
    grid (its snapshot is read from the grid states), the others off it (SGLang has the scan
    recompute them at track_end_locs). Tracked 16, 24 and 8 tokens in."""
    lengths, tracked, chunk = [20, 27, 13], [16, 24, 8], 8
    inp, pool = _ssm_inputs(sum(lengths))
    plan = _plan([t + 1 for t in tracked], lengths, chunk, mamba2=True)
    assert plan.h_rows == [0] and plan.recompute_rows == [1, 2]
    grid, _, recomputed = _ssm_prefill(inp, lengths, pool, chunk, track_seq_idx=torch.tensor(plan.recompute_rows),
                                       track_end_locs=torch.tensor(plan.recompute_end_locs))
    snapshots = {0: grid[plan.h_src[0]], 1: recomputed[0, 0], 2: recomputed[0, 1]}
    start = 0
    for row, (length, position) in enumerate(zip(lengths, tracked)):
        _, ended, _ = _ssm_prefill(inp, [position], pool[row:row + 1], chunk, start)  # no_buffer
        _, one_more, _ = _ssm_prefill(inp, [position + 1], pool[row:row + 1], chunk, start)
        assert torch.equal(snapshots[row], ended[0])
        assert not torch.equal(snapshots[row], one_more[0])
        start += length


def test_mamba2_scan_without_tracking_returns_no_tracked_states():
    inp, pool = _ssm_inputs(12)
    assert _ssm_prefill(inp, [12], pool[:1], 8)[2] is None


# ---------------------------------------------------------------- the platform answer


def _probe(env_updates: dict) -> dict:
    code = """
import json, torch
from sglang.srt.arg_groups import mamba_hook
from sglang.kernels.ops.mamba import mamba_state_scatter_triton as scatter
from sglang.srt.layers.attention import hybrid_linear_attn_backend as backend
out = {"supports": mamba_hook._platform_supports_mamba_cache_extra_buffer(),
       "scatter": scatter.track_mamba_states_all_layers.__module__,
       "backend": backend.track_mamba_states_if_needed.__module__}
try:
    out["pinned"] = torch.arange(3).pin_memory().tolist()
except RuntimeError as error:
    out["pinned"] = str(error)[:60]
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "PYTHONPATH")}
    env.update(env_updates)
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the stand-in on a host without a GPU")
def test_cpu_engine_platform_supports_snapshots_only_with_the_stand_in():
    from live_server import cpu_engine_env

    served = _probe({k: v for k, v in cpu_engine_env().items() if k in ("SGLANG_USE_CPU_ENGINE", "PYTHONPATH")})
    assert served == {"supports": True, "scatter": "torch_kernels.state_snapshot",
                      "backend": "torch_kernels.state_snapshot", "pinned": [0, 1, 2]}
    plain = _probe({})  # SGLang's own answer on this host: no snapshots, the Triton kernels
    assert plain["supports"] is False and plain["scatter"] == plain["backend"] != "torch_kernels.state_snapshot"
