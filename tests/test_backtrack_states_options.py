"""The simulator's `--backtrack-states` reaches the served-cache model's pools, as the server's
`--marconi-backtrack-states` reaches its admission (tests/serving/test_backtrack_served.py)."""

import pytest

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.cli import build_parser, served_pools_of

POOLS = ["--workload", "synthetic:swe-agent", "--kv-tokens", "40000", "--mamba-slots", "12",
         "--mamba-radix-cache-strategy", "extra_buffer"]


@pytest.mark.parametrize("flag,count,setting", [("1", 1, 1), ("0", 0, 0), ("auto", None, 3)])  # auto: 3 in extra_buffer
def test_the_simulators_option_reaches_the_served_pools(flag, count, setting):
    pools = served_pools_of(build_parser().parse_args([*POOLS, "--backtrack-states", flag]))
    assert (pools.backtrack_states, pools.backtrack_setting) == (count, setting)
    assert served_pools_of(build_parser().parse_args(POOLS)).backtrack_states is None


def test_bad_values_and_a_missing_pool_are_named(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*POOLS, "--backtrack-states", "-1"])
    assert "--backtrack-states '-1'" in capsys.readouterr().err
    with pytest.raises(MarconiError, match="--backtrack-states"):
        served_pools_of(build_parser().parse_args(["--workload", "synthetic:swe-agent", "--backtrack-states", "2"]))
