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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadgroup` (scripts/test.sh) the live-server tests (`tests/server/test_live_*.py`)
    are one unit of work: one worker starts their servers one module after another, as a plain run
    does, while the other workers take the engine-free and in-process tests one by one. (xdist's own
    `xdist_group` marks do not reach its scheduler under pytest 9, hence a scheduler of ours.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LiveServersTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "live-servers" if nodeid.startswith(LIVE_SERVER_TESTS) else nodeid

    return LiveServersTogether(config, log)
