"""The dispatch state driven by hand: which client a disconnect belongs to, a stream that waits for
the slots of one that is ending, and one that waits for the slots it lent (the batch-memory
policy itself is tests/unit/dispatch/test_memory.py; these check the dispatcher's wiring).

The dispatcher learns of disconnects from a socket monitor that names the connection by its fd,
and of messages from the ROUTER, each tagged with its connection's fd (SRCFD). A client that
leaves and a new one that arrives at once get the same fd number, and the new one's Hello can
be read before the monitor's report of the old one's disconnect. Here the state is driven by
hand (testkit/dispatcher.py), with monitor events fed in that exact order: the disconnect
must not drop the new client.
"""

from __future__ import annotations

import gc
import uuid

import pytest
import zmq

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig

from testkit.dispatcher import FD, close, deliver, loopless, sent_to


@pytest.fixture
def dispatcher(demo_source):
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0), demo_source)
    yield d
    close(d)


def _hello(stream: int = 1) -> P.Hello:
    return P.Hello(stream=stream, spec=JobSpec(batch_size=4, image_size=32), slots=2)


def test_disconnect_of_an_earlier_connection_on_the_same_fd_keeps_the_new_client(dispatcher):
    d = dispatcher
    old, new = uuid.uuid4().bytes, uuid.uuid4().bytes
    d.event(zmq.EVENT_ACCEPTED)
    deliver(d, old, _hello())
    assert d.sessions.get(old).stream is not None
    deliver(d, old, P.Bye())
    assert old not in d.sessions
    # the I/O thread reports the old connection gone and the new one (same fd) accepted, but the
    # new client's Hello is handled before the loop gets round to reading the monitor
    d.event(zmq.EVENT_DISCONNECTED)
    d.event(zmq.EVENT_ACCEPTED)
    deliver(d, new, _hello())
    d.read_monitor()
    assert new in d.sessions and d.sessions.get(new).stream is not None, "the new client was dropped"
    # its own disconnect still drops it
    d.event(zmq.EVENT_DISCONNECTED)
    d.read_monitor()
    assert new not in d.sessions and d.sessions.fd_owners() == {}


def test_a_vanished_client_is_dropped_when_its_fd_number_is_reused(dispatcher):
    d = dispatcher
    old, new = uuid.uuid4().bytes, uuid.uuid4().bytes
    d.event(zmq.EVENT_ACCEPTED)
    deliver(d, old, _hello())
    old_stream = d.sessions.get(old).stream
    # no Bye: the old connection just goes, and a new one takes its fd number
    d.event(zmq.EVENT_DISCONNECTED)
    d.event(zmq.EVENT_ACCEPTED)
    deliver(d, new, _hello())
    assert old not in d.sessions
    assert {c.ident for c in d.sessions} == {new} and d.sessions.fd_owners() == {FD: new}
    assert old_stream.state.done and not d.sessions.get(new).stream.state.done


@pytest.fixture
def tight_dispatcher(demo_source):
    """Room for one stream of ``_big_hello`` (2 x 3 MiB of slots), not two; one worker."""
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0, max_shm_mb=10),
                 demo_source, workers=1)
    yield d
    close(d)


def _big_hello(stream: int = 1, **kw) -> P.Hello:
    return P.Hello(stream=stream, spec=JobSpec(batch_size=64, image_size=128), slots=2, **kw)


def test_a_stream_waits_for_the_slots_of_a_stream_that_is_still_ending(tight_dispatcher):
    """A client that has just left still has a task reading its slots; a new job that fits once
    that task is done waits for it instead of being refused (the race CI once lost)."""
    d = tight_dispatcher
    first, second = uuid.uuid4().bytes, uuid.uuid4().bytes
    deliver(d, first, _big_hello(batches=[0, 1]), fd=21)
    ending = d.sessions.get(first).stream
    d.tick()
    assert [a.batch for a in d.assigned] == [0, 1]  # the worker is busy on its first batches
    deliver(d, first, P.Bye(), fd=21)
    assert d.memory.retiring == [ending]  # gone, but its slots are still read by the task

    deliver(d, second, _big_hello(batches=[0]), fd=22)
    deliver(d, second, P.Request(stream=1, batches=[1, 2], final=True), fd=22)
    assert d.sessions.get(second).stream is None
    assert second in d.memory.waiting and sent_to(d, second) == []  # no Accept yet, and no refusal

    d.finish(0)
    d.finish(0)
    assert second in d.memory.waiting and d.batches == []  # what a retired stream made is not sent
    d.tick()
    s = d.sessions.get(second).stream
    assert s is not None and second not in d.memory.waiting
    assert sent_to(d, second) == ["Accept"]
    assert d.memory.in_use() == s.segment.size  # the ending stream's memory went back first
    # the Request sent while waiting counts: its batches go to the worker at once
    assert [(a.ident, a.batch) for a in d.assigned[2:]] == [(second, 0), (second, 1)]


def test_a_stream_that_cannot_fit_even_after_the_ending_ones_is_refused_at_once(tight_dispatcher):
    d = tight_dispatcher
    first, second = uuid.uuid4().bytes, uuid.uuid4().bytes
    deliver(d, first, _big_hello(batches=[0, 1]), fd=21)
    d.tick()
    assert [a.batch for a in d.assigned] == [0, 1]
    deliver(d, first, _big_hello(stream=2), fd=21)  # its next epoch, while a task reads the old slots
    assert d.sessions.get(first).stream is None and first in d.memory.waiting  # its own old slots: it waits

    deliver(d, second, P.Hello(stream=1, spec=JobSpec(batch_size=64, image_size=128), slots=4), fd=22)  # 12 MiB > 10
    assert d.sessions.get(second).stream is None and second not in d.memory.waiting
    refusal = [m for i, m in d.sent if i == second]
    assert len(refusal) == 1 and refusal[0].code == P.ErrorCode.NO_CAPACITY and refusal[0].fatal
    assert "this job needs 12.0 MiB of batch slots" in refusal[0].message

    d.finish(0)
    d.finish(0)
    d.tick()  # the first client's old slots come back: its next epoch opens on them
    assert d.sessions.get(first).stream is not None and sent_to(d, first) == ["Accept", "Accept"]


def test_a_stream_that_lent_its_slots_waits_for_them_then_takes_them_from_one_that_went_quiet(demo_source):
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0, max_shm_mb=1,
                               reclaim_idle_s=0), demo_source, workers=1)
    try:
        a, b = uuid.uuid4().bytes, uuid.uuid4().bytes
        deliver(d, a, P.Hello(stream=1, spec=JobSpec(batch_size=4, image_size=32), slots=48), fd=100)
        deliver(d, b, P.Hello(stream=1, spec=JobSpec(batch_size=4, image_size=32), slots=48,
                              batches=[0]), fd=101)
        sa, sb = d.sessions.get(a).stream, d.sessions.get(b).stream
        assert sa.segment is None and sb.segment is not None  # a asked for nothing: it lent its slots to b

        deliver(d, a, P.Request(stream=1, batches=[0]), fd=100)  # a wants them back, b is busy
        assert d.memory.starved == [sa] and sa.segment is None
        deliver(d, a, P.Request(stream=1, probe=True), fd=100)
        assert d.sent[-1][1].no_slots and d.sent[-1][1].waiting == 1  # what a's client is told

        d.tick()
        assert [(x.ident, x.batch) for x in d.assigned] == [(b, 0)]
        d.finish(0)  # b's batch is done and sent ...
        d.tick()
        assert d.memory.starved == [sa] and sa.segment is None  # ... but libzmq still reads its slot
        d.let_go()  # now b is quiet
        d.tick()  # what the loop does after every event
        assert d.memory.starved == [] and sa.segment is not None and sb.segment is None
        assert d.memory.in_use() == sa.nbytes
        assert [(x.ident, x.batch) for x in d.assigned] == [(b, 0), (a, 0)]  # a's batch goes to the worker
    finally:
        close(d)


def test_a_hello_read_before_its_connections_accept_is_served_and_kept_when_the_accept_comes(dispatcher):
    """With several I/O threads libzmq reports an accept after handing the connection on, so its
    first message can be read first (the suite's rare 60 s "answered nothing" hangs)."""
    d = dispatcher
    ident = uuid.uuid4().bytes
    deliver(d, ident, P.Describe(dataset="", pipeline="", pipeline_args={}), fd=40, report=False)
    deliver(d, ident, _hello(), fd=40, report=False)
    assert sent_to(d, ident) == ["DatasetInfo", "Accept"] and d.totals.early_messages == 1
    assert d.sessions.is_early(40) and d.sessions.get(ident).stream is not None
    d.event(zmq.EVENT_ACCEPTED, fd=40)
    d.read_monitor()
    assert not d.sessions.is_early(40) and ident in d.sessions
    assert d.sessions.next_early_due() is None and d.totals.unreported_connections == 0
    d.event(zmq.EVENT_DISCONNECTED, fd=40)  # its own disconnect still drops it
    d.read_monitor()
    assert ident not in d.sessions and d.memory.in_use() == 0


def test_a_hello_read_after_its_connection_was_reported_gone_opens_nothing_once_its_answer_cannot_be_routed(dispatcher):
    """Issue 32: the monitor's disconnect is read before that connection's queued Hello. The real
    ROUTER (ROUTER_MANDATORY) refuses the Accept to an identity whose connection is gone: the
    session is dropped after that event, before any other, and holds nothing."""
    d = dispatcher
    gone = uuid.uuid4().bytes
    d.gone.add(gone)  # a send to it fails as ROUTER_MANDATORY's EHOSTUNREACH does
    d.event(zmq.EVENT_ACCEPTED)
    d.event(zmq.EVENT_DISCONNECTED)
    deliver(d, gone, _hello())  # the shell reports the failed send as the next event
    assert gone not in d.sessions and len(d.sessions) == 0 and d.sent == []
    assert d.totals.early_messages == 1 and d.memory.in_use() == 0


def test_a_hello_read_after_its_connection_was_reported_gone_is_dropped_when_no_accept_comes(dispatcher):
    """Issue 32: the monitor's disconnect is read before that connection's queued Hello. Here
    the Accept could be "sent" (the fake socket takes it); a real ROUTER_MANDATORY send fails
    and drops it sooner. Either way no session outlives the grace."""
    d = dispatcher
    gone = uuid.uuid4().bytes
    d.event(zmq.EVENT_ACCEPTED)
    d.event(zmq.EVENT_DISCONNECTED)
    deliver(d, gone, _hello())
    assert gone in d.sessions and d.sessions.is_early(FD) and d.totals.early_messages == 1
    d.tick()
    assert gone in d.sessions  # within the grace: its accept may still come
    d.now = d.sessions.next_early_due()
    d.tick()
    assert gone not in d.sessions and len(d.sessions) == 0 and d.sessions.connections == 0
    assert d.totals.unreported_connections == 1 and d.memory.in_use() == 0


def test_a_hello_past_the_session_cap_is_refused_naming_the_cap(demo_source):
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0, max_sessions=2),
                 demo_source)
    try:
        idents = [uuid.uuid4().bytes for _ in range(3)]
        for k, ident in enumerate(idents):
            deliver(d, ident, _hello(), fd=30 + k)
        assert [i in d.sessions for i in idents] == [True, True, False]
        (refusal,) = [m for i, m in d.sent if i == idents[2]]
        assert refusal.code == P.ErrorCode.NO_CAPACITY and refusal.fatal
        assert refusal.message.startswith("the service holds 2 sessions, its cap (--max-sessions 2)")
        # what /v1/status shows as connections: open, sessions, pending, waiting
        assert (d.sessions.connections, len(d.sessions), d.sessions.pending, len(d.memory.waiting)) == (3, 2, 1, 0)
    finally:
        close(d)


def test_after_many_sessions_come_and_go_the_dispatcher_holds_nothing_of_them(dispatcher):
    """Issue 32: a flood's sessions gone, every table and index is empty again (they left by
    disconnect, by Bye, and by disconnect of a connection that never said Hello)."""
    d = dispatcher
    idents = [uuid.uuid4().bytes for _ in range(300)]
    hello = P.Hello(stream=1, spec=JobSpec(batch_size=1, image_size=16), slots=1, client="flood")
    for k, ident in enumerate(idents):
        deliver(d, ident, hello, fd=100 + k)
    d.event(zmq.EVENT_ACCEPTED, fd=99)  # one that never says Hello
    d.read_monitor()
    assert len(d.sessions) == 300 and len(d.state.scheduler) == 300 and d.memory.in_use() > 0
    for k, ident in enumerate(idents):
        if k % 2:
            deliver(d, ident, P.Bye(), fd=100 + k)
        d.event(zmq.EVENT_DISCONNECTED, fd=100 + k)
    d.event(zmq.EVENT_DISCONNECTED, fd=99)
    d.read_monitor()
    gc.collect()
    s = d.sessions
    assert (len(s), s.connections, s.pending, s.streams(), s.fd_owners()) == (0, 0, 0, [], {})
    assert (s._jobs, s._job_of) == ({}, {})
    sch = d.state.scheduler
    assert (len(sch), sch.candidates, len(sch._line)) == (0, 0, 0)
    m = d.memory
    assert (m.in_use(), m.waiting, m.starved, m.retiring) == (0, {}, [], [])
    # 301 connections closed: as the count halved, down to 0, the tables were rebuilt at their
    # size and the heap given back (at 45, 22, 11, 5, 2, 1 and 0 open)
    assert d.trims == 7
    # the plan the flood shared went with its last stream (stale entries of the quiet queues, at
    # most 64 + 4 per quiet stream, are dropped by the compaction before the trim)
    assert len(d.state.admission._plans) == 0
    assert (len(s), s.connections, len(sch)) == (0, 0, 0)
    again = uuid.uuid4().bytes
    deliver(d, again, hello, fd=500)
    assert d.sessions.get(again).stream is not None and len(sch) == 1 and d.memory.in_use() > 0


def test_the_shell_reads_monitor_events_as_plain_values_keeping_nothing_per_fd():
    """pyzmq's own parser made a ``zmq.Event`` member per fd number a flood's connections used,
    kept forever (issue 32); the shell's parser returns plain ints."""
    import struct

    from loader_service.dispatch.loop import monitor_event

    enum_members = len(zmq.Event._value2member_map_)
    for fd in range(10_000, 10_300):
        ev = monitor_event([zmq.Frame(struct.pack("=hi", zmq.EVENT_ACCEPTED, fd)), zmq.Frame(b"tcp://127.0.0.1:1")])
        assert ev == {"event": zmq.EVENT_ACCEPTED, "value": fd, "endpoint": b"tcp://127.0.0.1:1"}
        assert type(ev["value"]) is int
    assert len(zmq.Event._value2member_map_) == enum_members


def test_a_stream_opened_by_a_retry_that_asks_for_nothing_lends_its_slots_to_what_still_waits_at_once(demo_source):
    """With no reclaim time, a stream that opens on lent slots and asks for nothing is quiet at
    once: what still waits behind it takes its slots in the same round. Before, the next waiting
    stream was tried before the new one was indexed as quiet: here it was refused for good
    (no_capacity), elsewhere it waited with no deadline left until its client probed."""
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0, max_shm_mb=1,
                               reclaim_idle_s=0), demo_source, workers=1)
    spec = JobSpec(batch_size=4, image_size=32)  # 12 KiB a slot
    try:
        a, c, b = (uuid.uuid4().bytes for _ in range(3))
        deliver(d, a, P.Hello(stream=1, spec=spec, slots=48, batches=[0]), fd=100)  # 576 KiB
        d.tick()
        d.finish(0)  # a's batch is made and sent; libzmq still reads its slot
        deliver(d, c, P.Hello(stream=1, spec=spec, slots=40), fd=101)  # 480 KiB, asks for nothing yet
        deliver(d, b, P.Hello(stream=1, spec=spec, slots=46, batches=[0]), fd=102)  # 552: not beside c
        assert list(d.memory.waiting) == [c, b]  # both fit once a's send is let go of
        d.let_go()  # a is quiet: its slots lendable at once
        d.tick()
        sa, sc, sb = (d.sessions.get(i).stream for i in (a, c, b))
        assert d.memory.waiting == {} and sa.segment is None  # c opened on a's slots ...
        assert sc.segment is None and sb.segment is not None  # ... and lent them on to b in the same round
        assert [(x.ident, x.batch) for x in d.assigned] == [(a, 0), (b, 0)]
    finally:
        close(d)
