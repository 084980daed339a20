"""Fixtures for tests against a live SGLang server on this CPU: tiny models written once per
session, and servers started per (model, launcher) and stopped by PID when their tests are done.

Skipped where SGLang's serving stack is not installed (`scripts/test.sh` installs it)."""

from __future__ import annotations

import pytest


def _serving_stack_or_skip():
    pytest.importorskip("sglang")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(kind) -> directory of a tiny random model of that kind (written once)."""
    _serving_stack_or_skip()
    from tiny_models import DIR_NAMES, write_tiny_model

    root = tmp_path_factory.mktemp("models")
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = write_tiny_model(kind, root / DIR_NAMES[kind])
        return made[kind]

    return get


@pytest.fixture(scope="session")
def launch(tmp_path_factory):
    """launch(model_dir, launcher="marconi", extra_args=()) -> a started LiveServer; every server
    still running is stopped (its process group killed by PID) at the end of the session."""
    _serving_stack_or_skip()
    from live_server import start_server

    logs = tmp_path_factory.mktemp("server-logs")
    started = []

    def start(model_dir, launcher="marconi", extra_args=()):
        server = start_server(model_dir, launcher=launcher, extra_args=tuple(extra_args),
                              log_path=logs / f"{len(started)}-{launcher}-{model_dir.name}.log")
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
