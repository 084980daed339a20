"""A server's life beyond its first minute, through a real SGLang server on this CPU.

- Idle periods longer than the tuner's stall limit never stop tuning: requests reach the tuner
  when the scheduler goes idle, and a stall is measured from the oldest request it has not read.
- `scripts/serve_tiny.sh` stops its whole process tree on SIGTERM and on Ctrl-C (SIGINT).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")
psutil = pytest.importorskip("psutil")
requests = pytest.importorskip("requests")

from http_api import generate, marconi_figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 3


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def workload(n):
    """A long, valuable prefix revisited every 6th request among short one-offs that push it out
    of the small pools under LRU: the FLOP-aware shadows keep it, so the shadows separate."""
    long = tokens(1, 700)
    for i in range(n):
        yield long + tokens(10_000 + i, 20) if i % 6 == 0 else tokens(20_000 + i, 350 + 10 * (i % 10))


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_idle_server_keeps_tuning_and_adopts_a_choice(tiny_model, launch):
    server = launch(tiny_model("gated-delta"), extra_args=[
        "--max-total-tokens", "2200", "--max-mamba-cache-size", "8", "--chunked-prefill-size", "512",
        "--marconi-tune-stall-timeout", str(STALL_S), "--marconi-tune-sync-every", "4",
        "--marconi-alpha-grid", "0,20", "--marconi-seglen-weights", "none",
    ])
    def all_handed_over():  # the scheduler's side: what its idle path does, whatever the child's pace
        figures = marconi_figures(server.url)
        return figures["marconi_tuner_requests_fed"] == figures["marconi_requests"] and figures

    def all_observed():  # the child's side: at nice 19 it may wait for CPU on a loaded machine
        figures = marconi_figures(server.url)
        return figures["marconi_tuner_requests_observed"] == figures["marconi_requests"] and figures

    try:
        before = marconi_figures(server.url)["marconi_requests"]  # the server's own warm-up requests
        for tokens_ in list(workload(3)):  # a partial batch (< 16 requests) ...
            generate(server.url, tokens_, max_new_tokens=2)
        # ... reaches the tuner while the server is idle, without more traffic (the bound allows for a
        # scheduler starved of CPU by a loaded machine: what is guaranteed is that it happens idle).
        assert wait_until(all_handed_over, 120, "the idle scheduler to hand the partial batch over")[
            "marconi_requests"] == before + 3
        wait_until(all_observed, 120, "the tuner to observe the partial batch")
        time.sleep(2 * STALL_S)  # idle for twice the stall limit
        for tokens_ in workload(90):
            generate(server.url, tokens_, max_new_tokens=2)
        figures = wait_until(all_observed, 120, "the tuner to observe every request")
        assert figures["marconi_requests"] == before + 93
        assert figures["marconi_tuning_failures"] == 0, server.log_tail()
        assert figures["marconi_tuner_requests_dropped"] == 0
        assert figures["marconi_choice_switches"] >= 1 and figures["marconi_choice"] != "lru", figures
        assert "Marconi tuning stopped" not in server.log_path.read_text(errors="replace")
    finally:
        server.stop()


def _serve_tiny(port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(["bash", str(ROOT / "scripts" / "serve_tiny.sh"), "--port", str(port)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "ctrl-c"])
def test_serve_tiny_stops_its_whole_process_tree(sig, tiny_model):
    from live_server import free_port

    port = free_port()
    script = _serve_tiny(port)
    tree: list = []
    try:
        wait_until(lambda: _healthy(port) or script.poll() is not None, 300, "serve_tiny.sh to serve")
        assert script.poll() is None, "serve_tiny.sh exited before serving"
        tree = psutil.Process(script.pid).children(recursive=True)
        assert len(tree) >= 3  # the launcher, its scheduler, detokenizer, ...
        script.send_signal(sig)
        script.wait(60)
        gone, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
        with pytest.raises(requests.RequestException):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        if script.poll() is None:
            script.kill()


def _healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health_generate", timeout=30).status_code == 200
    except requests.RequestException:
        return False
