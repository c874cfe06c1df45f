"""Co-located mode (issue 41): a loader on the service's host reads its batches from the service's
shared memory (one copy out of the slot, then a Release) instead of the socket."""

import logging
import os
import time

import pytest
import torch

from client import RemoteLoader
from client import local as client_local
from wire import protocol as P

from tests.conftest import DEMO_SIZE, needs_own_shm
from testkit.helpers import collect, dealer, holdings
from testkit.service import ServiceProcess

KW = dict(batch_size=8, image_size=32, shuffle=True, seed=5)


def _epochs(endpoint, epochs=2, **kw):
    with RemoteLoader(endpoint, **{**KW, **kw}) as ld:
        out = []
        for e in range(epochs):
            ld.set_epoch(e)
            out.append([(b.indices, b.raw.clone(), b.labels.clone()) for b in ld])
        return out, ld.stats()


def collect_some(it, n: int) -> list:
    """The next ``n`` batches of iterator ``it`` (-1: to its end), indices and image bytes each."""
    out = []
    for batch in it:
        out.append({"indices": list(batch.indices), "images": batch.raw.numpy().tobytes()})
        if len(out) == n:
            break
    return out


def assert_epochs_exact(epochs: list, refs: list) -> None:
    """Each epoch's batches (as :func:`collect_some` keeps them) hold every sample once and equal
    the reference epoch's byte for byte, in order."""
    for mine, theirs in zip(epochs, refs, strict=True):
        assert sorted(i for x in mine for i in x["indices"]) == list(range(DEMO_SIZE))
        assert [x["images"] for x in mine] == [x["images"] for x in theirs]


def _in_place(monkeypatch):
    """Names the segment of each batch handed over in place, lent as views or copied out (the proof
    that the socket carried no pixels)."""
    from client import sinks
    seen = []
    real_copy, real_lend = sinks._copy_in_place, client_local.Borrowed.lend

    def copy(mappings, msg, outputs):
        seen.append(msg.local[0])
        return real_copy(mappings, msg, outputs)

    def lend(self, stream, batch, name, m, blocks):
        views = real_lend(self, stream, batch, name, m, blocks)
        if views is not None:
            seen.append(name)
        return views

    monkeypatch.setattr(sinks, "_copy_in_place", copy)
    monkeypatch.setattr(client_local.Borrowed, "lend", lend)
    return seen


def _lent(monkeypatch):
    """Counts the batches lent in place (views of the service's slot, no copy) and those copied out."""
    from client import sinks
    count = {"lent": 0, "copied": 0, "most_held": 0, "detached": 0}
    real_copy, real_lend, real_privatize = sinks._copy_in_place, client_local.Borrowed.lend, client_local.privatize

    def privatize(address, nbytes):
        count["detached"] += 1
        return real_privatize(address, nbytes)

    def copy(mappings, msg, outputs):
        count["copied"] += 1
        return real_copy(mappings, msg, outputs)

    def lend(self, stream, batch, name, m, blocks):
        views = real_lend(self, stream, batch, name, m, blocks)
        count["lent"] += views is not None
        count["most_held"] = max(count["most_held"], len(self))
        return views

    monkeypatch.setattr(sinks, "_copy_in_place", copy)
    monkeypatch.setattr(client_local.Borrowed, "lend", lend)
    monkeypatch.setattr(client_local, "privatize", privatize)
    return count


def _borrowed_on_service(service):
    d = service.dispatcher
    return d.call(lambda: [dict(s.borrowed) for s in d.state.sessions.streams()]
                  + [dict(s.borrowed) for s in d.state.memory.retiring]).result(10)


def _until_nothing_borrowed(service, deadline_s=30.0):
    """Wait (bounded) until the service has read the Releases sent: nothing borrowed is left."""
    import time
    end = time.monotonic() + deadline_s
    while any(_borrowed_on_service(service)) and time.monotonic() < end:
        time.sleep(0.02)  # the Releases are on their way through the socket; the deadline bounds the wait
    return _borrowed_on_service(service)


def test_epochs_through_shared_memory_are_exactly_the_socket_epochs(make_service, monkeypatch, caplog):
    service = make_service()
    over_tcp, tcp_stats = _epochs(service.endpoint)
    seen = _in_place(monkeypatch)
    local, local_stats = _epochs(service.endpoint, local=True)
    assert (tcp_stats["local_batches"], local_stats["local_batches"]) == (0, local_stats["batches"])
    for tcp_epoch, shm_epoch in zip(over_tcp, local):
        assert sorted(i for idx, *_ in shm_epoch for i in idx) == list(range(DEMO_SIZE))  # each sample once
        assert [idx for idx, *_ in shm_epoch] == [idx for idx, *_ in tcp_epoch]
        for (_, raw_a, lab_a), (_, raw_b, lab_b) in zip(tcp_epoch, shm_epoch):
            assert torch.equal(raw_a, raw_b) and torch.equal(lab_a, lab_b)
    assert len(seen) >= 2 * (DEMO_SIZE // 8)  # every batch was handed over in place (the lookahead's too)
    assert "local=True, but" not in caplog.text
    assert all(name.startswith("loader_service-") for name in seen)
    # every borrowed slot came back: the service's streams ended idle, nothing left borrowed
    streams = service.dispatcher.state.sessions.streams
    status = service.dispatcher.call(lambda: [s.borrowed for s in streams()]).result(10)
    assert all(not held for held in status)


def test_a_cpu_loader_lends_each_batch_in_place_and_hands_it_back_when_the_trainer_lets_go(make_service, monkeypatch):
    """No copy: the batch's tensor is a view of the service's slot, borrowed exactly as long as
    the trainer refers to it (a slice of it included), then handed back by a Release."""
    service = make_service()
    count = _lent(monkeypatch)
    with RemoteLoader(service.endpoint, **KW, local=True, epoch_lookahead=False) as ld:
        it = iter(ld)
        batch = next(it)
        r = ld._conns.replicas[0]
        key = (r.stream, batch.index)
        assert r.borrowed.holds(*key)
        addr = batch.raw.data_ptr()
        part = batch.raw[2:4]  # a view of the view keeps the slot too
        del batch
        assert r.borrowed.holds(*key)
        del part
        assert not r.borrowed.holds(*key)
        rest = [b.raw.clone() for b in it]
        assert len(rest) == DEMO_SIZE // 8 - 1
        assert len(r.borrowed) == 0  # the trainer let go of every batch
        r.send_releases()  # (the loader sends them as it next waits)
        # handed back by the Releases, while the connection lives (not by its end)
        assert not any(_until_nothing_borrowed(service))
        assert count["lent"] == DEMO_SIZE // 8 and count["copied"] == 0 and count["detached"] == 0
    assert addr != 0


def test_batches_kept_across_epochs_keep_their_bytes_and_may_be_written(make_service, monkeypatch):
    """A trainer that keeps every batch (no clone) and writes into them: the batches beyond what
    it may hold in place are copied out (never a stalled stream), and those held when the
    connection moves on (the next epoch's Hello, the loader's close) are detached: same tensors,
    same bytes, while the service reuses the slots."""
    service = make_service()
    over_tcp, _ = _epochs(service.endpoint, epochs=3)
    count = _lent(monkeypatch)
    kept = []
    with RemoteLoader(service.endpoint, **KW, local=True, prefetch=2) as ld:
        for e in range(3):
            ld.set_epoch(e)
            kept.append([(b.indices, b.raw, b.labels) for b in ld])
            first = kept[e][0][1]
            first.add_(1)  # the trainer's own bytes: a write in place
            first.sub_(1)
        limit = ld._conns.replicas[0].borrowed.limit
    assert limit == 3  # prefetch 2 + 2 slots asked, all but one held at most
    assert count["most_held"] <= limit and count["lent"] >= 3 and count["copied"] > 0
    assert count["detached"] >= 3  # at each move-on, the batches still held in place
    for tcp_epoch, shm_epoch in zip(over_tcp, kept):
        assert [idx for idx, *_ in shm_epoch] == [idx for idx, *_ in tcp_epoch]
        for (_, raw_a, lab_a), (_, raw_b, lab_b) in zip(tcp_epoch, shm_epoch):
            assert torch.equal(raw_a, raw_b) and torch.equal(lab_a, lab_b)
    assert not any(_until_nothing_borrowed(service))


def test_the_last_epochs_batches_go_back_while_the_next_epoch_streams_on_the_other_connection(make_service):
    """With the epoch lookahead, epoch e+1 streams on the spare connection: the batches of epoch e
    the trainer held at the switch are handed back on their own connection as soon as it lets them
    go, not when that connection is next used."""
    service = make_service()
    with RemoteLoader(service.endpoint, **KW, local=True) as ld:
        ld.set_epoch(0)
        last = [b for b in ld][-2:]  # the trainer keeps the last two batches of epoch 0 a while
        ld.set_epoch(1)
        it = iter(ld)
        next(it)
        assert any(_borrowed_on_service(service)), "epoch 0's last batches are still lent"
        del last
        next(it)  # the loader hands back what was let go of as it waits
        assert not any(held for held in _until_nothing_borrowed_but_current(service))
        list(it)


def _until_nothing_borrowed_but_current(service, deadline_s=30.0):
    """What the service's ended streams still lend, once (bounded wait) they lend nothing."""
    import time
    d = service.dispatcher
    ended = lambda: d.call(lambda: [dict(s.borrowed) for s in d.state.memory.retiring]).result(10)  # noqa: E731
    end = time.monotonic() + deadline_s
    while any(ended()) and time.monotonic() < end:
        time.sleep(0.02)  # the Releases are on their way through the socket; the deadline bounds the wait
    return ended()


def test_a_replica_whose_shared_memory_is_not_reachable_is_served_over_the_socket(make_service, monkeypatch, caplog):
    service = make_service()
    monkeypatch.setattr(client_local, "SHM_DIR", "/nonexistent-shm")  # as from another host or container
    seen = _in_place(monkeypatch)
    with caplog.at_level(logging.INFO, logger="client"):
        epochs, stats = _epochs(service.endpoint, epochs=1, local=True)
    assert sorted(i for idx, *_ in epochs[0] for i in idx) == list(range(DEMO_SIZE))
    assert seen == []
    assert "its shared memory is not reachable from here" in caplog.text
    assert stats["local_batches"] == 0 and stats["batches"] == DEMO_SIZE // 8
    said = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith("local=True, but")]
    assert len(said) == 1 and service.endpoint in said[0].getMessage(), caplog.text
    assert "docker-compose.colocated.yml" in said[0].getMessage()


def _hello(stream, **kw):
    from wire.jobspec import JobSpec
    return P.Hello(stream=stream, spec=JobSpec(batch_size=8, image_size=32, shuffle=False),
                   batches=[0, 1], slots=2, local=True, **kw)


def _recv(sock, timeout_ms=20000):
    assert sock.poll(timeout_ms), "the service answered nothing"
    frames = sock.recv_multipart()
    return P.decode_header(frames[0]), frames[1:]


def test_a_release_of_a_slot_not_handed_over_ends_that_stream_alone(service):
    hostile, good = dealer(service.endpoint), dealer(service.endpoint)
    try:
        hostile.send_multipart(P.encode(_hello(1)))
        good.send_multipart(P.encode(_hello(1)))
        for sock in (hostile, good):
            msg, _ = _recv(sock)
            assert isinstance(msg, P.Accept)
        batch, data = _recv(hostile)
        assert isinstance(batch, P.Batch) and batch.local and len(data) == 1  # the labels alone
        hostile.send_multipart(P.encode(P.Release(stream=1, batches=[batch.index + 5])))  # never handed over
        while True:
            msg, _ = _recv(hostile)
            if isinstance(msg, P.Error):
                break
        assert msg.code == P.ErrorCode.BAD_RELEASE and msg.fatal and msg.stream == 1
        assert "has not handed over" in msg.message
        # the other client's stream goes on: its batches come, and its releases are taken
        got = []
        while len(got) < 2:
            msg, data = _recv(good)
            if isinstance(msg, P.Batch):
                got.append(msg.index)
                good.send_multipart(P.encode(P.Release(stream=1, batches=[msg.index])))
        assert sorted(got) == [0, 1]
        good.send_multipart(P.encode(P.Release(stream=1, batches=[got[0]])))  # handed back twice
        while True:
            msg, _ = _recv(good)
            if isinstance(msg, P.Error):
                break
        assert msg.code == P.ErrorCode.BAD_RELEASE
        assert service.dispatcher.call(lambda: service.dispatcher.state.totals.internal_errors).result(10) == 0
    finally:
        hostile.close(0)
        good.close(0)


HOLDER = r"""
import sys, zmq
from wire import protocol as P
from wire.jobspec import JobSpec
from client.local import Mappings
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send_multipart(P.encode(P.Hello(stream=1, spec=JobSpec(batch_size=8, image_size=32, shuffle=False),
                                     batches=[0, 1], slots=2, local=True)))
maps = Mappings()
while True:
    frames = sock.recv_multipart()
    msg = P.decode_header(frames[0])
    if isinstance(msg, P.Batch):
        name, ((offset, nbytes),) = msg.local
        view = maps.block(name, offset, nbytes)  # mapped and held, never released
        print("holding", msg.index, name, flush=True)
"""


def _kill(proc) -> None:
    import signal
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()


def _after_the_client_left(service, deadline_s=30.0):
    """(sessions, retiring streams, what live streams lend) once the service saw the killed client's
    connection drop and took everything back (bounded wait)."""
    import time
    deadline = time.monotonic() + deadline_s
    while True:
        state = holdings(service)[:3]
        if state == (0, 0, []) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)  # waits for the monitor's disconnect event, bounded by the deadline


def _spawn(code: str, endpoint: str, tmp_path):
    """A Python process running ``code`` against the service (its first line of output read by the test)."""
    import os
    import subprocess
    import sys
    script = tmp_path / "peer.py"  # not client.py: the script's folder comes first in sys.path
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, str(script), endpoint], stdout=subprocess.PIPE, text=True, env=env)


def _given_back_and_served_again(service, proc) -> None:
    """The killed client's connection end gave everything back (its streams retired, their slots
    released), it left nothing in /dev/shm, and the next co-located client is served in full."""
    from loader_service import shm
    assert _after_the_client_left(service) == (0, 0, [])
    assert shm.list_segments(proc.pid) == []  # the client made no segment
    epochs, _ = _epochs(service.endpoint, epochs=1, local=True)
    assert sorted(i for idx, *_ in epochs[0] for i in idx) == list(range(DEMO_SIZE))


def test_a_client_killed_while_holding_a_slot_gives_it_back_and_leaves_nothing(service, tmp_path):
    proc = _spawn(HOLDER, service.endpoint, tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith("holding"), line
        assert any(_borrowed_on_service(service)), "the client holds a borrowed slot"
    finally:
        _kill(proc)
    _given_back_and_served_again(service, proc)


TRAINER = r"""
import sys, time
from client import RemoteLoader
with RemoteLoader(sys.argv[1], batch_size=8, image_size=32, local=True, epoch_lookahead=False) as ld:
    it = iter(ld)
    kept = [next(it) for _ in range(3)]  # lent in place, never let go of
    r = ld._conns.replicas[0]
    print("holding", len(r.borrowed), flush=True)
    time.sleep(600)  # killed long before
"""


def test_a_trainer_killed_holding_batches_lent_in_place_gives_them_back(service, tmp_path):
    """A RemoteLoader(local=True) SIGKILLed while its trainer holds batches in place (no copy, no
    Release, no Bye): the service takes every slot back, and serves the next trainer in full."""
    proc = _spawn(TRAINER, service.endpoint, tmp_path)
    try:
        word, n = proc.stdout.readline().split()
        assert word == "holding" and 3 <= int(n) <= 5  # the three kept, and what came ahead (prefetch 4 + 1)
        assert sum(len(h) for h in _borrowed_on_service(service)) >= 3
    finally:
        _kill(proc)
    _given_back_and_served_again(service, proc)


def test_every_output_of_a_pipeline_is_handed_over_and_copied_out_exactly(make_service, monkeypatch):
    """A pipeline with three outputs of different shapes: each output's block of the slot, copied
    out, equals what the socket carries."""
    svc = make_service(pipeline=("two=testkit.pipeline_doubles:two_views",))
    kw = dict(batch_size=16, seed=3, pipeline="two", pipeline_args={"size": 24, "small": 6}, epoch_lookahead=False)

    def epoch(**more):
        with RemoteLoader(svc.endpoint, **kw, **more) as ld:
            return [(b.indices, {n: b[n].clone() for n in ("big", "small", "stamp", "labels")}) for b in ld]

    over_tcp = epoch()
    seen = _in_place(monkeypatch)
    local = epoch(local=True)
    assert len(seen) == len(local) == DEMO_SIZE // 16
    assert [idx for idx, _ in local] == [idx for idx, _ in over_tcp]
    for (_, a), (_, b) in zip(over_tcp, local):
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_lent_batches_resume_at_another_world_size_beside_a_validation_loader_and_restart_on_a_new_iter(make_service):
    """The loader's life with batches lent in place: a state saved by rank 1 of 2 resumes the job at
    3 ranks exactly once; a training and a validation loader of one rank run side by side, each
    epoch whole; a new iter() part-way starts the epoch again while the trainer still holds batches
    of the pass it left (detached, their bytes kept)."""
    from testkit.helpers import indices_of, restart_while_holding, taken_across_a_resize, train_beside_validation

    svc = make_service()
    kw = dict(image_size=32, seed=4, epoch_lookahead=False, local=True, batch_size=8)
    taken = taken_across_a_resize(svc.endpoint, "lent", **kw)
    assert sorted(taken) == list(range(DEMO_SIZE))

    with RemoteLoader(svc.endpoint, job="train", shuffle=True, **kw) as train, \
            RemoteLoader(svc.endpoint, job="val", shuffle=False, train=False, **kw) as val:
        for seen, passes in train_beside_validation(train, val):
            assert sorted(seen) == list(range(DEMO_SIZE))
            assert passes and all(sorted(indices_of(p)) == list(range(DEMO_SIZE)) for p in passes)

        held, kept, again = restart_while_holding(train)  # the held batches are lent in place
        assert [b["indices"] for b in again[:2]] == [idx for idx, _ in kept]
        assert sorted(i for b in again for i in b["indices"]) == list(range(DEMO_SIZE))
        assert all(list(b.indices) == idx and torch.equal(b.raw, raw) for b, (idx, raw) in zip(held, kept))


def test_a_batch_let_go_of_is_handed_back_by_the_next_call_even_one_that_waits_for_nothing(make_service, monkeypatch):
    """The service's lent slots are its room to work in. A next() that finds its batch already
    received polls nothing; it must still send the Releases of what the trainer let go of, or a
    trainer slower than the service starves it of slots until the buffer runs dry (then waits a
    whole batch's making)."""
    from client.connections import Connections
    from client.replica import Replica

    service = make_service()
    call = [0]
    released = {}  # batch -> the next() call during which its Release was sent
    rode = set()  # the batches handed back by a Request (Request.released), not a Release of their own
    polled = set()  # the calls that polled the sockets
    real_send, real_poll = Replica.send, Connections.poll

    def send(self, msg):
        if isinstance(msg, (P.Release, P.Request)):
            back = msg.batches if isinstance(msg, P.Release) else msg.released
            released.update((b, call[0]) for b in back)
            rode.update(back if isinstance(msg, P.Request) else ())
        return real_send(self, msg)

    def poll(self, timeout_ms, waiting=False):
        polled.add(call[0])
        return real_poll(self, timeout_ms, waiting)

    monkeypatch.setattr(Replica, "send", send)
    monkeypatch.setattr(Connections, "poll", poll)
    d = service.dispatcher

    def lent_by_service() -> int:
        return d.call(lambda: sum(len(s.borrowed) for s in d.state.sessions.streams())).result(10)

    batches = DEMO_SIZE // KW["batch_size"]
    with RemoteLoader(service.endpoint, **KW, local=True, prefetch=4) as ld:
        it = iter(ld)
        b = None
        for k in range(1, batches + 1):
            # let the service send what it may (bounded), so that some calls find their batch received already
            end = time.monotonic() + 10
            while k > 1 and lent_by_service() < min(3, batches - k + 2) and time.monotonic() < end:
                time.sleep(0.005)
            call[0] = k
            b = next(it)  # call k returns batch k - 1 and, rebinding, lets go of batch k - 2
            assert b.index == k - 1
        del b
    skipped_poll = [k for k in range(2, batches + 1) if k not in polled]
    assert skipped_poll, "no call found its batch received already: the test proved nothing"
    # batch i: returned by call i + 1, let go of as call i + 2 returns, handed back during call i + 3
    late = {i: released.get(i) for i in range(batches - 2) if released.get(i) != i + 3}
    assert not late, f"batch -> the call during which its Release went (due: batch + 3): {late}"
    # one message per batch, not two: while the epoch has batches to ask for, the Request takes them along
    assert rode and rode <= set(released)


def test_a_trainer_that_waits_for_every_batch_still_hands_each_back_in_the_next_request(make_service, demo_source,
                                                                                        monkeypatch):
    """A trainer faster than the service waits in most next() calls. The batch it let go of then
    stays for the Request that follows the take, not a Release at the wait's poll, while the
    stream's slots hold every batch owed without it: one message per batch. Only once every batch
    of the epoch is asked for (no Request follows) does a Release go on its own."""
    from client.connections import Connections
    from client.replica import Replica
    from testkit.fault_source import FaultSource

    service = make_service(workers=1, sources={"demo": FaultSource(demo_source, read_delay_s=0.01)})
    batches = DEMO_SIZE // KW["batch_size"]
    alone, rode = [], []  # (batch, whether every batch was asked for by then) per Release; Request.released
    asked = set()  # in the Hello and the Requests sent so far
    waited_holding = [0]  # polls of a wait while a batch let go of was not handed back yet
    real_send, real_poll = Replica.send, Connections.poll

    def send(self, msg):
        if isinstance(msg, P.Release):
            alone.extend((b, len(asked) == batches) for b in msg.batches)
        elif isinstance(msg, (P.Hello, P.Request)):
            asked.update(msg.batches)
            rode.extend(getattr(msg, "released", ()))
        return real_send(self, msg)

    def poll(self, timeout_ms, waiting=False):
        if waiting and any(r.borrowed.back for r in self.replicas):
            waited_holding[0] += 1
        return real_poll(self, timeout_ms, waiting)

    monkeypatch.setattr(Replica, "send", send)
    monkeypatch.setattr(Connections, "poll", poll)
    with RemoteLoader(service.endpoint, **KW, local=True, prefetch=4, epoch_lookahead=False) as ld:
        seen = [b.index for b in ld]  # the loop's variable holds one batch; rebinding lets go of the one before
    assert seen == list(range(batches))
    assert waited_holding[0] >= 1, "no wait found a batch let go of: the test proved nothing"
    assert [b for b, late in alone if not late] == [], "a Release went alone while a Request was still to come"
    assert sorted(rode + [b for b, _ in alone]) == list(range(batches))  # each once (the last at the close)


def test_a_trainer_that_keeps_batches_gets_its_releases_sent_at_the_wait_so_the_service_never_stalls(
        make_service, demo_source, monkeypatch):
    """Kept batches fill the stream's slots: a wait then sends the Release of what the trainer let
    go of at once (the service needs that slot for the batch awaited), and the epoch completes
    (a Release held back for the Request after the take would wait for a batch that waits for it)."""
    from client.replica import Replica
    from testkit.fault_source import FaultSource

    service = make_service(workers=1, sources={"demo": FaultSource(demo_source, read_delay_s=0.005)})
    sent_at_wait = []
    real = Replica.send_releases

    def send_releases(self, owed=None):
        if owed is not None and self.borrowed.back:
            sent_at_wait.append(not self.borrowed.room_without_releases(self.stream, self.slots, owed))
        return real(self, owed)

    monkeypatch.setattr(Replica, "send_releases", send_releases)
    kept, seen = [], []
    with RemoteLoader(service.endpoint, **KW, local=True, prefetch=2, epoch_lookahead=False, timeout=20) as ld:
        for b in ld:
            seen.extend(b.indices)
            kept.append(b)  # the last 2 kept: with the one let go of and the window, every slot is taken
            kept = kept[-2:]
    del b, kept
    assert sorted(seen) == list(range(DEMO_SIZE))
    assert any(sent_at_wait), "no wait found the slots full: the test proved nothing"


def test_a_replica_on_another_host_beside_a_colocated_one_is_no_warning(make_service, monkeypatch, caplog):
    """``local=True`` over two replicas, one of them out of reach (as on another host): its batches
    come over the socket with an INFO line, and no WARNING, as the other is co-located; each sample once."""
    a, b = make_service(), make_service()
    real, calls = client_local.reachable, []

    def first_only(probe):  # whichever answers second is "elsewhere"
        calls.append(probe)
        return real(probe) and len(calls) == 1

    monkeypatch.setattr(client_local, "reachable", first_only)
    with caplog.at_level(logging.INFO, logger="client"):
        epochs, stats = _epochs([a.endpoint, b.endpoint], epochs=1, local=True)
    assert sorted(i for idx, *_ in epochs[0] for i in idx) == list(range(DEMO_SIZE))
    assert len(calls) == 2 and "its shared memory is not reachable from here" in caplog.text
    assert 0 < stats["local_batches"] < stats["batches"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("client")], caplog.text


def test_a_service_back_at_the_same_endpoint_out_of_reach_is_asked_again_over_the_socket(make_service, monkeypatch,
                                                                                         caplog):
    """A co-located service stops mid-epoch and another comes back at its endpoint where this
    trainer cannot reach its shared memory (another host, a container of its own). The stream the
    loader starts on it asks for batches in place; its Accept names an unreachable probe, so the
    stream is asked again over the socket before any batch of it is used, instead of failing to map
    the slots it would name. The epoch is served exactly once, byte for byte."""
    first = make_service()
    with RemoteLoader(first.endpoint, **KW) as one:
        ref = collect(one)
    port = int(first.endpoint.rsplit(":", 1)[1])
    with caplog.at_level(logging.INFO, logger="client"):
        with RemoteLoader(first.endpoint, **KW, local=True, heartbeat_s=0.3, timeout=60) as ld:
            it = iter(ld)
            got = collect_some(it, 3)
            first.stop()
            monkeypatch.setattr(client_local, "SHM_DIR", "/nonexistent-shm")  # the next one is out of reach
            make_service(data_port=port)
            got += collect_some(it, -1)
            stats = ld.stats()
    assert sorted(i for x in got for i in x["indices"]) == list(range(DEMO_SIZE))
    assert [x["images"] for x in got] == [x["images"] for x in ref]
    assert 3 <= stats["local_batches"] < stats["batches"] == DEMO_SIZE // 8
    assert "its shared memory is not reachable from here" in caplog.text



@needs_own_shm
def test_a_service_back_in_a_shm_of_its_own_is_served_over_the_socket_exactly_once(caplog):
    """The case above for real: the service that comes back at the endpoint runs in a /dev/shm of its
    own (a private mount namespace, as a container without the shared IPC namespace), so the slots
    it would name cannot be mapped from here. Two epochs, exactly once and byte for byte, the first
    batches in place, the rest over the socket; nothing of it left in this /dev/shm."""
    args = ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1"]
    first = ServiceProcess(args=args, drain=True)
    second = None
    try:
        with RemoteLoader(first.endpoint, **KW) as one:
            ref = [collect(one) for _ in range(2)]
        with caplog.at_level(logging.INFO, logger="client"):
            with RemoteLoader(first.endpoint, **KW, local=True, heartbeat_s=0.3, timeout=60) as ld:
                it = iter(ld)
                got = collect_some(it, 3)
                first.stop()
                second = ServiceProcess(data_port=first.data_port, args=args, drain=True, own_shm_mb=256)
                got += collect_some(it, -1)
                ld.set_epoch(1)
                again = collect_some(iter(ld), -1)
                stats = ld.stats()
    finally:
        for svc in (first, second):
            if svc is not None:
                svc.stop()
    assert_epochs_exact([got, again], ref)
    assert 3 <= stats["local_batches"] < DEMO_SIZE // 8 and stats["batches"] == 2 * DEMO_SIZE // 8
    assert "its shared memory is not reachable from here" in caplog.text
    assert not [n for n in os.listdir(client_local.SHM_DIR) if n.startswith(f"{client_local.PREFIX}{second.proc.pid}-")]


@needs_own_shm
@pytest.mark.parametrize("lanes_after", [True, False])
def test_a_service_back_in_reach_after_one_out_of_reach_lets_the_old_bulk_lanes_go(lanes_after):
    """``local=True, lanes=2``: the first service runs in a /dev/shm of its own, so its batches come
    on bulk lanes; it stops between epochs (its lanes idle) and the service that comes back at the
    endpoint shares this host's, with or without a lane port of its own. Its batches come in
    place, the old process's lanes are let go (none left open or kept failed), and both epochs are
    exactly once, byte for byte."""
    args = ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1", "--lane-port", "0"]
    first = ServiceProcess(args=args, drain=True, own_shm_mb=256)
    second = None
    try:
        with RemoteLoader(first.endpoint, **KW) as one:
            ref = [collect(one) for _ in range(2)]
        with RemoteLoader(first.endpoint, **KW, local=True, lanes=2, heartbeat_s=0.3, timeout=60) as ld:
            got = collect_some(iter(ld), -1)
            r = ld._conns.replicas[0]
            assert r.lanes is not None and ld.stats()["local_batches"] == 0  # out of reach: on lanes
            first.stop()
            second = ServiceProcess(data_port=first.data_port, args=args if lanes_after else args[:-2], drain=True)
            ld.set_epoch(1)
            again = collect_some(iter(ld), -1)
            lanes, stats = r.lanes, ld.stats()
    finally:
        for svc in (first, second):
            if svc is not None:
                svc.stop()
    assert_epochs_exact([got, again], ref)
    assert lanes is None
    assert stats["local_batches"] == DEMO_SIZE // 8  # epoch 1, all in place


def test_a_batch_whose_segment_its_stopped_service_unlinked_before_it_was_read_is_asked_again(make_service,
                                                                                               monkeypatch, caplog):
    """A service stops (gracefully, so it unlinks its segments) after sending batches in place that
    this loader has not read yet, and another comes back at its endpoint. The first of them names a
    segment that no longer exists: that batch is still owed, and asked for again of the new service,
    not a fatal ``cannot map`` (a soak of a co-located fleet found it: a new service on the host
    also sweeps a killed one's segments). The epoch is served exactly once, byte for byte."""
    first = make_service()
    with RemoteLoader(first.endpoint, **KW) as one:
        ref = collect(one)
    port = int(first.endpoint.rsplit(":", 1)[1])
    real_map, back = client_local._map, []

    def map_once_its_service_is_gone(name, writable):
        if not back and "-slots-" in name:  # the first batch's segment, read after its service went
            first.stop()
            back.append(make_service(data_port=port))
        return real_map(name, writable)

    monkeypatch.setattr(client_local, "_map", map_once_its_service_is_gone)
    with caplog.at_level(logging.INFO, logger="client"):
        with RemoteLoader(first.endpoint, **KW, local=True, heartbeat_s=0.3, timeout=60) as ld:
            got = collect_some(iter(ld), -1)
            stats = ld.stats()
    assert back, "no batch was handed over in place"
    assert sorted(i for x in got for i in x["indices"]) == list(range(DEMO_SIZE))
    assert [x["images"] for x in got] == [x["images"] for x in ref]
    assert stats["local_batches"] == stats["batches"] == DEMO_SIZE // 8
    assert "named by a batch handed over in place no longer exists" in caplog.text
