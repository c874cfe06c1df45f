"""EpochRun without sockets (the stand-ins of tests/unit/client/fakes.py): batches that come in
any order from any replica leave in plan order, pushed to the sink at most ``device_prefetch``
ahead and handed over ``echo`` times; silence is probed, then times out; a replica that stays
down loses its batches to the others; one that comes back, or whose service forgot the stream,
is asked again for what it owes; the lookahead is told once every batch is asked for."""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire import protocol as P

from client.config import LoaderConfig
from client.epoch import EpochRun
from client.errors import LoaderError, LoaderTimeout
from client.stats import LoaderStats

from tests.unit.client.fakes import Clock, FakeConnections, RecordingSink


def config(**kw) -> LoaderConfig:
    return LoaderConfig.of("tcp://127.0.0.1:9", batch_size=2, **kw)


def start(conns: FakeConnections, c: LoaderConfig, total: int, first: int = 0, epoch: int = 0, lookahead=None):
    """Streams for ``epoch`` from batch ``first`` on every replica, and the run over them."""
    flow = conns.start_epoch(epoch, first, total)
    sink = RecordingSink()
    return EpochRun(conns, flow, sink, c, LoaderStats(), epoch, lookahead, clock=conns.clock), sink


def in_any_order(total: int, rng: random.Random, moves: float = 0.0):
    """Services that accept every stream and send, at each poll, one batch asked of them:
    whichever one, from whichever replica. ``moves``: the chance that a service's Accept shows it
    on the other side of the shared memory than its stream's Hello assumed (it joined without a
    Describe, or came back on another host): that stream's batches never come."""
    def serve(conns: FakeConnections) -> None:
        for r in conns.replicas:
            if moves and r.stream >= 0 and r._answered != r.stream and rng.random() < moves:
                conns.colocated ^= {r.endpoint}
                r.asked = []  # a misplaced stream is asked again before any of its batches is used
            r.answer_hello(total)
        owing = [r for r in conns.replicas if r.asked and r.down_since is None]
        if owing:
            r = rng.choice(owing)
            r.send_batch(r.asked.pop(rng.randrange(len(r.asked))))
    return serve


@settings(max_examples=60, deadline=None)
@given(replicas=st.integers(1, 3), prefetch=st.integers(1, 4), device_prefetch=st.integers(1, 3),
       echo=st.integers(1, 3), total=st.integers(0, 30), first=st.integers(0, 5), seed=st.integers(0, 2**32 - 1),
       moves=st.sampled_from([0.0, 0.3]))
def test_batches_in_any_order_leave_in_plan_order_pushed_at_most_device_prefetch_ahead(
        replicas, prefetch, device_prefetch, echo, total, first, seed, moves):
    first = min(first, total)
    c = config(prefetch=prefetch, device_prefetch=device_prefetch, echo=echo)
    window = prefetch * replicas
    serve = in_any_order(total, random.Random(seed), moves)
    flows = []

    def serve_within_the_window(conns):
        assert not flows or flows[0].in_flight() <= window
        serve(conns)

    conns = FakeConnections(replicas, window, Clock(), serve_within_the_window)
    run, sink = start(conns, c, total, first)
    flows.append(run.flow)
    got = [b.index for b in run]
    assert got == [k for k in range(first, total) for _ in range(echo)]
    assert [k for what, k in sink.log if what == "push"] == list(range(first, total))
    handed = 0
    for what, k in sink.log:
        if what == "hand_over":
            handed = k + 1 - first  # batches taken so far
        else:
            assert k < first + handed + device_prefetch, sink.log  # never further ahead of the trainer
    assert sink.ended == 1 and run.stats.batches == total - first and run.stats.samples == 2 * (total - first)
    # each stream is ended once; a run with nothing to do ends streams that were never accepted
    assert all(r.finals() == (1 if r.accepted else 0) for r in conns.replicas)
    # a stream accepted is one whose Hello asked for the hand-over its service's place allows
    assert all(r.local == (r.endpoint in conns.colocated) for r in conns.replicas if r.accepted)


def test_each_batch_is_pushed_once_and_handed_over_once_per_echo_repeat():
    conns = FakeConnections(1, 4, Clock(), in_any_order(3, random.Random(1)))
    run, sink = start(conns, config(echo=2, device_prefetch=1, prefetch=4), 3)
    assert [b.index for b in run] == [0, 0, 1, 1, 2, 2]
    assert sink.log == [("push", 0), ("hand_over", 0), ("hand_over", 0), ("push", 1), ("hand_over", 1),
                        ("hand_over", 1), ("push", 2), ("hand_over", 2), ("hand_over", 2)]


def test_silence_is_probed_and_told_once_then_times_out(caplog):
    """Nothing after the Accept: an empty probing Request every 5 s, one warning line, and
    LoaderTimeout at the timeout. A Progress answer is no batch: the timeout still counts."""
    caplog.set_level(logging.WARNING, logger="client")
    clock = Clock()

    def answer_probes(conns):
        r = conns.replicas[0]
        r.answer_hello(4)
        if r.requests and r.requests[-1]["probe"] and not r.inbox:
            r.inbox.append((P.Progress(stream=r.stream, workers=2, busy=2, tasks=0), None))
            r.requests.append(dict(probe=False))  # answered

    conns = FakeConnections(1, 4, clock, answer_probes)
    run, sink = start(conns, config(timeout=30.0), 4, epoch=3)
    t0 = clock.now
    with pytest.raises(LoaderTimeout):
        next(run)
    probes = [r for r in conns.replicas[0].requests if r["probe"]]
    assert len(probes) == 5  # at 5, 10, 15, 20, 25 s
    assert 30 <= clock.now - t0 < 30.1
    assert conns.replicas[0].progress is not None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("waiting 0s for batch 0 of epoch 3 (asked of tcp://replica-0:5555)")
    run.close()
    assert sink.ended == 1


def test_a_replica_down_for_replica_timeout_loses_its_batches_to_the_live_one(caplog):
    caplog.set_level(logging.WARNING, logger="client")
    clock = Clock()
    rng = random.Random(3)
    serve = in_any_order(12, rng)
    down = []

    def replica_1_goes_down(conns):
        r1 = conns.replicas[1]
        if not down and r1.accepted:
            r1.down_since = clock.now  # its connection is lost after the Accept: it sends nothing
            down.append(clock.now)
        serve(conns)

    conns = FakeConnections(2, 4, clock, replica_1_goes_down)
    run, _ = start(conns, config(prefetch=2, replica_timeout=10.0, timeout=60.0), 12)
    assert [b.index for b in run] == list(range(12))
    r0, r1 = conns.replicas
    assert r1.dead and 10 <= clock.now - down[0] < 11
    owed = [b for req in r1.requests for b in req["batches"]] + r1.hellos[0][2]
    said = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert said == [f"service replica {r1.endpoint} has been unreachable for 10s; its {len(owed)} batches go to "
                    f"{r0.endpoint}"]
    assert r1.finals() == 0 and r0.finals() == 1  # a replica given up on is not asked again


def test_a_replica_back_after_a_loss_and_a_service_that_forgot_the_stream_are_asked_again():
    clock = Clock()
    state = {"step": 0}

    def serve(conns):
        r = conns.replicas[0]
        r.answer_hello(6)
        state["step"] += 1
        if state["step"] == 2:
            r.events.append(True)  # reconnected, maybe to a restarted service
        elif state["step"] == 4:
            r.inbox.append((P.Error(code=P.ErrorCode.UNKNOWN_CLIENT, message="who?", stream=r.stream), None))
        elif state["step"] > 5 and r.asked:
            r.send_batch(r.asked.pop(0))

    conns = FakeConnections(1, 4, clock, serve)
    run, _ = start(conns, config(prefetch=4), 6)
    assert [b.index for b in run] == list(range(6))
    hellos = conns.replicas[0].hellos
    assert [h[2] for h in hellos] == [[0, 1, 2, 3]] * 3  # each new stream asks for all that is owed
    assert len({h[0] for h in hellos}) == 3 and run.stats.restarts == 2


def test_an_accept_that_shows_the_service_on_the_other_side_of_the_shared_memory_asks_again():
    """A replica that joined without a Describe turns out co-located, then its service comes back on
    another host: each time, its stream is asked again for all it owes, in the right hand-over,
    before any batch of the misplaced stream is used."""
    state = {"step": 0}

    def serve(conns):
        r = conns.replicas[0]
        state["step"] += 1
        if state["step"] in (1, 4):  # its Accept says where it is now
            conns.colocated ^= {r.endpoint}
            r.answer_hello(6)
            r.send_batch(r.asked[0])  # sent on the misplaced stream: stale once the new one starts
            return
        if state["step"] == 3:
            r.events.append(True)  # reconnected: a service restarted elsewhere
        r.answer_hello(6)
        if state["step"] > 4 and r.asked:
            r.send_batch(r.asked.pop(0))

    conns = FakeConnections(1, 4, Clock(), serve)
    run, sink = start(conns, config(prefetch=4), 6)
    assert [b.index for b in run] == list(range(6))
    r = conns.replicas[0]
    # over the socket (the Hello's guess), in place (its Accept), the reconnect's, over the socket again
    assert [h[2] for h in r.hellos] == [[0, 1, 2, 3]] * 4 and run.stats.restarts == 3
    assert not r.local and r.accepted
    assert [k for what, k in sink.log if what == "push"] == list(range(6))


def test_a_batch_in_shared_memory_that_is_gone_is_asked_again_and_a_peer_that_never_stops_is_an_error():
    """A batch handed over in a segment that no longer exists (its service stopped or restarted) is
    still owed: the stream is asked again for all it owes. A peer that only ever names such
    segments is refused once more than a stream's worth came in a row."""
    from client.local import SlotsGone

    def gone_once(conns):
        r = conns.replicas[0]
        r.answer_hello(4)
        if r.asked:
            b = r.asked.pop(0)
            if len(r.hellos) == 1 and b == 1:
                r.inbox.append((P.Batch(stream=r.stream, epoch=r.epoch, index=b, indices=[2 * b, 2 * b + 1],
                                        shape=[2, 1, 1, 3], local=["loader_service-1-slots-x", [[0, 6]]]),
                                SlotsGone("loader_service-1-slots-x")))
            else:
                r.send_batch(b)

    conns = FakeConnections(1, 4, Clock(), gone_once)
    run, sink = start(conns, config(prefetch=4), 4)
    assert [b.index for b in run] == [0, 1, 2, 3]
    r = conns.replicas[0]
    assert [h[2] for h in r.hellos] == [[0, 1, 2, 3], [1, 2, 3]] and run.stats.restarts == 1

    def always_gone(conns):
        r = conns.replicas[0]
        r.answer_hello(4)
        if r.asked:
            b = r.asked.pop(0)
            r.inbox.append((P.Batch(stream=r.stream, epoch=r.epoch, index=b, indices=[2 * b, 2 * b + 1],
                                    shape=[2, 1, 1, 3], local=["loader_service-1-slots-x", [[0, 6]]]),
                            SlotsGone("loader_service-1-slots-x")))

    run, _ = start(FakeConnections(1, 4, Clock(), always_gone), config(prefetch=4), 4)
    with pytest.raises(LoaderError, match=r"handed over 25 batches in a row in shared memory that does not exist "
                                          r"\(the last: 'loader_service-1-slots-x'\): a peer that is not a loader"):
        next(run)


def test_a_batch_sent_after_all_by_a_replica_whose_batches_went_to_the_others_is_dropped():
    """Replica 1 is given up on and its batches go to replica 0; then its stream sends one of them
    after all (as when it was asked again just before its service's notice, and the service back at
    its endpoint answered that ask). That copy is late, not wrong: dropped (the sink takes its memory
    back), and the epoch is served exactly once. Before, ``unexpected batch``."""
    clock, state = Clock(), {}
    serve = in_any_order(12, random.Random(3))

    def replica_1_lost_then_late(conns):
        r1 = conns.replicas[1]
        if "owed" not in state and r1.accepted:
            r1.down_since, state["owed"] = clock.now, list(r1.asked)
        if r1.dead and "late" not in state:
            b = state["late"] = state["owed"][0]
            r1.inbox.append((P.Batch(stream=r1.stream, epoch=r1.epoch, index=b, indices=[2 * b, 2 * b + 1],
                                     shape=[2, 1, 1, 3]), ("payload", b)))
        serve(conns)

    conns = FakeConnections(2, 4, clock, replica_1_lost_then_late)
    run, sink = start(conns, config(prefetch=2, replica_timeout=10.0, timeout=60.0), 12)
    assert [b.index for b in run] == list(range(12))
    assert "late" in state and ("drop", state["late"]) in sink.log
    assert [k for what, k in sink.log if what == "push"] == list(range(12))


def test_an_accept_for_another_epoch_length_is_an_error():
    def serve(conns):
        conns.replicas[0].answer_hello(99)

    run, _ = start(FakeConnections(1, 4, Clock(), serve), config(), 4)
    with pytest.raises(LoaderError, match=r"has 99 batches in this epoch, expected 4: do all replicas serve"):
        next(run)


def test_a_batch_that_was_not_asked_for_is_an_error():
    def serve(conns):
        r = conns.replicas[0]
        r.answer_hello(8)
        r.send_batch(7)

    run, _ = start(FakeConnections(1, 2, Clock(), serve), config(prefetch=2), 8)
    with pytest.raises(LoaderError, match="unexpected batch 7 from tcp://replica-0:5555"):
        next(run)


class RecordingLookahead:
    def __init__(self):
        self.started = []

    def start(self, current, epoch, total):
        self.started.append((current, epoch, total))

    def send_releases(self, current):
        pass


def test_the_lookahead_is_told_once_every_batch_is_asked_for():
    ahead = RecordingLookahead()
    seen = []

    def serve(conns):
        r = conns.replicas[0]
        r.answer_hello(6)
        seen.append((len(ahead.started), run.flow.fully_asked))
        if r.asked:
            r.send_batch(r.asked.pop(0))

    conns = FakeConnections(1, 2, Clock(), serve)
    run, _ = start(conns, config(prefetch=2), 6, epoch=4, lookahead=ahead)
    assert [b.index for b in run] == list(range(6))
    assert ahead.started and all(s == (conns, 5, 6) for s in ahead.started)
    assert all(told == 0 for told, fully_asked in seen if not fully_asked)  # not before


def test_leaving_early_ends_the_sink_and_no_stream():
    conns = FakeConnections(2, 4, Clock(), in_any_order(20, random.Random(0)))
    run, sink = start(conns, config(prefetch=2), 20)
    assert next(run).index == 0
    run.close()
    run.close()
    assert sink.ended == 1 and all(r.finals() == 0 for r in conns.replicas)
    with pytest.raises(StopIteration):
        next(run)


def test_a_run_left_part_way_tells_each_service_its_stream_ends_once():
    """What a new iter() does to the pass it ends: each accepted stream gets one final Request
    (the service ends it once what was asked is sent, and its batch slots go back), the sink
    drops what it holds, and nothing is sent after that, however often it is told."""
    c = config(prefetch=2)
    conns = FakeConnections(2, 4, Clock(), in_any_order(10, random.Random(5)))
    run, sink = start(conns, c, 10)
    taken = [next(run).index for _ in range(3)]
    assert taken == [0, 1, 2] and all(r.finals() == 0 for r in conns.replicas)
    sent = [len(r.requests) for r in conns.replicas]
    run.end_streams()
    run.end_streams()
    run.close()
    run.end_streams()
    assert [r.finals() for r in conns.replicas] == [1, 1]
    assert [len(r.requests) for r in conns.replicas] == [n + 1 for n in sent]
    assert all(r.requests[-1]["batches"] == [] for r in conns.replicas)
    assert sink.ended == 1
