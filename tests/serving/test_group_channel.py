"""The leader's directives ride SGLang's request broadcast (`serving/group_channel.py`): the hooks
sit on SGLang's real scheduler methods, the leader's pending directives join `local_reqs`, every
rank takes them out of the list it processes (in order, once) and keeps the caller's list whole
(a PP stage relays it onward)."""

import pkgutil
import time
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
    # Until they come back through the broadcast, every poll hands them out again (a skipped
    # receive drops the poll's list).
    assert after_poll_timeout_aborts([], scheduler_with(leader)) == local[1:]
    recv_reqs = ["req-a", *local[1:], "req-b"]  # what the broadcast hands every rank
    for name, channel in (("leader", leader), ("follower", follower)):
        args, kwargs = before_process_input_requests(scheduler_with(channel), recv_reqs)
        assert args[1] == ["req-a", "req-b"]  # SGLang's dispatcher sees only its own requests
    assert recv_reqs == ["req-a", Directive(0, choice=2), Directive(1, stop_tuning="why"), "req-b"]  # relayed whole
    assert applied["leader"] == applied["follower"] == [Directive(0, choice=2), Directive(1, stop_tuning="why")]
    before_process_input_requests(scheduler_with(follower), recv_reqs)  # the same list again: nothing twice
    assert len(applied["follower"]) == 2
    assert leader.outbox == [] and after_poll_timeout_aborts([], scheduler_with(leader)) == []  # back: done
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


def test_a_directive_handed_out_too_often_or_too_many_pending_stop_the_leader_loudly():
    leader = GroupChannel(lambda d: None, bound=3)
    leader.send(Directive(0, choice=1))
    for _ in range(3):
        assert leader.drain() == [Directive(0, choice=1)]  # each list dropped (skipped receives)
    with pytest.raises(MarconiError, match=r"^Marconi directive 0 never came back .*went out on 3 polls"):
        leader.drain()
    leader.receive(Directive(0, choice=1))  # back at last: the count starts again for the next one
    assert leader.outbox == [] and leader.drain() == []
    for seq in (1, 2, 3):
        leader.send(Directive(seq, choice=0))
    with pytest.raises(MarconiError, match=r"^Marconi directive 1 never came back .*3 directives are pending"):
        leader.send(Directive(4, choice=0))
    with pytest.raises(ValueError, match="bound must be >= 1, got 0"):
        GroupChannel(lambda d: None, bound=0)


# -- SGLang's real request receiver, skipping receives -----------------------------------------------
#
# Each rank is driven as SGLang's scheduler drives it: `Scheduler.ingest_requests` (SGLang's, on a
# stand-in scheduler) polls for timeout aborts on the leader (our AFTER hook appends the pending
# directives), calls its real `SchedulerRequestReceiver.recv_requests` (its real
# `SchedulerRecvSkipper`, `--scheduler-recv-interval 4`: a receive every 4th decode step, or after
# any extend), and hands what comes back to `process_input_requests` (our BEFORE hook applies the
# directives). Only the collectives are stand-ins: the TP broadcast hands every rank a pickled copy
# of the leader's list, and the PP relay is a FIFO of the lists stage 0 returns (what it sends on).
# The ranks of one scheduling run the same iterations; here one after another, the leader first.

RECV_INTERVAL = 4


def forward_modes():
    """The last batch's forward mode of each iteration (the same on every rank): idle, a prefill,
    long decode stretches (three receives skipped of every four), more prefills, idle again."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    idle, extend, decode = None, ForwardMode.EXTEND, ForwardMode.DECODE
    return [idle] * 3 + [extend] + [decode] * 13 + [extend, decode, decode, extend] + [decode] * 11 + [idle] * 9


def directive_schedule(n_iterations):
    """{iteration: directives the leader sends before it}: every iteration of a decode stretch
    (each offset into the skipper's cycle, the skipped ones included), bursts of three, and a
    directive sent on every one of several skipped polls in a row."""
    sends = {i: 1 for i in range(4, 17)}
    sends.update({2: 3, 18: 3, 24: 1, 25: 2, 26: 1, 30: 3, 36: 1})
    return {i: k for i, k in sends.items() if i < n_iterations}


class Rank:
    """One scheduler of the group: the attributes SGLang's `ingest_requests` reads."""

    def __init__(self, name, parallel, channel, receiver, clock):
        self.name, self.parallel, self.channel, self.clock = name, parallel, channel, clock
        self.tree_cache = SimpleNamespace(marconi_runtime=SimpleNamespace(channel=channel))
        self._deferred_input_requests = []
        self.metrics_reporter = SimpleNamespace(record_scheduler_active=lambda start_ns: None)
        self.request_receiver = receiver
        self.events = []  # in the order this rank processed them: ("req", rid) / ("directive", seq)
        self.applied_at = []  # (seq, iteration) of each directive applied here
        self.polls = []  # leader: (receive skipped?, seqs handed out) of each poll

    def apply(self, directive):
        self.events.append(("directive", directive.seq))
        self.applied_at.append((directive.seq, self.clock[0]))

    def _poll_timeout_aborts(self):
        # SGLang's poll with no timeout configured emits no abort; then our AFTER hook.
        return after_poll_timeout_aborts([], self)

    def process_input_requests(self, recv_reqs):
        hooked = before_process_input_requests(self, recv_reqs)
        kept = recv_reqs if hooked is None else hooked[0][1]
        self.events += [("req", r.rid) for r in kept]

    def step(self, scheduler_cls):
        from sglang.srt.runtime_context import get_parallel

        with get_parallel().override(**self.parallel):
            return scheduler_cls.ingest_requests(self)


def run_group(topology, channel_class=GroupChannel):
    """Run the schedule on two ranks ("tp": two TP ranks of stage 0; "pp": two stages of one TP
    rank each); returns the two ranks."""
    import pickle

    import zmq
    from sglang.srt.managers import scheduler as scheduler_module
    from sglang.srt.managers.io_struct import AbortReq, sock_send
    from sglang.srt.managers.scheduler_components import request_receiver as receiver_module
    from sglang.srt.managers.scheduler_components.recv_skipper import SchedulerRecvSkipper
    from sglang.srt.managers.scheduler_components.request_receiver import SchedulerRequestReceiver
    from sglang.srt.runtime_context import get_context, get_parallel

    modes = forward_modes()
    sends = directive_schedule(len(modes))
    clock = [0]  # the iteration every rank is at
    wire, relay = [], []  # the TP broadcast's payload of this iteration; stage 0's relayed lists

    def broadcast_pyobj(data, rank, dist_group=None, src=0, force_cpu_device=True):
        if rank == src:
            wire.append(pickle.dumps(data))
            return data
        return pickle.loads(wire.pop())

    def point_to_point_pyobj(data, rank, group=None, src=0, dst=1, async_send=False):
        return pickle.loads(relay.pop(0))  # stage 1 receives: the oldest list stage 0 sent

    context = zmq.Context()
    sockets = []

    def pull_socket(address):
        pull = context.socket(zmq.PULL)
        pull.bind(address)
        sockets.append(pull)
        return pull

    tokenizer = context.socket(zmq.PUSH)
    sockets.append(tokenizer)
    with get_context().override_server_args(scheduler_recv_interval=RECV_INTERVAL), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(receiver_module, "broadcast_pyobj", broadcast_pyobj)
        patch.setattr(receiver_module, "point_to_point_pyobj", point_to_point_pyobj)
        base = dict(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, attn_dp_enabled=False, tp_size=1,
                    pp_size=1)
        if topology == "tp":
            group = lambda r: SimpleNamespace(rank=r, cpu_group=None, ranks=[0, 1])  # noqa: E731
            parallels = [{**base, "tp_size": 2, "attn_tp_size": 2, "moe_tp_size": 2, "tp_rank": r, "attn_tp_rank": r,
                          "tp_group": group(r)}
                         for r in (0, 1)]
        else:
            world = SimpleNamespace(cpu_group=None)
            parallels = [{**base, "pp_size": 2, "pp_rank": s, "world_group": world} for s in (0, 1)]
        ranks = []
        for r, parallel in enumerate(parallels):
            with get_parallel().override(**parallel):
                skipper = SchedulerRecvSkipper.maybe_create()
            assert skipper is not None  # --scheduler-recv-interval 4 makes one
            last_batch = {}
            receiver = SchedulerRequestReceiver(
                recv_from_tokenizer=pull_socket(f"inproc://tokenizer-{topology}-{r}"),
                recv_from_rpc=pull_socket(f"inproc://rpc-{topology}-{r}"), recv_skipper=skipper,
                input_blocker=None, mm_receiver=None, server_args=None,
                model_config=SimpleNamespace(is_multimodal=False), max_recv_per_poll=-1,
                stream_output=None, get_last_batch=lambda: last_batch.get("batch"))
            rank = Rank(f"{topology}{r}", parallel, None, receiver, clock)
            rank.channel = channel_class(rank.apply)
            rank.tree_cache.marconi_runtime.channel = rank.channel
            rank.last_batch = last_batch
            handle = skipper.handle
            rank.skipped = []

            def recording_handle(batch, handle=handle, rank=rank):
                received = handle(batch)
                rank.skipped.append(not received)
                return received

            skipper.handle = recording_handle
            ranks.append(rank)
        tokenizer.connect(f"inproc://tokenizer-{topology}-0")
        leader = ranks[0]
        seq = 0
        try:
            for i, mode in enumerate(modes + [None] * 4 * RECV_INTERVAL):  # then idle until all is through
                clock[0] = i
                for _ in range(sends.get(i, 0)):  # sent during the previous iteration's batch
                    leader.channel.send(Directive(seq, choice=seq % 3))
                    seq += 1
                sock_send(tokenizer, AbortReq(rid=f"req-{i}"))  # a request from the tokenizer
                time.sleep(0.001)  # let zmq deliver it before this iteration's receive
                batch = None if mode is None else SimpleNamespace(forward_mode=mode)
                for rank in ranks:
                    rank.last_batch["batch"] = batch
                outbox = [d.seq for d in leader.channel.outbox]
                relayed = leader.step(scheduler_module.Scheduler)
                leader.polls.append((leader.skipped[-1], outbox))
                if topology == "pp":
                    relay.append(pickle.dumps(relayed))
                ranks[1].step(scheduler_module.Scheduler)
            # Stage 0 relays a list every iteration, a skipped receive's too, and stage 1 skips
            # its own receives: it runs behind, in order, and catches up once stage 0 is idle.
            for _ in range(100 * RECV_INTERVAL):
                if not relay:
                    break
                clock[0] += 1
                ranks[1].last_batch["batch"] = None
                ranks[1].step(scheduler_module.Scheduler)
        finally:
            for s in sockets:
                s.close(linger=0)
            context.term()
    assert not wire and not relay  # every broadcast and relayed list was taken
    ranks[0].sent = seq
    return ranks


@pytest.mark.parametrize("topology", ["tp", "pp"])
def test_directives_survive_skipped_receives_on_sglangs_request_receiver(topology):
    leader, other = run_group(topology)
    # The schedule hits the worst case: directives handed out on skipped receives, on several in a
    # row, and sent while others were still out.
    skipped_with_directives = [outbox for skipped, outbox in leader.polls if skipped and outbox]
    assert len(skipped_with_directives) >= 10, leader.polls
    runs, run = [], 0
    for skipped, outbox in leader.polls:
        run = run + 1 if skipped and outbox else 0
        runs.append(run)
    assert max(runs) >= RECV_INTERVAL - 1  # three skipped polls in a row with directives out
    assert sum(1 for s in other.skipped if s) >= 20  # the other rank skips too
    # Every directive applied on both ranks, once, in order; at the same point of the request
    # stream; under TP at the same iteration.
    seqs = list(range(leader.sent))
    assert leader.sent >= 25
    for rank in (leader, other):
        assert [s for kind, s in rank.events if kind == "directive"] == seqs, rank.name
    assert leader.events == other.events
    assert len([e for e in leader.events if e[0] == "req"]) == len(leader.polls)  # every request too
    if topology == "tp":
        assert leader.applied_at == other.applied_at
    assert leader.channel.outbox == [] and other.channel.outbox == []


class ForgetfulChannel(GroupChannel):
    """A drain that takes the directives out as it hands them out."""

    def drain(self):
        out, self.outbox = self.outbox, []
        return out


@pytest.mark.parametrize("topology", ["tp", "pp"])
def test_the_skipped_receive_check_fails_with_a_drain_that_forgets(topology):
    with pytest.raises(MarconiError, match="arrived after"):
        run_group(topology, ForgetfulChannel)


class _VerdictTuner:
    """The leader's tuner at sync points: a fixed verdict per sync point."""

    def __init__(self, choices, verdicts):
        self.choices, self.verdicts, self.failed = choices, verdicts, None

    def mark_sync(self):
        pass

    def choice_at(self, k, wait_s=None):
        return self.verdicts.get(k)


def _leader_runtime(verdicts, retune=True):
    from sglang_marconi.serving.faults import MarconiFaults
    from sglang_marconi.serving.runtime import MarconiRuntime

    runtime = MarconiRuntime.__new__(MarconiRuntime)  # only the sync-point state, no cache
    choices = ["lru", 0.0, 20.0]
    runtime.__dict__.update(
        settings=SimpleNamespace(choice="lru"), faults=MarconiFaults(2, 0), config=SimpleNamespace(retune=retune),
        tuner=_VerdictTuner(choices, verdicts), choices=choices, _tuning=True, _sent=0, _sent_choice=None,
        _stop_sent=False, sync_wait_s=0.0, sync_wait_s_total=0.0, sync_waits_late=0, directives_applied=0,
        adoptions=[], released=0)
    runtime.channel = GroupChannel(runtime.apply)
    return runtime


def test_a_directive_on_its_way_is_not_sent_again_at_later_sync_points():
    # Sync points 1-3 pass before the broadcast hands the first directive back (skipped receives):
    # the verdict "20" is sent once; a changed verdict is sent once more; the group ends on it.
    runtime = _leader_runtime({0: 20.0, 1: 20.0, 2: 20.0, 3: 0.0, 4: 0.0})
    for k in range(1, 6):
        runtime._sync_point(k)
    assert [d.choice for d in runtime.channel.outbox] == [2, 1]
    for directive in runtime.channel.drain():
        runtime.channel.receive(directive)
    assert runtime.choice == 0.0 and runtime.channel.outbox == [] and runtime._sent == 2
    runtime._sync_point(6)  # the verdict in force: nothing to send
    assert runtime._sent == 2


def test_a_stop_is_sent_once_while_it_is_on_its_way():
    runtime = _leader_runtime({})
    runtime.tuner.failed = "the shadows died"
    for k in range(1, 4):
        runtime._sync_point(k)
    assert [d.stop_tuning for d in runtime.channel.outbox] == ["the shadows died"]


def test_retune_off_sends_the_first_decision_only():
    runtime = _leader_runtime({0: 20.0, 1: 0.0}, retune=False)
    runtime._sync_point(1)
    runtime._sync_point(2)
    assert [(d.choice, d.stop_tuning) for d in runtime.channel.outbox] == [(2, "")]
