"""The data port sends no ZMTP heartbeat of its own: it cuts a connection that brings nothing for
3 of its client's heartbeats, timed by the kernel (loader_service/dispatch/silence.py), against
a live service process.

Before: libzmq 4.3.5 aborted the whole service (exit -6, ``Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)``) when a peer opened a second connection under the identity of
one still sending and then reset the first: the handover stops libzmq reading the first for good,
and the reset met the service's heartbeat timer. The first test below aborted the build before
this change at its first or second peer in 6 runs of 6.
"""

from __future__ import annotations

import time

import pytest

from client import LoaderError, RemoteLoader
from wire import protocol as P
from wire.jobspec import JobSpec

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, wait_for
from testkit.hostile import _frame, _recv_frame, handover_and_reset, zmtp_dealer
from testkit.service import ServiceProcess


def _handovers(svc: ServiceProcess, n: int) -> None:
    for k in range(n):
        try:
            handover_and_reset(svc.data_port)
        except OSError as exc:  # refused or reset in its handshake: the service is gone
            svc.assert_alive()
            raise AssertionError(f"peer {k}: {exc}") from None


def test_peers_that_take_their_own_identity_over_and_reset_leave_the_service_serving(serve_demo):
    """200 hand-made peers, each two connections under one identity: the second takes it over,
    the first sends on and resets; the service's silence look runs every 20 ms. It serves on,
    every connection libzmq will not close is found stranded, and a loader's epoch is exact."""
    svc = serve_demo("--heartbeat", "0.02", "--max-stranded-per-address", "0")
    _handovers(svc, 200)
    svc.assert_alive()
    wait_for(lambda: (lambda c: c["open"] == c["stranded"] > 0)(svc.status()["connections"]), timeout=30,
             what="every connection left open to be found stranded")
    with RemoteLoader(svc.endpoint, batch_size=16, image_size=32, epoch_lookahead=False, timeout=120) as ld:
        assert sorted(indices_of(collect(ld))) == list(range(DEMO_SIZE))
    st = svc.status()
    assert st["healthy"] and st["totals"]["internal_errors"] == 0 and st["totals"]["denied_addresses"] == 0
    assert st["totals"]["silent_cut"] >= st["connections"]["stranded"]
    svc.assert_alive()


def test_an_address_with_too_many_stranded_connections_is_refused_at_the_handshake(serve_demo):
    """On a cap of 3, the address that stranded them (loopback: the test's) is refused new
    connections: a hand-made peer gets the handshake's ERROR instead of READY, and the project's
    client a LoaderError that says its address was refused, not a hang."""
    svc = serve_demo("--heartbeat", "0.05", "--max-stranded-per-address", "3")
    _handovers(svc, 10)
    wait_for(lambda: svc.status()["totals"]["denied_addresses"] == 1, timeout=30, what="the address to be refused")
    assert svc.status()["connections"]["stranded"] >= 3
    with pytest.raises(ConnectionError, match="refused the handshake"):
        zmtp_dealer(svc.data_port)
    with pytest.raises(LoaderError, match="refused this client's address"):
        with RemoteLoader(svc.endpoint, batch_size=16, image_size=32, epoch_lookahead=False, timeout=30) as ld:
            collect(ld)
    svc.assert_alive()
    assert svc.status()["healthy"]


def test_a_client_whose_trainer_is_busy_for_many_limits_is_not_cut(serve_demo):
    """A trainer step of 3 s, ten times the connection's limit (3 x 0.1 s): its libzmq thread
    keeps sending PINGs, so the connection is never silent, and reads what was asked for; the
    epoch is exact, with no restart."""
    svc = serve_demo("--heartbeat", "0.1")
    with RemoteLoader(svc.endpoint, batch_size=16, image_size=32, epoch_lookahead=False, timeout=120,
                      heartbeat_s=0.1) as ld:
        got = []
        for i, b in enumerate(ld):
            got.extend(b.indices)
            if i == 1:
                time.sleep(3.0)  # the busy trainer (the scenario, not a wait for something)
        assert sorted(got) == list(range(DEMO_SIZE)) and ld.stats()["restarts"] == 0
    st = svc.status()
    # it reads every batch it asked for into its own buffers meanwhile: not unread either (dispatch/unread.py)
    assert (st["totals"]["silent_cut"], st["totals"]["unread_cut"], st["totals"]["streams"]) == (0, 0, 1)


def test_a_client_that_said_hello_and_sends_nothing_more_is_cut_and_its_session_dropped(serve_demo):
    """A hand-made client that says Hello with a 0.1 s heartbeat and then nothing, not even a
    PING: the service cuts its connection (it sees it close) and drops its session."""
    svc = serve_demo("--heartbeat", "0.1")
    conn = zmtp_dealer(svc.data_port)
    try:
        hello = P.Hello(stream=1, spec=JobSpec(batch_size=8, image_size=16), heartbeat=0.1)
        conn.sendall(_frame(P.encode(hello)[0]))
        conn.settimeout(30)
        with pytest.raises(ConnectionError):
            while True:
                _recv_frame(conn)  # its Accept, then nothing until the cut closes the connection
    finally:
        conn.close()
    st = svc.status()
    assert st["totals"]["silent_cut"] == 1 and st["connections"]["sessions"] == 0
    svc.assert_alive()
