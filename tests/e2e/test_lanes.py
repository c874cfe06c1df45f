"""Bulk lanes (issue 41): batch bytes on plain TCP connections beside the ZeroMQ one. The same
bytes as in data frames, every sample once; a lane cut in the middle of an epoch costs nothing
(what it owed is asked for again in data frames); strangers on the lane port are closed; a
service with CURVE keys refuses to open a lane port."""

import signal
import socket
import struct
import threading

import pytest
import torch

from client import LoaderError, RemoteLoader
from loader_service.config import ServiceConfig
from testkit.helpers import wait_for
from testkit.service import ServiceProcess, free_port
from wire import protocol as P

from tests.conftest import DEMO_SIZE

KW = dict(batch_size=8, image_size=32, shuffle=True, seed=3, epoch_lookahead=False)


def _epoch(endpoint, epochs=1, cut_after=None, cut=None, **kw):
    """Every batch of ``epochs`` epochs as (epoch, indices, raw, labels, batch); ``cut_after``:
    after each of these counts of batches, ``cut(loader)`` cuts a lane; and whether each
    replica's lanes were open at the end."""
    out = []
    with RemoteLoader(endpoint, **KW, **kw) as ld:
        for e in range(epochs):
            ld.set_epoch(e)
            for k, b in enumerate(ld):
                out.append((e, b.indices, b.raw.clone(), b.labels.clone(), b))
                if cut_after is not None and len(out) in cut_after:
                    assert ld._conns.replicas[0].lanes is not None, "the lanes were not open"
                    cut(ld)
        used = [r.lanes is not None for r in ld._conns.replicas]
    return out, used


def _same(a, b):
    assert [x[:2] for x in a] == [x[:2] for x in b]
    for (_, _, raw_a, lab_a, _), (_, _, raw_b, lab_b, _) in zip(a, b):
        assert torch.equal(raw_a, raw_b) and torch.equal(lab_a, lab_b)


def test_batches_on_lanes_are_the_batches_in_data_frames(make_service):
    service = make_service(lane_port=0)
    frames, used_frames = _epoch(service.endpoint, epochs=2)
    lanes, used_lanes = _epoch(service.endpoint, epochs=2, lanes=3)
    assert used_frames == [False] and used_lanes == [True]
    _same(frames, lanes)
    for e in (0, 1):
        assert sorted(i for ep, idx, *_ in lanes if ep == e for i in idx) == list(range(DEMO_SIZE))
    kept = [b for *_, b in lanes]
    assert all(torch.equal(k.raw, x[2]) for k, x in zip(kept, lanes))  # a kept batch keeps its own bytes
    d = service.dispatcher  # the loader closed: its lanes go with its session once its Bye is read
    wait_for(lambda: d.call(lambda: len(d.lane_sets)).result(5) == 0, what="the closed loader's lanes to go")


def _cutter(service, side):
    d = service.dispatcher

    def cut(ld):
        if side == "client":
            ld._conns.replicas[0].lanes._socks[1].shutdown(socket.SHUT_RDWR)
        elif side == "client drops the set":  # the service learns of it only when a send fails
            ld._conns.replicas[0].drop_lanes("dropped by the test")
        else:  # on the dispatcher's thread, which owns the lanes
            d.call(lambda: [s._socks[1].shutdown(socket.SHUT_RDWR) for s in d.lane_sets.values()]).result(5)
    return cut


@pytest.mark.parametrize("side", ["service", "client", "client drops the set"])
def test_a_lane_cut_mid_epoch_loses_and_doubles_nothing_and_new_lanes_open(make_service, caplog, side):
    caplog.set_level("INFO", logger="client")
    service = make_service(lane_port=0)
    plain, _ = _epoch(service.endpoint, epochs=2)
    after_cut, used = _epoch(service.endpoint, epochs=2, cut_after={3}, cut=_cutter(service, side), lanes=2)
    assert used == [True]  # the stream that asked again opened new lanes
    _same(plain, after_cut)
    assert "asking again for its" in caplog.text
    if side == "client drops the set":  # batches sent on the dropped set are known lost at once
        assert "no longer has" in caplog.text
    else:
        assert "lane 1" in caplog.text and "new lanes open once it is accepted" in caplog.text
    assert "did not arrive on the lanes" not in caplog.text  # no batch waited out a deadline


def test_a_connection_whose_lanes_keep_failing_goes_on_in_data_frames(make_service, caplog):
    service = make_service(lane_port=0)
    plain, _ = _epoch(service.endpoint, epochs=3)
    after_cuts, used = _epoch(service.endpoint, epochs=3, cut_after={2, 5, 8}, cut=_cutter(service, "service"),
                              lanes=2)
    assert used == [False]
    _same(plain, after_cuts)
    assert "3 sets of bulk lanes failed" in caplog.text


def test_a_service_without_lanes_serves_a_loader_that_asks_for_them(make_service):
    service = make_service()
    plain, used = _epoch(service.endpoint, lanes=2)
    assert used == [False]
    assert sorted(i for _, idx, *_ in plain for i in idx) == list(range(DEMO_SIZE))


def _connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.settimeout(5)
    return s


def _closed_by_peer(s) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_strangers_on_the_lane_port_are_closed_and_the_service_serves_on(make_service):
    service = make_service(lane_port=0)
    port = service.dispatcher.lanes.port
    garbage = _connect(port)
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    unknown = _connect(port)
    unknown.sendall(P.lane_hello(b"\x01" * 16, 0, 1, 1))  # a routing id with no session
    bad_count = _connect(port)
    bad_count.sendall(struct.pack("<4s16sBBI", P.LANE_MAGIC, b"\x02" * 16, 3, 2, 1))  # lane 3 of 2
    try:
        for s in (garbage, unknown, bad_count):
            assert _closed_by_peer(s)
        out, _ = _epoch(service.endpoint, lanes=2)
        assert sorted(i for _, idx, *_ in out for i in idx) == list(range(DEMO_SIZE))
    finally:
        for s in (garbage, unknown, bad_count):
            s.close()


def test_a_silent_lane_is_closed_after_its_deadline(make_service, monkeypatch):
    from loader_service.dispatch import lanes as L

    monkeypatch.setattr(L.P, "LANE_HELLO_S", 0.3)
    service = make_service(lane_port=0)
    silent = _connect(service.dispatcher.lanes.port)
    silent.sendall(P.LANE_MAGIC)  # a part of a hello, then nothing
    try:
        assert _closed_by_peer(silent)
    finally:
        silent.close()


def test_lanes_and_curve_keys_exclude_each_other(tmp_path):
    with pytest.raises(ValueError, match="cannot be used with --curve-keys"):
        ServiceConfig(demo=True, lane_port=0, curve_keys=str(tmp_path))
    with pytest.raises(ValueError, match="lane_port must be -1"):
        ServiceConfig(demo=True, lane_port=-2)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_replica_stopped_or_killed_mid_epoch_with_lanes_costs_no_batch(demo_source, how):
    args = ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1", "--lane-port", "0"]
    a, b = ServiceProcess(free_port(), args), ServiceProcess(free_port(), args)
    try:
        ref, _ = _epoch(a.endpoint)
        with RemoteLoader([a.endpoint, b.endpoint], **KW, lanes=2, replica_timeout=1.0, heartbeat_s=0.3) as ld:
            got = []
            for i, batch in enumerate(ld):
                got.append((batch.indices, batch.raw.clone()))
                if i == 4:
                    assert all(r.lanes is not None for r in ld._conns.replicas)
                    b.proc.send_signal(how)  # and it never comes back
        assert [i for i, _ in got] == [x[1] for x in ref]
        assert all(torch.equal(raw, x[2]) for (_, raw), x in zip(got, ref))
    finally:
        a.stop()
        b.stop()
    if how == signal.SIGKILL:  # a SIGKILLed service cannot unlink its segments; the next start sweeps them
        from loader_service import shm

        shm.sweep_stale()


def test_lanes_outlive_a_service_restarted_more_often_than_the_bound_on_failed_sets(caplog):
    """A lane set lost with its service's process is not lanes that keep failing: a run whose
    service is stopped or killed and started again at its address more often than the bound on
    failed sets (MAX_LANES_LOST) keeps its lanes, every batch once, byte for byte."""
    from client.replica import MAX_LANES_LOST

    caplog.set_level("INFO", logger="client")
    port = free_port()
    args = ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1", "--lane-port", "0"]
    svc = ServiceProcess(port, args)
    restarts = {3: signal.SIGTERM, 10: signal.SIGKILL, 17: signal.SIGTERM, 24: signal.SIGKILL, 35: signal.SIGTERM}
    assert len(restarts) > MAX_LANES_LOST
    try:
        ref, _ = _epoch(svc.endpoint, epochs=2)
        got, services = [], set()
        with RemoteLoader(svc.endpoint, **KW, lanes=2, heartbeat_s=0.3) as ld:
            for e in range(2):
                ld.set_epoch(e)
                for b in ld:
                    got.append((b.indices, b.raw.clone()))
                    if len(got) in restarts:
                        services.add(ld._conns.replicas[0].service)
                        svc.kill(restarts[len(got)])
                        svc.stop()
                        svc = ServiceProcess(port, args)
            r = ld._conns.replicas[0]
            services.add(r.service)
            used, lost = r.lanes is not None, r.lanes_lost
    finally:
        svc.stop()
        from loader_service import shm

        shm.sweep_stale()  # the SIGKILLed processes' segments
    assert [i for i, _ in got] == [x[1] for x in ref]
    assert all(torch.equal(raw, x[2]) for (_, raw), x in zip(got, ref))
    assert len(services) == len(restarts) + 1  # each restart was seen as a new process
    assert used and lost < MAX_LANES_LOST, (used, lost)
    assert "sets of bulk lanes failed" not in caplog.text


def test_a_peer_that_keeps_sending_batches_on_lanes_never_opened_is_refused_not_looped(caplog):
    """A loader without lanes, its 'service' a ZeroMQ peer that answers every ask with a batch
    on lanes: each is asked for again on a new stream (a set let go of may still deliver a few),
    but past what a service may send unasked the loader fails naming the peer, never looping."""
    import zmq

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if not router.poll(50):
                continue
            ident, *frames = router.recv_multipart()
            msg = P.decode_header(frames[0])
            if isinstance(msg, P.Describe):
                reply = [P.encode_header(P.DatasetInfo(dataset="demo", length=64, num_classes=2))]
            elif isinstance(msg, P.Hello):
                router.send_multipart([ident, P.encode_header(P.Accept(
                    stream=msg.stream, epoch=msg.epoch, num_batches=8, num_samples=64, dataset_length=64,
                    dataset="demo"))])
                reply = None
                for b in msg.batches:
                    router.send_multipart([ident, P.encode_header(P.Batch(
                        stream=msg.stream, epoch=msg.epoch, index=b, indices=list(range(8 * b, 8 * b + 8)),
                        shape=[8, 32, 32, 3], lanes=2, lane_set=12345)), b"\0" * 64])
            else:
                reply = None
            if reply:
                router.send_multipart([ident, *reply])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with RemoteLoader(f"tcp://127.0.0.1:{port}", batch_size=8, image_size=32, timeout=30,
                          epoch_lookahead=False) as ld:
            with pytest.raises(LoaderError, match="batches in a row on bulk lanes this loader does not have"):
                next(iter(ld))
    finally:
        stop.set()
        t.join(10)
        router.close()


TRAINER = r"""
import sys
from client import RemoteLoader
with RemoteLoader(sys.argv[1], batch_size=16, image_size=96, lanes=2, epoch_lookahead=False) as ld:
    for epoch in range(1000):  # killed long before
        ld.set_epoch(epoch)
        for k, batch in enumerate(ld):
            if epoch == 0 and k == 1:
                assert all(r.lanes is not None for r in ld._conns.replicas), "the lanes were not open"
                print("reading", flush=True)
"""


def _lanes_state(service):
    """(sessions, retiring streams: slots not yet given back, clients with lanes kept)."""
    d = service.dispatcher
    return d.call(lambda: (len(d.state.sessions), len(d.state.memory.retiring), len(d.lane_sets))).result(10)


def _until_the_client_left(service, deadline_s: float = 30.0):
    import time

    end = time.monotonic() + deadline_s
    while _lanes_state(service) != (0, 0, 0) and time.monotonic() < end:
        time.sleep(0.05)  # the monitor's disconnect event and the lanes' sweep; the deadline bounds it
    return _lanes_state(service)


@pytest.mark.parametrize("stopped", [False, True], ids=["killed-reading", "stopped-then-killed"])
def test_a_client_killed_mid_epoch_with_lanes_open_gives_everything_back(make_service, tmp_path, stopped):
    """A RemoteLoader(lanes=2) SIGKILLed while its lanes carry batches, reading them, or first
    stopped (SIGSTOP: its lanes fill and the service's senders block) while another loader is
    served in full: the service takes back every slot, closes the dead client's lanes and
    serves the next loader the same bytes as data frames."""
    import os
    import subprocess
    import sys

    service = make_service(lane_port=0)
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, str(script), service.endpoint], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().startswith("reading")
        assert _lanes_state(service)[2] == 1
        if stopped:
            proc.send_signal(signal.SIGSTOP)
            other, used = _epoch(service.endpoint, lanes=2)
            assert used == [True] and sorted(i for x in other for i in x[1]) == list(range(DEMO_SIZE))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    assert _until_the_client_left(service) == (0, 0, 0)
    on_lanes, used = _epoch(service.endpoint, lanes=2)
    assert used == [True]
    _same(on_lanes, _epoch(service.endpoint)[0])


def test_lanes_resume_at_another_world_size_beside_a_validation_loader_and_restart_on_a_new_iter(make_service):
    """The loader's life on bulk lanes: a state saved by rank 1 of 2 resumes the job at 3 ranks
    exactly once (5 loaders, each with its own lanes, at once); a training and a validation loader
    of one rank run side by side, each epoch whole and each batch the bytes of data frames; a new
    iter() part-way starts the epoch again while the trainer holds batches of the pass it left
    (their bytes kept)."""
    from testkit.helpers import collect, restart_while_holding, taken_across_a_resize, train_beside_validation

    svc = make_service(lane_port=0)
    kw = dict(image_size=32, seed=4, epoch_lookahead=False, batch_size=8)
    taken = taken_across_a_resize(svc.endpoint, "lanes", lanes=2, **kw)
    assert sorted(taken) == list(range(DEMO_SIZE))

    with RemoteLoader(svc.endpoint, job="val-frames", shuffle=False, train=False, **kw) as frames:
        reference = {tuple(b["indices"]): b["images"] for b in collect(frames)}
    with RemoteLoader(svc.endpoint, job="train", shuffle=True, lanes=2, **kw) as train, \
            RemoteLoader(svc.endpoint, job="val", shuffle=False, train=False, lanes=2, **kw) as val:
        for seen, passes in train_beside_validation(train, val):
            assert sorted(seen) == list(range(DEMO_SIZE))
            assert passes and all({tuple(v["indices"]): v["images"] for v in p} == reference for p in passes)
        assert all(r.lanes is not None for ld in (train, val) for r in ld._conns.replicas)

        held, kept, again = restart_while_holding(train)  # the held batches are in the lanes' buffers
        assert [b["indices"] for b in again[:2]] == [idx for idx, _ in kept]
        assert sorted(i for b in again for i in b["indices"]) == list(range(DEMO_SIZE))
        assert all(list(b.indices) == idx and torch.equal(b.raw, raw) for b, (idx, raw) in zip(held, kept))


def test_the_service_keeps_whole_lane_sets_up_to_its_cap_and_refuses_the_next_set_whole(make_service, monkeypatch):
    """With room for 4 lanes: two loaders' sets of 2 fill it exactly, both kept and sending; a
    third loader's set finds no room, none of its lanes is kept (no half set holding a sender
    thread), and it is served in data frames, every epoch whole and the same bytes."""
    import loader_service.dispatch.loop as loop

    monkeypatch.setattr(loop, "MAX_LANES_TOTAL", 4)
    service = make_service(lane_port=0)
    d = service.dispatcher
    reference, _ = _epoch(service.endpoint)
    with RemoteLoader(service.endpoint, **KW, lanes=2) as a, RemoteLoader(service.endpoint, **KW, lanes=2) as b, \
            RemoteLoader(service.endpoint, **KW, lanes=2) as c:
        got = {}
        for name, ld in (("a", a), ("b", b), ("c", c)):
            got[name] = [(0, bt.indices, bt.raw.clone(), bt.labels.clone(), bt) for bt in ld]
        sets = d.call(lambda: sorted((s.count, s.ready) for s in d.lane_sets.values())).result(10)
        assert sets == [(2, True), (2, True)]
        assert [r.lanes is not None and not r.lanes.failed for ld in (a, b) for r in ld._conns.replicas] == [True, True]
        assert all(r.lanes is None or r.lanes.failed for r in c._conns.replicas)
    for name in "abc":
        _same(got[name], reference)


def test_a_set_still_missing_a_lane_at_its_deadline_is_closed_and_its_room_given_back(make_service, monkeypatch):
    """A client with a session opens one lane of a set of two and never the other: at the
    deadline the service closes that lane and forgets the half set (no room or thread held for
    the session's life); the loader, in data frames, finishes its epoch whole."""
    monkeypatch.setattr(P, "LANE_HELLO_S", 0.5)
    service = make_service(lane_port=0)
    d = service.dispatcher
    with RemoteLoader(service.endpoint, **KW) as ld:
        it = iter(ld)
        first = [next(it)]  # the session is open now
        half = _connect(d.lanes.port)
        try:
            half.sendall(P.lane_hello(ld._conns.replicas[0].identity, 0, 2, 7))
            assert _closed_by_peer(half)  # within the socket's 5 s timeout: the deadline is 0.5 s
        finally:
            half.close()
        assert d.call(lambda: len(d.lane_sets)).result(10) == 0
        rest = list(it)
    assert sorted(i for b in first + rest for i in b.indices) == list(range(DEMO_SIZE))
