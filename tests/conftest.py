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


def pytest_collection_modifyitems(config, items):
    """Live-server tests (`tests/server/test_live_*.py`) form one xdist group: under
    `--dist loadgroup` (scripts/test.sh) one worker starts their servers one module after another,
    as a plain run does, while the other workers take the engine-free and in-process tests."""
    for item in items:
        if item.path.parent.name == "server" and item.path.name.startswith("test_live_"):
            item.add_marker(pytest.mark.xdist_group("live-servers"))
