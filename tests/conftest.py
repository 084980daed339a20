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
