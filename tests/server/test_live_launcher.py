"""The launcher's edges through real processes: bad Marconi flags stop it with one line naming
the flag, and a model without SSM layers is served with upstream's cache."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("sglang")

from http_api import generate, internal_state  # noqa: E402

BAD_FLAGS = [
    ("--marconi-alpha", "-1"), ("--marconi-alpha", "often"), ("--marconi-alpha-grid", "0:x:1"),
    ("--marconi-retune", "maybe"), ("--marconi-objective", "speed"), ("--marconi-admission", "2"),
    ("--marconi-tune-workers", "many"), ("--marconi-bootstrap-multiplier", "-3"),
]


@pytest.mark.parametrize("flag,value", BAD_FLAGS, ids=[f"{f}={v}" for f, v in BAD_FLAGS])
def test_bad_marconi_flag_stops_the_launcher_with_one_line(flag, value, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "sglang_marconi.launch_server", "--model-path", str(tmp_path), "--device", "cpu",
         "--host", "127.0.0.1", flag, value],
        capture_output=True, text=True, timeout=120,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and flag in lines[0] and value in lines[0], done.stderr[-2000:]


def test_a_model_without_ssm_layers_gets_upstreams_cache(tiny_model, launch):
    server = launch(tiny_model("dense"))
    try:
        state = internal_state(server.url)
        assert "marconi" not in state
        prompt = list(range(10, 200))
        generate(server.url, prompt)
        again = generate(server.url, prompt + list(range(300, 320)))
        assert again.cached_tokens >= len(prompt) - 1  # upstream's radix cache reuses the prefix
    finally:
        server.stop()


def test_upstream_cache_misses_the_shared_system_prompt(tiny_model, launch):
    """The baseline the Marconi tests beat: upstream's default cache (no_buffer Mamba mode, as on
    this CPU) keeps no SSM state where requests branch off a shared system prompt, so it never
    reuses it; the same sequence hits from the third request on with Marconi (test_live_server)."""
    import random

    server = launch(tiny_model("gated-delta"), launcher="sglang")
    try:
        assert "marconi" not in internal_state(server.url)
        rng = random.Random(2)
        system = [rng.randrange(2, 512) for _ in range(150)]
        cached = [generate(server.url, system + [rng.randrange(2, 512) for _ in range(20)]).cached_tokens
                  for _ in range(6)]
        assert max(cached) < 128, cached
    finally:
        server.stop()
