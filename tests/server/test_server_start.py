"""`live_server.start_server` without SGLang: a stand-in launcher (a few lines of Python) plays a
server whose HTTP port was taken between our check and its bind, then one that serves."""

from __future__ import annotations

import socket
import sys
import textwrap
import time

import pytest

import live_server
from live_server import ServerFailed, free_port, start_server

# Answers every GET with 200 on --port, forever (the launchers below end with it).
HEALTH_SERVER = textwrap.dedent("""
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


# Prints uvicorn's bind error and stays up (as SGLang's launcher does) the first time; serves
# /health_generate on --port after that.
FAKE_LAUNCHER = textwrap.dedent("""
    import http.server, pathlib, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    marker = pathlib.Path(sys.argv[0]).with_name("started-once")
    if not marker.exists() or "--always-taken" in sys.argv:
        marker.touch()
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
              "address already in use", flush=True)
        time.sleep(120)
""") + HEALTH_SERVER


# Serves at once, with a child in its process group; on SIGTERM it takes its time to exit (as
# SGLang's launcher does, waiting for crash diagnostics once a scheduler dies of the signal).
SLOW_TO_EXIT_LAUNCHER = textwrap.dedent("""
    import http.server, pathlib, signal, subprocess, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    pathlib.Path(sys.argv[0]).with_name("child.pid").write_text(str(child.pid))
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(30), sys.exit(0)))
""") + HEALTH_SERVER


@pytest.fixture
def fake_launcher(tmp_path, monkeypatch):
    (tmp_path / "fake_launcher.py").write_text(FAKE_LAUNCHER)
    monkeypatch.setitem(live_server.LAUNCHERS, "fake", "fake_launcher")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def test_free_ports_lie_below_the_ephemeral_range_and_are_free():
    low = live_server._ephemeral_range()[0]
    for _ in range(20):
        port = free_port()
        if low > 21000:
            assert 20000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_retried_at_once_on_another(fake_launcher):
    started = time.monotonic()
    server = start_server("unused-model", launcher="fake", device="fake", log_path=fake_launcher / "server.log",
                          ready_timeout_s=60, hard_limit_s=120)
    try:
        assert (fake_launcher / "started-once").exists()  # the first launch met a taken port
        assert time.monotonic() - started < 40  # not the whole ready timeout
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_a_port_taken_every_time_fails_with_the_servers_log(fake_launcher):
    with pytest.raises(ServerFailed, match="address already in use"):
        start_server("unused-model", launcher="fake", device="fake", extra_args=("--always-taken",),
                     log_path=fake_launcher / "server.log", ready_timeout_s=60, hard_limit_s=120)


def test_stop_kills_the_whole_process_group_at_once(tmp_path, monkeypatch):
    """`LiveServer.stop()` does not wait on the server's own shutdown: the launcher and its child
    are gone long before the launcher's SIGTERM handler would have let it exit."""
    (tmp_path / "slow_launcher.py").write_text(SLOW_TO_EXIT_LAUNCHER)
    monkeypatch.setitem(live_server.LAUNCHERS, "slow", "slow_launcher")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    server = start_server("unused-model", launcher="slow", device="fake", log_path=tmp_path / "server.log",
                          ready_timeout_s=60, hard_limit_s=120)
    try:
        child = int((tmp_path / "child.pid").read_text())
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 10  # the SIGTERM handler alone takes 30 s
        assert server.process.poll() is not None
        deadline = time.monotonic() + 10  # the child, orphaned, is reaped by whoever adopts it
        while _alive(child):
            assert time.monotonic() < deadline, f"child {child} outlived stop()"
            time.sleep(0.1)
    finally:
        server.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, not yet reaped
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
