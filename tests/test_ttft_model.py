"""Modeled (roofline-style, not measured) TTFT from prefill FLOPs."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim import ttft_model
from sglang_marconi.sim.ttft_model import GPU_PROFILES, get_gpu_profile, modeled_ttft_seconds


def test_profiles_present_with_dense_bf16_peaks():
    peaks = {name: p.peak_flops for name, p in GPU_PROFILES.items()}
    assert peaks == {
        "A100-40GB": 312e12,
        "A100-80GB": 312e12,
        "H100-SXM": 989e12,
        "H200": 989e12,
        "L40S": 362e12,
    }
    assert all(p.mfu == 0.45 and p.n_gpus == 1 for p in GPU_PROFILES.values())


def test_scalar_formula():
    t = modeled_ttft_seconds(312e12 * 0.45, "A100-40GB")
    assert isinstance(t, float)
    assert t == pytest.approx(1.0)
    assert modeled_ttft_seconds(0.0, "H200") == 0.0
    assert modeled_ttft_seconds(989e12, "H100-SXM", mfu=0.5) == pytest.approx(2.0)


def test_tensor_parallel_prefix_divides_time():
    one = modeled_ttft_seconds(1e15, "A100-40GB")
    four = modeled_ttft_seconds(1e15, "4xA100-40GB")
    assert four == pytest.approx(one / 4)
    p = get_gpu_profile("4xA100-40GB")
    assert (p.name, p.n_gpus, p.peak_flops) == ("4xA100-40GB", 4, 312e12)
    assert get_gpu_profile("2x h200").n_gpus == 2  # case-insensitive, spaces tolerated


def test_array_input_is_vectorized():
    flops = np.array([0.0, 1e12, 5e14])
    out = modeled_ttft_seconds(flops, "L40S")
    assert isinstance(out, np.ndarray) and out.shape == (3,)
    np.testing.assert_allclose(out, flops / (362e12 * 0.45))


def test_unknown_gpu_lists_known_ones():
    with pytest.raises(MarconiError) as e:
        modeled_ttft_seconds(1e12, "B200")
    msg = str(e.value)
    assert "B200" in msg
    assert all(name in msg for name in GPU_PROFILES)


@pytest.mark.parametrize("bad", ["0xA100-40GB", ""])
def test_bad_gpu_names(bad):
    with pytest.raises(MarconiError):
        get_gpu_profile(bad)


@pytest.mark.parametrize("mfu", [0.0, -0.1, 1.5])
def test_bad_mfu(mfu):
    with pytest.raises(MarconiError, match="mfu"):
        modeled_ttft_seconds(1e12, "H200", mfu=mfu)


@pytest.mark.parametrize("flops", [-1.0, float("nan"), np.array([1.0, -2.0])])
def test_bad_flops(flops):
    with pytest.raises(MarconiError, match="flops"):
        modeled_ttft_seconds(flops, "H200")


def test_docstring_says_modeled_not_measured():
    doc = ttft_model.__doc__.lower()
    assert "roofline" in doc and "not a measurement" in doc
