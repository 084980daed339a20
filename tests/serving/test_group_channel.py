"""The leader's directives ride SGLang's request broadcast (`serving/group_channel.py`): the hooks
sit on SGLang's real scheduler methods, the leader's pending directives join `local_reqs`, every
rank takes them out of the list it processes (in order, once) and keeps the caller's list whole
(a PP stage relays it onward)."""

import pkgutil
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from sglang_marconi.policy.errors import MarconiError  # noqa: E402
from sglang_marconi.serving.group_channel import (  # noqa: E402
    POLL_TARGET, PROCESS_TARGET, after_poll_timeout_aborts, before_process_input_requests,
)
from sglang_marconi.serving.lockstep import Directive, GroupChannel  # noqa: E402


def test_the_hooked_methods_exist_on_sglangs_scheduler():
    for target in (POLL_TARGET, PROCESS_TARGET):
        owner, attr = target.rsplit(".", 1)
        assert callable(getattr(pkgutil.resolve_name(owner), attr))


def scheduler_with(channel):
    runtime = SimpleNamespace(channel=channel)
    return SimpleNamespace(tree_cache=SimpleNamespace(marconi_runtime=runtime))


def test_directives_travel_with_the_requests_and_apply_once_in_order():
    applied = {"leader": [], "follower": []}
    leader = GroupChannel(applied["leader"].append)
    follower = GroupChannel(applied["follower"].append)
    leader.send(Directive(0, choice=2))
    leader.send(Directive(1, stop_tuning="why"))
    # The leader's local_reqs (timeout aborts) gain its directives; an iteration without any is untouched.
    local = after_poll_timeout_aborts(["abort"], scheduler_with(leader))
    assert local == ["abort", Directive(0, choice=2), Directive(1, stop_tuning="why")]
    assert after_poll_timeout_aborts([], scheduler_with(leader)) == []
    recv_reqs = ["req-a", *local[1:], "req-b"]  # what the broadcast hands every rank
    for name, channel in (("leader", leader), ("follower", follower)):
        args, kwargs = before_process_input_requests(scheduler_with(channel), recv_reqs)
        assert args[1] == ["req-a", "req-b"]  # SGLang's dispatcher sees only its own requests
    assert recv_reqs == ["req-a", Directive(0, choice=2), Directive(1, stop_tuning="why"), "req-b"]  # relayed whole
    assert applied["leader"] == applied["follower"] == [Directive(0, choice=2), Directive(1, stop_tuning="why")]
    before_process_input_requests(scheduler_with(follower), recv_reqs)  # the same list again: nothing twice
    assert len(applied["follower"]) == 2
    assert before_process_input_requests(scheduler_with(follower), ["req-c"]) is None  # nothing to take out


def test_a_lost_directive_stops_the_rank_loudly():
    follower = GroupChannel(lambda d: None)
    follower.receive(Directive(0, choice=1))
    with pytest.raises(MarconiError, match="directive 2 arrived after 0"):
        follower.receive(Directive(2, choice=1))


def test_a_scheduler_without_a_marconi_cache_passes_everything_through():
    plain = SimpleNamespace(tree_cache=SimpleNamespace())
    assert after_poll_timeout_aborts(["abort"], plain) == ["abort"]
    args, _ = before_process_input_requests(plain, ["req", Directive(0, choice=1)])
    assert args[1] == ["req"]
