"""Start and stop a real SGLang server on this CPU for tests and benchmarks.

`start_server(model_dir, launcher=...)` runs `python -m sglang_marconi.launch_server` (ours) or
`python -m sglang.launch_server` (upstream's launcher) with SGLang's CPU engine, bound to
127.0.0.1 on a free port, in its own process group, under a hard time limit (`timeout`), and
waits for `/health_generate`. `LiveServer.stop()` kills the process group by its PID. The CPU
stand-ins for kernels that have no CPU build (`tests/cpu_engine/`) go on the server's PYTHONPATH.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

TESTS = Path(__file__).resolve().parents[1]
CPU_ENGINE = TESTS / "cpu_engine"
LAUNCHERS = {"marconi": "sglang_marconi.launch_server", "sglang": "sglang.launch_server"}

# SGLang's CPU engine on a 2-core machine without a GPU: torch attention, no CUDA graphs, no
# overlap schedule (no_buffer Mamba cache refuses it), small pools.
CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native",
    "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
    "--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule",
    "--max-running-requests", "4", "--max-total-tokens", "8192", "--max-mamba-cache-size", "24",
    "--enable-metrics", "--log-level", "warning",
)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free port on 127.0.0.1 below the kernel's ephemeral range: a port the kernel handed out
    (bind to 0) can be handed out again to the outgoing connections and gloo / ZMQ sockets a
    starting server opens before its HTTP server binds, which then fails with EADDRINUSE."""
    low = _ephemeral_range()[0]
    start, stop = (20000, low) if low > 21000 else (20000, 65000)  # no room below: any port
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(start, stop)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in [{start}, {stop})")


_PARALLEL_FLAGS = {"--tp-size": "tp", "--tensor-parallel-size": "tp", "--dp-size": "dp",
                   "--data-parallel-size": "dp", "--pp-size": "pp", "--pipeline-parallel-size": "pp"}


def parallel_ranks(args) -> int:
    """Scheduler processes SGLang starts for these server arguments: tp x dp x pp (the last
    occurrence of a flag wins, as with argparse)."""
    sizes = {"tp": 1, "dp": 1, "pp": 1}
    args = [str(a) for a in args]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in _PARALLEL_FLAGS and (eq or i + 1 < len(args)):
            sizes[_PARALLEL_FLAGS[flag]] = int(value if eq else args[i + 1])
    return sizes["tp"] * sizes["dp"] * sizes["pp"]


def threads_bind(ranks: int, cpus=None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` ranks on these CPUs (default: this process's):
    contiguous equal shares (`0|1` for 2 ranks on 2 cores); with fewer CPUs than ranks, one CPU
    each, round-robin. SGLang's CPU engine asks for it whenever ranks outnumber NUMA nodes
    (`numa_utils.init_threads_binding`); it binds threads by it only on AMX / arm64 hosts."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < ranks:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    share = len(cpus) // ranks
    return "|".join(_cpu_list(cpus[r * share:(r + 1) * share]) for r in range(ranks))


def _cpu_list(cpus) -> str:
    """Runs of consecutive CPUs as ranges: [0, 1, 2, 5] -> '0-2,5'."""
    runs = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def cpu_engine_env(extra: dict | None = None, ranks: int = 1) -> dict:
    """The server's environment: SGLang's CPU engine with the stand-ins on PYTHONPATH. With more
    than one rank (`parallel_ranks`) each gets its share of the CPUs (OMP threads, and
    SGLANG_CPU_OMP_THREADS_BIND), unless the environment already sets them."""
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_ENGINE), env.get("PYTHONPATH", "")) if p)
    cpus = len(os.sched_getaffinity(0)) or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // max(1, ranks))))
    if ranks > 1:
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", threads_bind(ranks))
    env.update(extra or {})
    return env


class ServerFailed(RuntimeError):
    pass


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Kill the server's process group (launcher, tokenizer, scheduler, detokenizer, tuner) by
        PID with SIGKILL. Not SIGTERM: the scheduler dies of it, and SGLang's launcher then waits
        5 s for crash diagnostics, on every stop; no test reads what a graceful exit would write
        (a test of graceful exits signals the server itself)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_server(model_dir: str | Path, *, launcher: str = "marconi", extra_args: tuple[str, ...] = (),
                 log_path: str | Path, device: str = "cpu", ready_timeout_s: float = 300.0,
                 hard_limit_s: int = 3600, env: dict | None = None) -> LiveServer:
    """Launch a server and wait until it generates; raise ServerFailed with its log tail if it
    exits or is not ready in time (the process group is killed either way). `device="cpu"`:
    SGLang's CPU engine with `CPU_FLAGS` and the kernel stand-ins; otherwise SGLang's defaults
    for that device (metrics on). `extra_args` come last, so they override."""
    if Path(model_dir).exists():  # a local model: absolute, since the server runs in the log's directory
        model_dir = Path(model_dir).resolve()
    device_args = CPU_FLAGS if device == "cpu" else ("--device", device, "--enable-metrics")
    run_env = (cpu_engine_env(env, parallel_ranks(extra_args)) if device == "cpu"
               else {**os.environ, **(env or {})})
    log_path = Path(log_path)
    deadline = time.monotonic() + ready_timeout_s
    for attempt in range(PORT_ATTEMPTS):
        port = free_port()
        argv = [
            "timeout", "--kill-after=10", str(hard_limit_s), sys.executable, "-m", LAUNCHERS[launcher],
            "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *device_args, *extra_args,
        ]
        with log_path.open("w") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=run_env,
                                       start_new_session=True, cwd=str(log_path.parent))
        server = LiveServer(f"http://127.0.0.1:{port}", process, log_path, argv)
        outcome = _wait_until_ready(server, deadline)
        if outcome == "ready":
            return server
        server.stop()
        if outcome == "port taken" and attempt + 1 < PORT_ATTEMPTS:
            continue  # another process took the port between our check and the server's bind
        if outcome == "exited":
            raise ServerFailed(f"server exited with {process.returncode}:\n{server.log_tail()}")
        raise ServerFailed(f"server not ready after {ready_timeout_s:.0f} s ({outcome}):\n{server.log_tail()}")
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3
# Between readiness checks: a check costs the server next to nothing while it starts, and every
# start waits half of this on average after it is ready.
READY_POLL_S = 0.2
_PORT_TAKEN = "error while attempting to bind on address"


def _wait_until_ready(server: LiveServer, deadline: float) -> str:
    """"ready" once /health_generate answers 200; "exited"; "port taken" as soon as the log says
    the HTTP port could not be bound (the server would otherwise sit unreachable until killed);
    "timed out" at the deadline."""
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return "port taken" if _PORT_TAKEN in server.log_tail(200) else "exited"
        try:
            if requests.get(server.url + "/health_generate", timeout=30).status_code == 200:
                return "ready"
        except requests.RequestException:
            if _PORT_TAKEN in server.log_tail(200):
                return "port taken"
        time.sleep(READY_POLL_S)
    return "timed out"


def main(argv=None) -> int:
    """Serve a tiny random hybrid model on this CPU in the foreground (Ctrl-C stops it)."""
    import argparse
    import tempfile

    from tiny_models import DIR_NAMES, KINDS, write_tiny_model

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--kind", default="gated-delta", choices=KINDS)
    p.add_argument("--launcher", default="marconi", choices=tuple(LAUNCHERS))
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model-dir", help="where to write the model (default: a temporary directory)")
    args, extra = p.parse_known_args(argv)
    model = write_tiny_model(args.kind, Path(args.model_dir or tempfile.mkdtemp()) / DIR_NAMES[args.kind])
    argv = [sys.executable, "-m", LAUNCHERS[args.launcher], "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(args.port), *CPU_FLAGS, *extra]
    print(f"serving {model} on http://127.0.0.1:{args.port}: {' '.join(argv[1:])}", flush=True)
    return run_until_signalled(argv, cpu_engine_env(ranks=parallel_ranks(extra)))


def run_until_signalled(argv, env) -> int:
    """Run the server in its own process group; SIGTERM, SIGINT (Ctrl-C) or SIGHUP stop that whole
    group (launcher, tokenizer, schedulers, detokenizer, the tuner), then this process exits."""
    process = subprocess.Popen(argv, env=env, start_new_session=True)

    def stop(signum, _frame):
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(wait_s)
                os.killpg(process.pid, signal.SIGKILL)  # stragglers SGLang's own cleanup left
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                pass
            break
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    return process.wait()


if __name__ == "__main__":
    raise SystemExit(main())
