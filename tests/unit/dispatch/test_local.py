"""The co-located mode's service half (loader_service/dispatch/local.py), driven through the real
dispatcher without a loop (testkit/dispatcher.py): a local stream's batch is handed over in place, not
sent; a Release gives its slot back; a Release of anything else ends that stream alone; a stream
that retires or whose connection drops gives back what its client still borrowed."""

from __future__ import annotations

import uuid

import pytest
import zmq

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig
from loader_service.dispatch.streams import Stream
from loader_service.dispatch import local
from testkit.dispatcher import close, deliver, loopless

SPEC = JobSpec(batch_size=4, image_size=16, shuffle=False)


@pytest.fixture
def d():
    from loader_service.sources.demo import ensure_demo

    source = ensure_demo(64, quiet=True)
    colocation = local.Colocation()  # the probe segment, as the shell makes it
    disp = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0), source,
                    workers=4, probe=colocation.name)
    disp.colocation = colocation
    yield disp
    close(disp)
    colocation.close()
    source.close()


def _open(d, local=True, fd=20):
    ident = uuid.uuid4().bytes
    deliver(d, ident, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0, 1], local=local), fd=fd)
    s = d.sessions.get(ident).stream
    assert isinstance(s, Stream)
    return ident, s


def _finish_one(d, s) -> int:
    """A worker does the stream's next task; the batch goes out (handed over, for a local stream)."""
    d.tick()  # the idle workers take what is asked (4 workers: each task is a worker's first)
    of_s = {a.task.task: a.batch for a in d.assigned if a.stream is s}
    wid = next(w for w, r in sorted(d.pool.workers.items()) if r.tasks and r.tasks[0] in of_s)
    return of_s[d.finish(wid)]


def _hand_back(d, ident, batches, by: str, stream: int = 1) -> None:
    """A Release of ``batches``, or a Request that takes them along (``Request.released``)."""
    msg = P.Release(stream=stream, batches=batches) if by == "release" else \
        P.Request(stream=stream, released=batches)
    deliver(d, ident, msg, fd=20)


BY = pytest.mark.parametrize("by", ["release", "request"])


def _batches(d, ident):
    return [(h, list(c.blocks) + [c.labels]) for (i, h), c in zip(d.batches, d.data) if i == ident]


@BY
def test_a_local_batch_is_handed_over_in_place_and_its_release_frees_the_slot(d, by):
    ident, s = _open(d)
    batch = _finish_one(d, s)
    (msg, data), = _batches(d, ident)
    assert isinstance(msg, P.Batch) and msg.index == batch and len(data) == 1  # the labels alone
    name, blocks = msg.local
    assert name == s.segment.name
    slot = s.borrowed[batch]
    assert blocks == [[slot * s.layout.slot_bytes, 4 * 16 * 16 * 3]]
    assert slot in s.state.sending  # borrowed: held as a send in flight
    _hand_back(d, ident, [batch], by)
    assert s.borrowed == {} and slot not in s.state.sending and slot in s.state.free
    assert [m for i, m in d.sent if i == ident and isinstance(m, P.Error)] == []


def test_a_request_that_takes_a_release_along_frees_the_slot_then_asks(d):
    """Request.released is a Release of those batches just before the Request: the slot is free
    for the batch the same message asks for."""
    ident, s = _open(d)
    batch = _finish_one(d, s)
    slot = s.borrowed[batch]
    deliver(d, ident, P.Request(stream=1, batches=[2], released=[batch]), fd=20)
    assert s.borrowed == {} and slot not in s.state.sending
    assert s.state.has(2) and [m for i, m in d.sent if i == ident and isinstance(m, P.Error)] == []


def test_a_stream_over_the_socket_sends_its_frames_and_hands_nothing_over(d):
    ident, s = _open(d, local=False)
    _finish_one(d, s)
    (msg, data), = _batches(d, ident)
    assert not msg.local and len(data) == 2 and s.borrowed == {}


@BY
@pytest.mark.parametrize("release", [[5], [0, 0], "twice", []])
def test_a_release_of_what_was_not_handed_over_ends_that_stream_alone(d, release, by):
    ident, s = _open(d)
    other, s2 = _open(d, fd=21)
    batch = _finish_one(d, s)
    _finish_one(d, s2)
    if release == "twice":
        _hand_back(d, ident, [batch], by)
        release = [batch]
    if release == [0, 0]:  # a repeated batch: refused by the wire's checks before the stream sees it
        import msgpack
        t, field = (P.MsgType.RELEASE, "batches") if by == "release" else (P.MsgType.REQUEST, "released")
        deliver(d, ident, [msgpack.packb({"v": P.PROTOCOL_VERSION, "t": int(t), "stream": 1,
                                          field: [batch, batch]})], fd=20)
        errors = [m for i, m in d.sent if i == ident and isinstance(m, P.Error)]
        assert errors and errors[-1].code == P.ErrorCode.BAD_JOB and "twice" in errors[-1].message
        return
    _hand_back(d, ident, release, by)
    errors = [m for i, m in d.sent if i == ident and isinstance(m, P.Error)]
    if not release:  # an empty Release hands nothing back: nothing wrong
        assert errors == [] and s.borrowed
        return
    (err,) = errors
    assert err.code == P.ErrorCode.BAD_RELEASE and err.fatal and err.stream == 1
    assert "has not handed over" in err.message
    assert d.sessions.get(ident).stream is None  # that stream ended
    assert d.sessions.get(other).stream is s2 and s2.borrowed  # the other client's goes on
    assert [m for i, m in d.sent if i == other and isinstance(m, P.Error)] == []
    assert d.totals.internal_errors == 0


def test_a_stream_that_ends_keeps_what_its_client_borrows_until_its_client_hands_it_back(d):
    """The last batches of a finished (or failed) stream may still be read by its client: their
    slots stay borrowed, the segment is not given to anyone, until the Releases come."""
    ident = uuid.uuid4().bytes
    deliver(d, ident, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0, 1], local=True), fd=20)
    s = d.sessions.get(ident).stream
    deliver(d, ident, P.Request(stream=1, final=True), fd=20)  # nothing more: it ends once both are sent
    first, second = _finish_one(d, s), _finish_one(d, s)
    assert [type(m).__name__ for i, m in d.sent if i == ident][-1] == "EndOfEpoch"
    assert d.sessions.get(ident).stream is None and s in d.memory.retiring
    d.tick()
    assert s in d.memory.retiring and sorted(s.borrowed) == [first, second]  # still borrowed: not released
    deliver(d, ident, P.Release(stream=1, batches=[first]), fd=20)
    deliver(d, ident, P.Release(stream=1, batches=[second]), fd=20)
    d.tick()
    assert s.borrowed == {} and s not in d.memory.retiring  # both back: its slots go back too
    deliver(d, ident, P.Release(stream=1, batches=[first]), fd=20)  # once more: that stream is gone, nothing to refuse
    assert [m for i, m in d.sent if i == ident and isinstance(m, P.Error)] == []


def test_a_hostile_release_on_an_ended_stream_is_refused_and_what_is_borrowed_stays_borrowed(d):
    ident = uuid.uuid4().bytes
    deliver(d, ident, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0], local=True), fd=20)
    s = d.sessions.get(ident).stream
    deliver(d, ident, P.Request(stream=1, final=True), fd=20)
    batch = _finish_one(d, s)
    deliver(d, ident, P.Release(stream=1, batches=[batch + 3]), fd=20)
    (err,) = [m for i, m in d.sent if i == ident and isinstance(m, P.Error)]
    assert err.code == P.ErrorCode.BAD_RELEASE and "has not handed over" in err.message
    assert s.borrowed == {batch: s.borrowed[batch]}  # nothing came back on a refused Release
    assert d.totals.internal_errors == 0


def test_a_new_stream_or_a_dropped_connection_gives_back_what_was_borrowed(d):
    ident, s = _open(d)
    _finish_one(d, s)
    assert s.borrowed
    deliver(d, ident, P.Hello(stream=2, spec=SPEC, slots=2, batches=[0], local=True), fd=20)
    assert s.borrowed == {} and not s.state.sending  # the old stream retired: nothing of it is read again
    s2 = d.sessions.get(ident).stream
    _finish_one(d, s2)
    assert s2.borrowed
    deliver(d, ident, P.Release(stream=1, batches=[0]), fd=20)  # late, for the old stream: ignored
    assert [m for i, m in d.sent if i == ident and isinstance(m, P.Error)] == []
    d.event(zmq.EVENT_DISCONNECTED, 20)
    d.read_monitor()
    assert s2.borrowed == {} and d.sessions.get(ident) is None
    for wid, w in d.pool.workers.items():  # the tasks still writing into the two streams' slots end
        while w.tasks:
            d.finish(wid)
    d.tick()
    assert d.memory.retiring == [] and d.memory.in_use() == 0


def test_the_dataset_description_names_the_probe_which_holds_its_own_name(d):
    ident = uuid.uuid4().bytes
    deliver(d, ident, P.Describe(), fd=22)
    (info,) = [m for i, m in d.sent if i == ident]
    assert isinstance(info, P.DatasetInfo) and info.probe == d.colocation.name
    from client.local import reachable
    assert reachable(info.probe) and not reachable("loader_service-1-probe-nothere") and not reachable("")


# ------------------------------------------------------------------ Request.released is a Release, then the Request
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

STEP = st.tuples(st.integers(0, 2),  # tasks the workers finish first
                 st.integers(0, 3),  # borrowed batches handed back (the oldest first)
                 st.sampled_from([None, None, None, 9, 1]),  # one more: never handed over (9), or perhaps twice
                 st.lists(st.integers(0, 15), max_size=3, unique=True),  # batches asked for
                 st.booleans())  # the Request is final


def _seen(d, ident, s):
    """What the client was sent and what its stream holds, without the segment's name."""
    sent = [(type(m).__name__, getattr(m, "index", None), getattr(m, "code", None)) for i, m in d.sent if i == ident]
    live = d.sessions.get(ident).stream is s
    return sent, live, sorted(s.borrowed.items()), sorted(s.state.free), list(s.state.order), s.state.final


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=1, max_size=8))
def test_a_release_riding_on_a_request_does_what_a_release_then_the_request_does(steps):
    """Two services fed the same stream: one gets each hand-back as a Release followed by the
    Request, the other the Request carrying it (``released``). Whatever is handed back (borrowed,
    never handed over, twice) and asked (repeats, past the end, after final), both send the
    client the same messages and keep the same slots, order and borrowed batches."""
    from loader_service.sources.demo import ensure_demo

    source = ensure_demo(64, quiet=True)
    colocations = [local.Colocation(), local.Colocation()]
    config = ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0)
    pair = [loopless(config, source, workers=4, probe=c.name) for c in colocations]
    try:
        opened = [_open(d) for d in pair]
        for finish, nback, extra, ask, final in steps:
            for d, (ident, s) in zip(pair, opened):
                for _ in range(finish):  # a worker finishes the stream's next task, if one is out
                    d.tick()
                    of_s = {a.task.task for a in d.assigned if a.stream is s}
                    busy = [w for w, r in sorted(d.pool.workers.items()) if r.tasks and r.tasks[0] in of_s]
                    if busy:
                        d.finish(busy[0])
            back = sorted(opened[0][1].borrowed)[:nback]
            if extra is not None and extra not in back:
                back.append(extra)
            for by, d, (ident, s) in zip(("release", "request"), pair, opened):
                if by == "release":
                    deliver(d, ident, P.Release(stream=1, batches=back), fd=20)
                    deliver(d, ident, P.Request(stream=1, batches=ask, final=final), fd=20)
                else:
                    deliver(d, ident, P.Request(stream=1, batches=ask, final=final, released=back), fd=20)
                d.tick()
            assert _seen(pair[0], *opened[0]) == _seen(pair[1], *opened[1])
            assert all(d.totals.internal_errors == 0 for d in pair)
    finally:
        for d in pair:
            close(d)
        for c in colocations:
            c.close()
        source.close()
