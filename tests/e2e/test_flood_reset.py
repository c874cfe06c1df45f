"""Clients that flood the data port, and ones that flood it and reset their connection, against a
live service process (were libzmq to abort, it would take the process it runs in with it).

Before: the data port capped what a connection had sent unread at 32 messages (ZMQ_RCVHWM), and
libzmq 4.3.5 aborted the whole service (exit -6, ``Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)``) when a connection it had stopped reading for that cap ended
in a TCP reset and then met the service's heartbeat timer or a PING it had sent: the first test
below aborted it in 5 runs of 5, within its first 15 peers. Now libzmq reads every connection and
the dispatcher cuts one that sends past its allowance (loader_service/dispatch/flood.py). The
other way libzmq stops reading a connection, a handover, is tested in test_silence.py (the data
port sends no heartbeat since).
"""

from __future__ import annotations

import zmq

from client import RemoteLoader

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, dealer, indices_of
from testkit.hostile import flood_and_reset, zmtp_burst, zmtp_dealer
from testkit.service import ServiceProcess


def _an_epoch(svc: ServiceProcess) -> list:
    with RemoteLoader(svc.endpoint, batch_size=16, image_size=32, epoch_lookahead=False, timeout=120) as ld:
        return sorted(indices_of(collect(ld)))


def test_peers_that_flood_and_reset_their_connection_leave_the_service_serving(serve_demo):
    """300 hand-made peers in a row, each 200 messages with a PING after every 10, then a reset,
    against a service that looks for silent connections every 20 ms (its heartbeat, on the old
    build): it serves on, and a loader's epoch after them is exact."""
    svc = serve_demo("--heartbeat", "0.02")
    for k in range(300):
        try:
            flood_and_reset(svc.data_port, messages=200, ping_every=10)
        except OSError as exc:  # refused or reset in its handshake: the service is gone
            svc.assert_alive()
            raise AssertionError(f"peer {k}: {exc}") from None
    svc.assert_alive()
    assert _an_epoch(svc) == list(range(DEMO_SIZE))
    st = svc.status()
    assert st["healthy"] and st["totals"]["internal_errors"] == 0
    svc.assert_alive()


def test_a_flood_is_cut_at_its_allowance_and_the_rest_dropped_unread_while_a_loader_is_served(serve_demo):
    """20,000 garbage messages in one write from a client made by hand that reads nothing and
    never reconnects, on an allowance of 1,000 that time does not earn back, while a loader is in
    the middle of its epoch: exactly 1,000 are read and refused, the connection is cut (the
    client sees it close), and the rest is dropped unread; the loader's epoch is exact."""
    svc = serve_demo("--client-allowance", "1000", "--client-allowance-rate", "0")
    with RemoteLoader(svc.endpoint, batch_size=16, image_size=32, epoch_lookahead=False, timeout=120) as ld:
        batches = iter(ld)
        seen = list(next(batches).indices)  # its session is open
        flooder = zmtp_dealer(svc.data_port)
        try:
            flooder.sendall(zmtp_burst(20_000))
            flooder.settimeout(60)
            try:
                while flooder.recv(1 << 16):  # the refusals, until the cut closes it
                    pass
            except ConnectionResetError:
                pass
        finally:
            flooder.close()
        seen += [i for b in batches for i in b.indices]
    assert sorted(seen) == list(range(DEMO_SIZE))
    t = svc.status()["totals"]
    assert (t["bad_messages"], t["floods_cut"]) == (1000, 1) and 0 < t["flooded_messages"] <= 19_000, t
    assert t["internal_errors"] == 0
    svc.assert_alive()


def test_a_client_that_reconnects_and_floods_on_is_cut_again(serve_demo):
    """A pyzmq DEALER reconnects by itself with the same identity: what it sends on the new
    connection is dropped unread and charged to that connection, which is cut in turn."""
    svc = serve_demo("--client-allowance", "1000", "--client-allowance-rate", "0")
    flooder = dealer(svc.endpoint)
    try:
        flooder.setsockopt(zmq.SNDHWM, 0)
        flooder.setsockopt(zmq.RCVHWM, 0)  # it reads nothing, but sees the cut and reconnects
        sent = 0
        while svc.status()["totals"]["floods_cut"] < 2:
            for _ in range(5000):
                flooder.send(b"\xc1")
            sent += 5000
            assert sent <= 2_000_000, svc.status()["totals"]
        t = svc.status()["totals"]
        assert t["internal_errors"] == 0 and t["flooded_messages"] > 0
        svc.assert_alive()
    finally:
        flooder.close(0)


def test_the_project_s_client_is_never_cut_on_the_least_allowance(serve_demo):
    """Three epochs with a validation pass beside, on an allowance of 16 that time does not earn
    back: what the loaders are sent pays for what they send."""
    svc = serve_demo("--client-allowance", "16", "--client-allowance-rate", "0")
    kw = dict(batch_size=16, image_size=32, timeout=120)
    with RemoteLoader(svc.endpoint, job="train", **kw) as train, \
            RemoteLoader(svc.endpoint, job="val", train=False, shuffle=False, **kw) as val:
        for epoch in range(3):
            train.set_epoch(epoch)
            assert sorted(indices_of(collect(train))) == list(range(DEMO_SIZE))
            assert indices_of(collect(val)) == list(range(DEMO_SIZE))
    t = svc.status()["totals"]
    assert (t["floods_cut"], t["flooded_messages"]) == (0, 0), t
