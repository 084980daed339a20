from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


@dataclass(frozen=True)
class ToyProfile:
    """A profile with round numbers so byte counts can be checked by hand: 1 byte of KV per
    token, 10 bytes per SSM checkpoint, FLOPs(s, e) = e^2 - s^2 (additive, superlinear)."""

    name: str = "toy"
    kv_bytes_per_token: int = 1
    ssm_state_bytes: int = 10

    def prefill_flops(self, start: int, end: int) -> float:
        return float(end * end - start * start)

    def prefill_flops_array(self, start, end):
        start, end = np.asarray(start, dtype=float), np.asarray(end, dtype=float)
        return end * end - start * start


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
