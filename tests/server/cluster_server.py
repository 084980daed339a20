"""A cluster on this CPU: N tiny SGLang servers behind SGLang's gateway, `smg` (Shepherd Model Gateway).

`start_cluster(model_dir, workers=N, policy=...)` starts the N servers at once (each in its own
process group, bound to 127.0.0.1, on one shared model so the gateway sees one model), waits until
they generate, then starts `smg launch` in front of them and waits until it counts every worker
healthy. `Cluster.stop()` stops every process group it started: SIGTERM, a short grace, then SIGKILL
(smg 1.13.0 may take longer than 10 s to exit on SIGTERM; SGLang leaves stragglers).

`main` (what `scripts/serve_cluster.sh` runs) does the same in the foreground until SIGTERM, SIGINT
(Ctrl-C) or SIGHUP, or until any process it started exits, and then stops them all. There smg
listens on a free port of its own, and --port is bound only once smg counts every worker healthy and
routes a generation (a `PortForwarder` relays --port to smg from then on): smg listens, and answers
/health, as soon as it starts, and answers `404 model_not_found` until its workers register (about
3 s later here). So a client that can connect to --port is served.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from live_server import (CPU_FLAGS, LAUNCHERS, LiveServer, ServerFailed, cpu_engine_env, free_port,
                         parallel_ranks)
from port_forward import PortForwarder

GATEWAY_GRACE_S = 3.0  # smg drains in-flight requests on SIGTERM; the cluster is stopping anyway
WORKER_GRACE_S = 10.0
# The gateway on loopback only, its metrics on a port of their own (smg's default, 29000 on every
# interface, would collide between clusters), warnings only.
GATEWAY_FLAGS = ("--prometheus-host", "127.0.0.1", "--log-level", "warn")


@dataclass
class Cluster:
    url: str  # the gateway's
    gateway: LiveServer
    workers: list[LiveServer]
    policy: str
    log_dir: Path
    processes: list[LiveServer] = field(default_factory=list)  # everything started, in start order

    @property
    def worker_urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def stop(self) -> None:
        stop_all(self.processes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def stop_all(processes: list[LiveServer]) -> None:
    """SIGTERM every process group, wait up to its grace (the gateway's is short), then SIGKILL every
    group: stragglers SGLang's own cleanup leaves, and an smg still draining."""
    def signal_group(p: LiveServer, sig) -> None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    for p in processes:
        if p.process.poll() is None:
            signal_group(p, signal.SIGTERM)
    start = time.monotonic()
    for p in processes:
        grace = GATEWAY_GRACE_S if getattr(p, "is_gateway", False) else WORKER_GRACE_S
        try:
            p.process.wait(max(0.0, start + grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in processes:
        signal_group(p, signal.SIGKILL)
    for p in processes:
        p.process.wait()


def _spawn(argv, *, env, log_path: Path | None, url: str) -> LiveServer:
    """Start argv in its own process group (its PID is the group's id), output to log_path (or to this
    process's own output when None)."""
    log = log_path.open("w") if log_path else None
    try:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                                   start_new_session=True)
    finally:
        if log:
            log.close()
    return LiveServer(url, process, log_path or Path(os.devnull), list(argv))


def spawn_worker(model_dir, port: int, *, launcher: str = "marconi", extra_args=(), log_path: Path | None,
                 threads: int | None = None, hard_limit_s: int | None = None, device: str = "cpu") -> LiveServer:
    """One server on 127.0.0.1:port (not waited for: see `wait_ready`). `device="cpu"`: SGLang's CPU
    engine with the tests' CPU flags and kernel stand-ins, `threads` OpenMP threads (servers sharing
    a machine should split its cores); otherwise SGLang's defaults for that device, metrics on.
    `extra_args` come last, so they override."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    limit = ("timeout", "--kill-after=10", str(hard_limit_s)) if hard_limit_s else ()
    model = Path(model_dir).resolve() if Path(model_dir).exists() else model_dir  # else a hub name
    device_args = CPU_FLAGS if device == "cpu" else ("--device", device, "--enable-metrics")
    argv = [*limit, sys.executable, "-m", LAUNCHERS[launcher], "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(port), *device_args, *extra_args]
    env = (cpu_engine_env({"OMP_NUM_THREADS": str(threads)} if threads else None, parallel_ranks(extra_args))
           if device == "cpu" else dict(os.environ))
    return _spawn(argv, env=env, log_path=log_path, url=f"http://127.0.0.1:{port}")


def spawn_gateway(port: int, worker_urls, *, policy: str = "cache_aware", extra_args=(),
                  log_path: Path | None, hard_limit_s: int | None = None) -> LiveServer:
    """`smg launch` on 127.0.0.1:port in front of worker_urls; extra_args come last, so they override."""
    limit = ("timeout", "--kill-after=10", str(hard_limit_s)) if hard_limit_s else ()
    argv = [*limit, sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-port", str(free_port()),
            *GATEWAY_FLAGS, *extra_args]
    gateway = _spawn(argv, env=dict(os.environ), log_path=log_path, url=f"http://127.0.0.1:{port}")
    gateway.is_gateway = True
    return gateway


def _worker_ready(server: LiveServer) -> bool:
    try:
        return requests.get(server.url + "/health_generate", timeout=30).status_code == 200
    except requests.RequestException:
        return False


def gateway_ready(gateway: LiveServer, workers: int) -> bool:
    """smg counts `workers` healthy workers (/readiness: 200 from the first one on) and routes a
    generation to one of them (/health_generate). Its /health answers 200 from its start on."""
    try:
        r = requests.get(gateway.url + "/readiness", timeout=10)
        if r.status_code != 200 or r.json().get("healthy_workers") != workers:
            return False
        return requests.get(gateway.url + "/health_generate", timeout=60).status_code == 200
    except (requests.RequestException, ValueError):
        return False


def wait_ready(servers: list[LiveServer], deadline: float, ready=_worker_ready) -> None:
    """Wait until every server answers `ready`; raise ServerFailed naming the first that exits or is
    not ready by the deadline (time.monotonic())."""
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if server.process.poll() is not None:
                raise ServerFailed(f"{server.url} exited with {server.process.returncode}:\n{server.log_tail()}")
            if ready(server):
                waiting.remove(server)
        if waiting:
            if time.monotonic() > deadline:
                raise ServerFailed(f"{waiting[0].url} not ready in time:\n{waiting[0].log_tail()}")
            time.sleep(1.0)


def start_cluster(model_dir, *, workers: int = 2, policy: str = "cache_aware", launcher: str = "marconi",
                  worker_args=(), gateway_args=(), log_dir, ready_timeout_s: float = 300.0,
                  hard_limit_s: int = 3600, also_start=()) -> Cluster:
    """Start the cluster on free ports and wait for it. `also_start`: servers already spawned (a
    reference server, say) to wait for alongside the workers; they are the caller's to stop."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    started: list[LiveServer] = []
    try:
        for i in range(workers):
            started.append(spawn_worker(model_dir, free_port(), launcher=launcher, extra_args=worker_args,
                                        log_path=log_dir / f"worker{i}-{launcher}.log", threads=threads,
                                        hard_limit_s=hard_limit_s))
        deadline = time.monotonic() + ready_timeout_s
        wait_ready([*started, *also_start], deadline)
        gateway = spawn_gateway(free_port(), [w.url for w in started], policy=policy, extra_args=gateway_args,
                                log_path=log_dir / f"gateway-{policy}.log", hard_limit_s=hard_limit_s)
        started.insert(0, gateway)  # stopped first: no new requests reach a stopping worker
        wait_ready([gateway], time.monotonic() + 60, lambda g: gateway_ready(g, workers))
    except BaseException:
        stop_all(started)
        raise
    return Cluster(gateway.url, gateway, started[1:], policy, log_dir, started)


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def parse_cluster_args(argv):
    """(options, smg flags, worker flags): arguments this script does not know go to `smg launch`,
    arguments after `--` to every worker. Exits with one line naming a bad value or a busy port."""
    from tiny_models import KINDS

    argv = list(argv)
    worker_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=30000,
                   help="the gateway's port, bound once every worker serves through it")
    p.add_argument("--host", default="127.0.0.1", help="the address --port listens on")
    p.add_argument("--worker-base-port", type=int, help="workers on this port and up (default: --port + 1)")
    p.add_argument("--policy", default="cache_aware", help="smg's routing policy")
    p.add_argument("--kind", default="gated-delta", choices=KINDS)
    p.add_argument("--launcher", default="marconi", choices=tuple(LAUNCHERS))
    p.add_argument("--model-dir", help="where to write the tiny model (default: a temporary directory)")
    p.add_argument("--model-path", help="serve this model instead of writing a tiny one")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the workers")
    args, gateway_args = p.parse_known_args(argv)
    if importlib.util.find_spec("smg") is None:
        p.error("smg (SGLang's gateway) is not installed: pip install smg==1.13.0 (requirements/sglang-cpu.txt)")
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    base = args.worker_base_port or args.port + 1
    args.ports = [args.port, *range(base, base + args.workers)]
    busy = [port for port in args.ports if not port_free(port)]
    if busy:
        p.error(f"port {busy[0]} is in use (gateway --port {args.port}, workers from {base})")
    return args, gateway_args, worker_args


def main(argv=None) -> int:
    """Serve N tiny random hybrid models on this CPU behind smg in the foreground (Ctrl-C stops all).
    Arguments not named here go to `smg launch`; arguments after `--` go to every worker."""
    from tiny_models import DIR_NAMES, write_tiny_model

    args, gateway_args, worker_args = parse_cluster_args(sys.argv[1:] if argv is None else argv)
    ports = args.ports
    started: list[LiveServer] = []
    forwarder: PortForwarder | None = None

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        model = (Path(args.model_path).resolve() if args.model_path else
                 write_tiny_model(args.kind, Path(args.model_dir or tempfile.mkdtemp()) / DIR_NAMES[args.kind]))
        # The workers split this machine's cores, unless OMP_NUM_THREADS says otherwise.
        threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // args.workers))
        for port in ports[1:]:
            started.append(spawn_worker(model, port, launcher=args.launcher, extra_args=worker_args,
                                        log_path=None, threads=threads))
        print(f"starting {args.workers} {args.launcher} worker(s) on {', '.join(w.url for w in started)}", flush=True)
        wait_ready(started, time.monotonic() + args.ready_timeout)
        # smg on a port of its own; --port opens only when smg serves every worker (see the docstring).
        internal = next(port for port in iter(free_port, None) if port not in ports)
        gateway = spawn_gateway(internal, [w.url for w in started], policy=args.policy,
                                extra_args=gateway_args, log_path=None)
        started.insert(0, gateway)
        wait_ready([gateway], time.monotonic() + 120, lambda g: gateway_ready(g, args.workers))
        try:
            forwarder = PortForwarder(args.host, args.port, internal)
        except OSError as e:
            raise ServerFailed(f"cannot listen on {args.host}:{args.port}: {e}") from None
        print(f"smg ({args.policy}) serving {model} on http://{args.host}:{args.port} "
              f"over {args.workers} worker(s) (smg itself on {gateway.url})", flush=True)
        while True:  # until a signal, or until any process exits (then the cluster is broken: stop it)
            for s in started:
                if s.process.poll() is not None:
                    print(f"{s.url} exited with {s.process.returncode}; stopping the cluster", file=sys.stderr)
                    return 1
            if not forwarder.alive:
                print(f"the relay on port {args.port} stopped; stopping the cluster", file=sys.stderr)
                return 1
            time.sleep(1.0)
    except ServerFailed as e:
        print(f"cluster failed to start: {e}", file=sys.stderr)
        return 1
    finally:
        # Signals again while stopping must not interrupt the stop.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if forwarder is not None:
            forwarder.close()  # first: no new connection reaches a stopping gateway
        stop_all(started)


if __name__ == "__main__":
    raise SystemExit(main())
