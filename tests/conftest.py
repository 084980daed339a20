from pathlib import Path

import pytest
from toy_profile import ToyProfile

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


@pytest.fixture
def toy():
    return ToyProfile()


@pytest.fixture
def mooncake_path():
    if not MOONCAKE.exists():
        pytest.skip(f"{MOONCAKE} not present")
    return MOONCAKE


# hypothesis cannot take function-scoped fixtures; a module-level instance is equivalent here
toy_profile_instance = ToyProfile()


@pytest.fixture(scope="session")
def toy_profile():
    return toy_profile_instance


LIVE_SERVER_TESTS = "tests/server/test_live_"
# The live-server modules in two units of about equal time on a 2-core machine (measured with
# `--durations=0`): test_live_server.py's eight single-rank servers, and the rest. The modules that
# start several ranks or servers at once (parallel, cluster, aborts, KV events) are in one unit,
# so no two of them run together.
LIVE_SERVER_UNITS = {"tests/server/test_live_server.py": "live-servers-single-rank"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadgroup` (scripts/test.sh) the live-server tests (`tests/server/test_live_*.py`)
    are two units of work: a worker runs a unit's modules one after another, as a plain run does
    (a module's servers live for the module), while the engine-free and in-process tests go one by
    one to whichever worker is free. (xdist's own `xdist_group` marks do not reach its scheduler
    under pytest 9, hence a scheduler of ours.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LiveServersInTwoUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return live_server_unit(nodeid) or nodeid

    return LiveServersInTwoUnits(config, log)


def live_server_unit(nodeid: str) -> str | None:
    """The unit of work a live-server test belongs to; None for every other test."""
    if not nodeid.startswith(LIVE_SERVER_TESTS):
        return None
    return LIVE_SERVER_UNITS.get(nodeid.split("::")[0], "live-servers")
