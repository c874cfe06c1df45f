"""A peer that asks for batches and never reads them is cut, as one that sends nothing is
(loader_service/dispatch/unread.py), against a live service process.

Before: such a peer kept its connection as long as it sent a ZMTP PING now and then, and what
it asked for waited in libzmq's queue, which has no cap (a raw probe asking for whole epochs of
small batches grew the service by 1.5-4.7 MB/s for as long as it ran), and the slots of the
batches sent zero-copy stayed lent to libzmq, so other jobs could wait for memory.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from client import RemoteLoader
from wire import protocol as P
from wire.jobspec import JobSpec

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, wait_for
from testkit.hostile import PING, _frame, zmtp_dealer


def _ask_and_never_read(port: int, heartbeat: float, deadline_s: float) -> float:
    """A hand-made client with a small receive buffer: a Hello for every batch of an epoch, then
    only PINGs, every ``heartbeat / 2`` (so that it is never silent), never reading. Returns how
    long the service took to close its connection (a send fails)."""
    conn = zmtp_dealer(port, rcvbuf=4096)
    spec = JobSpec(batch_size=16, image_size=32, shuffle=False)
    t0 = time.monotonic()
    try:
        stream = 0
        while time.monotonic() - t0 < deadline_s:
            stream += 1  # a new stream now and then: each asks for the whole epoch again
            conn.sendall(_frame(P.encode(P.Hello(stream=stream, spec=spec, slots=8, batches=list(range(DEMO_SIZE // 16)),
                                                 heartbeat=heartbeat))[0]))
            for _ in range(10):
                conn.sendall(PING)
                time.sleep(heartbeat / 2)  # the rogue's pace (the scenario), not a wait for a result
    except OSError:  # the service shut the connection down: what it should do
        return time.monotonic() - t0
    finally:
        conn.close()
    raise AssertionError(f"the connection of a peer that reads nothing was still open after {deadline_s} s")


def test_a_peer_that_asks_and_never_reads_is_cut_and_a_loader_beside_it_is_served(serve_demo):
    svc = serve_demo("--heartbeat", "0.2")
    witness, errors = [], []

    def run_witness() -> None:
        try:
            for _ in range(2):
                with RemoteLoader(svc.endpoint, batch_size=16, image_size=32, epoch_lookahead=False, timeout=120,
                                  heartbeat_s=0.2) as ld:
                    witness.append(sorted(indices_of(collect(ld))))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=run_witness)
    t.start()
    took = _ask_and_never_read(svc.data_port, heartbeat=0.2, deadline_s=60)
    t.join(180)
    assert not errors and witness == [list(range(DEMO_SIZE))] * 2
    st = svc.status()
    assert (st["totals"]["unread_cut"], st["totals"]["silent_cut"]) == (1, 0), st["totals"]
    assert st["connections"]["sessions"] == 0 and st["totals"]["internal_errors"] == 0
    assert took < 60
    svc.assert_alive()
    lines = [line for line in svc.stderr_tail if "read nothing of what waits for it" in line]
    assert len(lines) == 1 and "the limit: 0.6 s, 3 of its heartbeats" in lines[0], list(svc.stderr_tail)[-10:]


def test_a_socket_its_peer_does_not_read_shows_data_waiting_and_nothing_acknowledged():
    """What the look reads (unread.Sending.read) on a real loopback connection: a reader's
    acknowledged count moves and its queue drains; a socket whose peer reads nothing keeps its
    data waiting and its count still."""
    from loader_service.dispatch.unread import Sending

    with socket.create_server(("127.0.0.1", 0)) as srv:
        peer = socket.socket()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        peer.connect(srv.getsockname())
        conn, _ = srv.accept()
        with peer, conn:
            conn.setblocking(False)
            sent = 0
            try:
                while True:
                    sent += conn.send(bytes(1 << 16))
            except BlockingIOError:
                pass
            time.sleep(0.3)  # what was in flight lands in the peer's buffer (the scenario)
            first = Sending.read(conn)
            assert first is not None and first.waiting and first.unsent > 0 and first.acked < sent
            time.sleep(0.3)  # a quiet stretch for the kernel to count in
            assert Sending.read(conn).acked == first.acked
            got = 0
            peer.settimeout(10)
            while got < sent:
                got += len(peer.recv(1 << 20))
            deadline = time.monotonic() + 10
            while (r := Sending.read(conn)).waiting and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not r.waiting and r.acked == sent


@pytest.mark.parametrize("image, size, what", [(224, DEMO_SIZE, "zero-copy"), (32, 960, "copied")])
def test_a_peer_that_says_hello_after_hello_without_reading_is_held_to_two_streams(serve_demo, image, size, what):
    """A client behind in reading: each Hello a new stream asking for the whole epoch, the next one
    said once the service has sent every batch its slots allow, none read. Its third stream waits
    (``held_back``) until it has read what came before, whether the batches wait in their slots
    (224 px: 2.4 MB, sent zero-copy) or in libzmq's queue (32 px: 49 KB, copied; only the Accept
    of its second stream, tracked, tells when they have gone). So the service holds two of its
    streams, not one more with every Hello. Then it reads everything, and its last stream comes
    whole. Before: every replaced stream kept what it had sent (docs/benchmarks.md 19: 551 MiB of
    slots at 30 s at 224 px, +44 MiB of RSS at 32 px)."""
    import zmq

    svc = serve_demo("--heartbeat", "10", "--demo-size", str(size))  # the unread limit: 30 s, past this client's pause
    spec = JobSpec(batch_size=16, image_size=image, shuffle=False)
    segment = 4 * 16 * image * image * 3  # slots=4 below
    n = size // 16
    sends = 4 if what == "zero-copy" else n  # a copied batch's slot is free again at once
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    for opt, value in ((zmq.RCVHWM, 1), (zmq.RCVBUF, 4096), (zmq.LINGER, 0), (zmq.RCVTIMEO, 60_000)):
        sock.setsockopt(opt, value)
    sock.connect(f"tcp://127.0.0.1:{svc.data_port}")
    hellos = 6
    try:
        for stream in range(1, hellos + 1):
            sock.send_multipart(P.encode(P.Hello(stream=stream, spec=spec, slots=4, batches=list(range(n)),
                                                 heartbeat=10.0)))
            if stream <= 2:  # all it can be sent, none read
                wait_for(lambda: svc.status()["totals"]["batches"] == sends * stream, what=f"stream {stream}'s sends")
        wait_for(lambda: svc.status()["totals"]["held_back"] == hellos - 2, what="the later Hellos held back")
        st = svc.status()
        assert st["totals"]["streams"] == 2 and st["totals"]["batches"] == 2 * sends, st["totals"]
        assert st["shm_bytes"] == (2 if what == "zero-copy" else 1) * segment, st["shm_bytes"] / segment
        assert [c["slots"] for c in st["clients"]] == ["waiting"], st["clients"]
        got, streams = {}, set()  # the last stream's batches; every stream seen, read to the end now
        while len(got) < n:
            msg, _ = P.decode(sock.recv_multipart(copy=False))
            assert not isinstance(msg, P.Error), msg
            if isinstance(msg, P.Accept):
                streams.add(msg.stream)
            if isinstance(msg, P.Batch) and msg.stream == hellos:
                assert msg.index not in got
                got[msg.index] = msg.indices
        assert streams == {1, 2, hellos}  # the streams in between were replaced while they waited
        assert sorted(i for batch in got.values() for i in batch) == list(range(size))
    finally:
        sock.close()
        ctx.term()
    st = svc.status()
    assert st["totals"]["internal_errors"] == 0 and st["totals"]["unread_cut"] == 0
    svc.assert_alive()
