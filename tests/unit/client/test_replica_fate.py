"""What a replica's own messages do to its part in the running epoch (client/connections.py),
over real sockets: a ZeroMQ ROUTER per replica plays its service. A shutting-down notice drains
the replica at once (its batches go to the others, nothing new goes to it); a replica that serves
other data is quarantined and named once, and only when no replica that serves the loader's
dataset remains is it fatal."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import pytest
import zmq

from wire import protocol as P

from client.config import LoaderConfig
from client.connections import Connections
from client.errors import LoaderError, LoaderTimeout
from client.stats import LoaderStats

IDENTITY = (40, "fp-good", "dec-good")  # (length, fingerprint, decoding)
DEADLINE_S = 10.0


class Services:
    """One ROUTER per replica on 127.0.0.1, and a Connections set (window 4) to them."""

    def __init__(self, n: int):
        self.ctx = zmq.Context()
        self.routers, endpoints = [], []
        for _ in range(n):
            s = self.ctx.socket(zmq.ROUTER)
            s.setsockopt(zmq.LINGER, 0)
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.routers.append(s)
            endpoints.append(f"tcp://127.0.0.1:{port}")
        self.conns = Connections(self.ctx, endpoints, LoaderConfig.of(endpoints[0], batch_size=2), curve=None,
                                 frame_cap=1 << 20, window=4, client_id="c" * 32, stream_ids=itertools.count(1),
                                 stats=LoaderStats())
        self.conns.identity = IDENTITY
        self.peers = {}

    def start_epoch(self, total: int = 20, lookahead: bool = False):
        flow = self.conns.start_epoch(0, 0, total, lookahead=lookahead)
        for i in range(len(self.routers)):  # each service reads up to its Hello (and learns who we are)
            hello = None
            while not isinstance(hello, P.Hello):
                self.peers[i], hello = self.read(i)
        for r in self.conns.replicas:  # the handshakes are done (a Hello came through)
            r.down_since = None
        return flow

    def read(self, i: int):
        s = self.routers[i]
        assert s.poll(DEADLINE_S * 1000), f"replica {i} heard nothing within {DEADLINE_S}s"
        ident, *frames = s.recv_multipart()
        msg, _ = P.decode(frames)
        return ident, msg

    def send(self, i: int, msg: P.Message, *data: bytes) -> None:
        self.routers[i].send_multipart([self.peers[i], *P.encode(msg, *data)])

    def receive(self, i: int):
        """What the loader makes of the next message of replica ``i``."""
        r, deadline = self.conns.replicas[i], time.monotonic() + DEADLINE_S
        while not r.has_message():
            assert time.monotonic() < deadline, f"nothing from replica {i} within {DEADLINE_S}s"
            if r.has_event():
                r.on_monitor()  # the handshake's events
            r.wait(100)
        return self.conns.recv(r, sink=None)

    def accept(self, i: int, identity=IDENTITY, total: int = 20) -> P.Accept:
        r = self.conns.replicas[i]
        return P.Accept(stream=r.stream, epoch=0, num_batches=total, num_samples=2 * total,
                        dataset_length=identity[0], dataset="data", fingerprint=identity[1],
                        decoding=identity[2] if len(identity) > 2 else IDENTITY[2])

    def close(self) -> None:
        self.conns.close()
        for s in self.routers:
            s.close(0)
        self.ctx.term()


@pytest.fixture
def services():
    made = []

    def make(n: int) -> Services:
        made.append(Services(n))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_shutting_down_notice_hands_what_the_replica_owes_to_the_others_at_once(services, caplog):
    caplog.set_level(logging.INFO, logger="client")
    s = services(2)
    flow = s.start_epoch()
    a, b = s.conns.replicas
    owed = sorted(flow.outstanding[b.index])
    assert owed, "the first assignment gives both replicas batches"
    s.send(1, P.Error(code=P.ErrorCode.SHUTTING_DOWN, fatal=False, message="the service is stopping"))
    assert s.receive(1) == (None, None)
    assert b.dead and b.shutdown_at is not None
    assert flow.outstanding[b.index] == set()
    # what the run asks next (EpochRun._ask: replicas neither dead, draining nor down) goes to a,
    # lowest first, and b's batches come before any new one
    live = [r.index for r in s.conns.replicas if not r.dead and not r.draining and r.down_since is None]
    assert live == [a.index]
    flow.outstanding[a.index].clear()  # a delivered what it had (its credit is free again)
    assert flow.assign(live)[a.index][:len(owed)] == owed
    said = [r.getMessage() for r in caplog.records if "shutting down" in r.getMessage()]
    assert said == [f"service replica {b.endpoint} is shutting down; it drains: its {len(owed)} batches "
                    f"({', '.join(map(str, owed))}) go to {a.endpoint}"]
    assert [r.levelno for r in caplog.records if "shutting down" in r.getMessage()] == [logging.WARNING]


def test_a_lone_replica_that_shuts_down_is_waited_for_not_given_up(services):
    s = services(1)
    flow = s.start_epoch()
    (r,) = s.conns.replicas
    owed = set(flow.outstanding[r.index])
    s.send(0, P.Error(code=P.ErrorCode.SHUTTING_DOWN, fatal=False, message="stopping"))
    assert s.receive(0) == (None, None)
    assert not r.dead and flow.outstanding[r.index] == owed  # its reconnect restarts the stream with them


def test_a_replica_that_serves_other_data_is_quarantined_named_once_and_its_batches_go_to_the_others(
        services, caplog):
    caplog.set_level(logging.WARNING, logger="client")
    s = services(3)
    flow = s.start_epoch()
    a, b, c = s.conns.replicas
    s.send(0, s.accept(0))
    assert isinstance(s.receive(0)[0], P.Accept)
    owed = sorted(flow.outstanding[b.index])
    s.send(1, s.accept(1, identity=(48, "fp-other")))
    assert s.receive(1) == (None, None)  # never handed to the run: no batch count is checked against it
    why = ("serves 'data' with 48 samples (fingerprint fp-other), not the dataset this loader's epochs were "
           "planned on (40 samples, fingerprint fp-good)")
    assert s.conns.quarantined() == {b.endpoint: why}
    assert b.dead and not b.accepted and b.stream == -1 and flow.outstanding[b.index] == set()
    assert not s.conns.healthy()  # so no epoch starts ahead on it
    # its stream is told to end, and what it still sends is stale: dropped, never a batch
    ident, ended = s.read(1)
    assert isinstance(ended, P.Request) and ended.final and ended.batches == []
    s.send(1, P.Batch(stream=ended.stream, epoch=0, index=owed[0], indices=[0, 1], shape=[2, 1, 1, 3]),
           bytes(6), bytes(16))
    assert s.receive(1) == (None, None)
    # a second refusal of the same data is not said again; a new epoch asks it for nothing up front
    flow = s.start_epoch()
    assert flow.outstanding[b.index] == set() and flow.outstanding[a.index] and flow.outstanding[c.index]
    s.send(1, s.accept(1, identity=(48, "fp-other")))
    assert s.receive(1) == (None, None)
    said = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert said == [f"service replica {b.endpoint} is quarantined: it {why}; the epoch goes on with {a.endpoint}, "
                    f"{c.endpoint} (do all replicas serve the same dataset? a rolling update that changes the data "
                    "mixes two)"]
    # back on the loader's data (its pod replaced again): it takes batches again
    flow = s.start_epoch()
    s.send(1, s.accept(1))
    assert isinstance(s.receive(1)[0], P.Accept)
    assert s.conns.quarantined() == {} and not b.dead


def test_mismatch_is_fatal_only_when_no_replica_serves_the_loaders_dataset(services):
    s = services(2)
    s.start_epoch()
    a, b = s.conns.replicas
    s.send(1, s.accept(1, identity=(48, "fp-other")))
    assert s.receive(1) == (None, None)
    s.send(0, s.accept(0, identity=(40, "fp-new")))
    with pytest.raises(LoaderError) as info:
        s.receive(0)
    assert info.value.code == P.ErrorCode.REPLICA_MISMATCH == "replica_mismatch"
    assert info.value.message == (
        f"no replica serves the dataset this loader's epochs were planned on: {a.endpoint} serves 'data' with 40 "
        "samples (fingerprint fp-new), not the dataset this loader's epochs were planned on (40 samples, fingerprint "
        f"fp-good); {b.endpoint} serves 'data' with 48 samples (fingerprint fp-other), not the dataset this "
        "loader's epochs were planned on (40 samples, fingerprint fp-good). Samples would be missed or doubled, so "
        "none is used: deploy every replica on the same data, or start a new loader (a new epoch) on the new one")


def test_the_one_service_a_loader_has_that_changed_is_still_dataset_changed(services):
    s = services(1)
    s.start_epoch()
    s.send(0, s.accept(0, identity=(48, "fp-other")))
    with pytest.raises(LoaderError, match=r"^\[dataset_changed\] the dataset changed: the service at "):
        s.receive(0)


def test_a_timeout_names_the_quarantined_replicas_it_did_not_ask(services):
    s = services(2)
    s.start_epoch()
    a, b = s.conns.replicas
    s.send(1, s.accept(1, identity=(48, "fp-other")))
    assert s.receive(1) == (None, None)
    with pytest.raises(LoaderTimeout) as info:
        s.conns.raise_timeout()  # a said nothing
    assert info.value.message.endswith(
        f"; not asked, as they serve other data: {b.endpoint} serves 'data' with 48 samples (fingerprint fp-other), "
        "not the dataset this loader's epochs were planned on (40 samples, fingerprint fp-good)")


def test_an_epoch_started_ahead_is_given_up_not_waited_for_when_a_replica_serves_other_data(services):
    """The lookahead's adoption reads each replica's Accept itself and starts the epoch plainly on
    a refusal (client/lookahead.py): a mismatch there is one, never a wait for an Accept that will
    not count; once a run waits on the set, a mismatch quarantines as usual."""
    s = services(2)
    s.start_epoch(lookahead=True)
    s.send(1, s.accept(1, identity=(48, "fp-other")))
    with pytest.raises(LoaderError) as info:
        s.receive(1)
    assert info.value.code == "replica_mismatch"
    assert s.conns.quarantined() == {}
    s.start_epoch(lookahead=True)
    s.conns.poll(0)  # a run waits on it: the trainer's epoch now
    s.send(1, s.accept(1, identity=(48, "fp-other")))
    assert s.receive(1) == (None, None)
    assert list(s.conns.quarantined()) == [s.conns.replicas[1].endpoint]


def test_a_disconnect_read_before_a_long_step_is_no_cut_while_libzmq_s_next_event_waits_unread(services):
    """The trainer reads a DISCONNECTED event, takes a batch that was already there, and steps for
    longer than the cut grace (1 s) before it waits again; libzmq's CONNECT_RETRIED, queued right
    behind the disconnect, is still unread. The connection is libzmq's to retry, not cut. Before, the
    next wait judged it by the clock alone and ended the loader with ``cut for breaking the
    protocol`` (a scratch soak found it: one service SIGTERMed and back while the trainer stepped)."""
    s = services(1)
    s.start_epoch()
    r = s.conns.replicas[0]
    while r.has_event():  # the handshake's events
        r.on_monitor()
    s.routers[0].close(0)  # the service goes (and libzmq will try again)
    while r.down_since is None:
        assert r.monitor.poll(DEADLINE_S * 1000), "no disconnect event"
        r.on_monitor()
    assert r.monitor.poll(DEADLINE_S * 1000), "libzmq scheduled no reconnect"  # its event waits, unread
    later = time.monotonic() + 5.0  # a long training step
    s.conns.check_connections(later)  # no LoaderError: an event is still to be read
    assert not r.is_cut(later)
    while r.has_event():
        r.on_monitor()
    assert r.retried and not r.is_cut(later)


def test_lane_sets_lost_are_counted_anew_only_for_a_new_service_over_a_new_connection(services):
    """A service restarted at the address (a new ``Accept.service`` over a new connection) starts
    with no lane set lost, so lanes given up after MAX_LANES_LOST failed sets with one process are
    tried again with the next. A new id on the same connection is no restart: a peer that sends one
    with every Accept cannot keep the loader opening lanes that fail."""
    from client.replica import MAX_LANES_LOST

    s = services(1)
    s.start_epoch()
    r = s.conns.replicas[0]
    s.send(0, dataclasses.replace(s.accept(0), service="first"))
    s.receive(0)
    for _ in range(MAX_LANES_LOST):
        r.drop_lanes("lane 0 was closed by the service")
    assert r.lanes_off.startswith(f"{MAX_LANES_LOST} sets of bulk lanes failed")

    s.send(0, dataclasses.replace(s.accept(0), service="second"))  # the same connection
    s.receive(0)
    assert r.service == "second" and r.lanes_lost == MAX_LANES_LOST and r.lanes_off

    address = s.routers[0].getsockopt(zmq.LAST_ENDPOINT).decode()
    s.routers[0].close(0)  # the service goes; another process binds its address
    deadline = time.monotonic() + DEADLINE_S
    while True:
        router = s.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            router.bind(address)
            break
        except zmq.ZMQError:
            router.close(0)
            assert time.monotonic() < deadline, f"{address} not free again within {DEADLINE_S}s"
            time.sleep(0.05)
    s.routers[0] = router
    while not r.reconnected:
        assert r.monitor.poll(DEADLINE_S * 1000), "the loader did not connect again"
        r.on_monitor()
    while True:  # until the new service knows the loader's connection
        try:
            s.send(0, dataclasses.replace(s.accept(0), service="third"))
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the new service never saw the loader connect"
            time.sleep(0.05)
    s.receive(0)
    assert r.service == "third" and r.lanes_lost == 0 and not r.lanes_off


def test_a_notice_read_while_the_other_replica_is_down_drains_once_that_one_is_back(services, caplog):
    """Both replicas stopped in turn while the trainer did not iterate: a's notice may be read
    before b's return (the set reads replicas in order). a is waited for only until b is back, then
    drains to it at once: not after ``replica_timeout``, nor a timeout with a healthy replica up."""
    caplog.set_level(logging.INFO, logger="client")
    s = services(2)
    flow = s.start_epoch()
    a, b = s.conns.replicas
    owed = sorted(flow.outstanding[a.index])
    assert owed, "the first assignment gives both replicas batches"
    b.down_since = time.monotonic()  # b restarts: its return not read yet
    s.send(0, P.Error(code=P.ErrorCode.SHUTTING_DOWN, fatal=False, message="stopping"))
    assert s.receive(0) == (None, None)
    assert not a.dead and sorted(flow.outstanding[a.index]) == owed  # nobody to drain to: waited for
    s.conns.drain_announced()
    assert not a.dead, "b is still down: nothing changes"
    b.down_since = None  # b's handshake succeeded (EpochRun._on_monitor calls drain_announced then)
    s.conns.drain_announced()
    assert a.dead and flow.outstanding[a.index] == set()
    said = [r.getMessage() for r in caplog.records if "shutting down" in r.getMessage()]
    assert said == [f"service replica {a.endpoint} is shutting down; no other replica takes its batches, so the loader "
                    "waits for it to come back (up to its timeout)",
                    f"service replica {a.endpoint} is shutting down; it drains: its {len(owed)} batches "
                    f"({', '.join(map(str, owed))}) go to {b.endpoint}"]
    s.conns.drain_announced()  # said once
    assert len([r for r in caplog.records if "shutting down" in r.getMessage()]) == 2



def test_a_replica_that_decodes_otherwise_is_quarantined_while_others_decode_the_loaders_way(services, caplog):
    """The same dataset with other decode settings (--jpeg-fast-dct, say) gives other bytes: it is not
    mixed in while a replica decodes it the loader's way; when none does any more (the last of a
    rolling update), the loader follows the new way, the plan being the same."""
    caplog.set_level(logging.INFO, logger="client")
    s = services(2)
    flow = s.start_epoch()
    a, b = s.conns.replicas
    s.send(0, s.accept(0))
    s.receive(0)
    s.send(1, s.accept(1, identity=(40, "fp-good", "dec-fast")))
    assert s.receive(1) == (None, None)
    assert b.refused == ("decodes 'data' otherwise than the replicas this loader follows (decoding dec-fast, not "
                         "dec-good: other --jpeg-fast-dct, --jpeg-fast-upsample, --max-image-pixels or --pipeline "
                         "code), so its batches' bytes would differ")
    assert b.dead and flow.outstanding[b.index] == set() and not a.refused
    assert s.conns.identity == IDENTITY
    # a restarts with the new settings too: nobody decodes the old way, so the loader follows
    s.conns.replicas[1].refused = s.conns.refused[b.endpoint]  # (still quarantined)
    s.send(0, s.accept(0, identity=(40, "fp-good", "dec-fast")))
    msg, _ = s.receive(0)
    assert isinstance(msg, P.Accept) and s.conns.identity == (40, "fp-good", "dec-fast")
    said = [r.getMessage() for r in caplog.records if "decodes the dataset otherwise now" in r.getMessage()]
    assert said == [f"service replica {a.endpoint} decodes the dataset otherwise now (decoding dec-fast, was dec-good: "
                    "other decode settings or pipeline code); the loader follows it"]
