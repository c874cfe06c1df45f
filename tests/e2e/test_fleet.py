"""A fleet that changes during a run: a trainer given a DNS name follows its records (dnsmasq on
loopback, services on 127.0.0.1-3 on one port). Replicas join and leave mid-epoch, a replica comes
back on a new address, the name resolves to nothing for a while, and every epoch is still served
exactly once, byte for byte as from one service. A name that points at something that is not a
loader service is refused like any stranger."""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import pytest

from client import LoaderTimeout, RemoteLoader
from client.replica import Replica
from loader_service import shm

from tests.conftest import DEMO_SIZE
from testkit.dns import DnsServer, port_free_on
from testkit.helpers import collect, status
from testkit.proxy import Stranger
from testkit.service import ServiceProcess, can_own_shm

NAME = "loader-fleet"
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
KW = dict(batch_size=2, image_size=32, seed=4, prefetch=2)
STEP_S = 0.01  # the trainer's step: what a model's forward and backward would take

@pytest.fixture
def dns():
    with DnsServer() as server:
        yield server

def port_free_on_every_host() -> int:
    return port_free_on(HOSTS)


def follow(dns, port, **kw) -> RemoteLoader:
    return RemoteLoader(f"tcp://{NAME}:{port}", **KW, dns_server=dns.server, dns_refresh_s=0.1, **kw)

def endpoints(*hosts, port) -> set:
    return {f"tcp://{h}:{port}" for h in hosts}

def take_until(it, loader, done, got: list, what: str) -> None:
    """Train on (one step per batch) until ``done()``."""
    while not done():
        try:
            got.append(record(next(it)))
        except StopIteration:
            raise AssertionError(f"the epoch ended before {what}: the loader streams from {loader.replicas()}")
        time.sleep(STEP_S)

def record(batch) -> dict:
    return {"index": batch.index, "indices": list(batch.indices), "images": batch.raw.numpy().tobytes()}

def test_replicas_join_and_leave_mid_epoch_as_the_records_change(dns, make_service):
    port = port_free_on_every_host()
    a, b, c = (make_service(host=h, data_port=port, workers=1) for h in HOSTS)
    with RemoteLoader(a.endpoint, **KW) as one:
        ref = [collect(one) for _ in range(2)]
    services = dict(zip(HOSTS, (a, b, c)))
    before = {h: status(s)["totals"]["samples"] for h, s in services.items()}

    def served(*hosts) -> bool:
        return all(status(services[h])["totals"]["samples"] > before[h] for h in hosts)

    dns.set({NAME: HOSTS[:1]})
    with follow(dns, port, expect_replicas=3) as ld:
        assert ld.replicas() == []  # nothing resolved before it connects
        assert len(ld) == DEMO_SIZE // 2 and ld.replicas() == [f"tcp://127.0.0.1:{port}"]
        it, got = iter(ld), []
        got += [record(next(it)) for _ in range(3)]
        dns.set({NAME: HOSTS})  # 1 -> 3
        take_until(it, ld, lambda: served(*HOSTS[1:]), got, "the two replicas that joined served")
        assert set(ld.replicas()) == endpoints(*HOSTS, port=port)
        joined_at = len(got)
        dns.set({NAME: (HOSTS[0], HOSTS[2])})  # 3 -> 2: 127.0.0.2 drains and leaves
        gone = endpoints(HOSTS[0], HOSTS[2], port=port)
        take_until(it, ld, lambda: set(ld.replicas()) == gone, got, "127.0.0.2 left")
        left_at = len(got)
        b_total = status(b)["totals"]["samples"]
        got += [record(x) for x in it]
        epoch1 = [record(x) for x in ld]
    assert 3 <= joined_at <= left_at < len(got), (joined_at, left_at)  # all of it mid-epoch
    for epoch, (mine, theirs) in enumerate(((got, ref[0]), (epoch1, ref[1]))):
        assert sorted(i for x in mine for i in x["indices"]) == list(range(DEMO_SIZE)), f"epoch {epoch}"
        assert [x["images"] for x in mine] == [x["images"] for x in theirs], f"epoch {epoch}"
    assert status(b)["totals"]["samples"] == b_total  # nothing asked of it once it left

def test_replicas_that_join_a_colocated_fleet_mid_epoch_hand_their_batches_over_in_place(dns, make_service):
    """``local=True`` over a fleet that grows 1 -> 3 mid-epoch on this host: the two that joined
    were never asked to describe the dataset (where the probe first came), yet their Accepts name
    it, so their streams are asked again in place. Every batch of the epoch is read from shared
    memory, each sample once, byte for byte as from one service over the socket."""
    port = port_free_on_every_host()
    a, b, c = (make_service(host=h, data_port=port, workers=1) for h in HOSTS)
    with RemoteLoader(a.endpoint, **KW) as one:
        ref = collect(one)
    services = dict(zip(HOSTS, (a, b, c)))
    before = {h: status(s)["totals"]["samples"] for h, s in services.items()}
    dns.set({NAME: HOSTS[:1]})
    with follow(dns, port, expect_replicas=3, local=True) as ld:
        it = iter(ld)
        got = [record(next(it)) for _ in range(3)]
        dns.set({NAME: HOSTS})
        take_until(it, ld, lambda: all(status(services[h])["totals"]["samples"] > before[h] for h in HOSTS[1:]),
                   got, "the two replicas that joined served")
        delivery = {h: [x["delivery"] for x in status(s)["clients"]] for h, s in services.items()}
        got += [record(x) for x in it]
        stats = ld.stats()
    assert delivery == {h: ["in place"] for h in HOSTS}
    assert sorted(i for x in got for i in x["indices"]) == list(range(DEMO_SIZE))
    assert [x["images"] for x in got] == [x["images"] for x in ref]
    assert stats["local_batches"] == stats["batches"] == DEMO_SIZE // 2

def test_a_replica_that_comes_back_on_a_new_address(dns, make_service):
    port = port_free_on_every_host()
    first = make_service(host=HOSTS[1], data_port=port, workers=1)
    with RemoteLoader(first.endpoint, **KW) as one:
        ref = collect(one)
    dns.set({NAME: HOSTS[1:2]})
    with follow(dns, port, replica_timeout=2.0, heartbeat_s=0.3, timeout=60) as ld:
        it = iter(ld)
        got = [record(next(it)) for _ in range(5)]
        first.stop()  # the pod goes; Kubernetes recreates it elsewhere
        make_service(host=HOSTS[2], data_port=port, workers=1)
        dns.set({NAME: HOSTS[2:3]})
        got += [record(x) for x in it]
        assert ld.replicas() == [f"tcp://{HOSTS[2]}:{port}"]
    assert sorted(i for x in got for i in x["indices"]) == list(range(DEMO_SIZE))
    assert [x["images"] for x in got] == [x["images"] for x in ref]

def test_a_name_that_resolves_to_nothing_for_a_while_keeps_the_replicas_and_says_so_once(dns, make_service, caplog):
    port = port_free_on_every_host()
    a, b = make_service(host=HOSTS[0], data_port=port, workers=1), make_service(host=HOSTS[1], data_port=port,
                                                                                    workers=1)
    dns.set({NAME: HOSTS[:2]})
    caplog.set_level(logging.INFO, logger="client")
    with follow(dns, port) as ld:
        it = iter(ld)
        got = [record(next(it)) for _ in range(3)]
        dns.set({})  # the records are gone (NXDOMAIN / REFUSED) for a while
        while not [r for r in caplog.records if "resolved to nothing" in r.getMessage()]:
            got.append(record(next(it)))  # a StopIteration here: no lookup saw the empty records in an epoch
            time.sleep(STEP_S)
        for _ in range(20):  # several more lookups while it stays empty
            got.append(record(next(it)))
            time.sleep(STEP_S)
        assert set(ld.replicas()) == endpoints(*HOSTS[:2], port=port)
        dns.set({NAME: HOSTS[:2]})
        got += [record(x) for x in it]
    said = [r.getMessage() for r in caplog.records if "resolved to nothing" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"tcp://{NAME}:{port} resolved to nothing (")
    assert said[0].endswith(f"keeping its current replicas (tcp://127.0.0.1:{port}, tcp://127.0.0.2:{port}) "
                            "until it resolves again")
    assert sorted(i for x in got for i in x["indices"]) == list(range(DEMO_SIZE))

def test_a_name_that_is_not_a_loader_service_is_refused_like_a_stranger(dns):
    port = port_free_on_every_host()
    stranger = Stranger(port=port, host=HOSTS[1])
    try:
        dns.set({NAME: HOSTS[1:2]})
        with follow(dns, port, timeout=3) as ld:
            with pytest.raises(LoaderTimeout, match=f"reached tcp://{HOSTS[1]}:{port} but no ZeroMQ handshake "
                                                    "completed within 3s: something else listens there"):
                next(iter(ld))
        assert stranger.connections >= 1
    finally:
        stranger.close()

def test_a_name_that_never_resolves_is_a_clear_timeout(dns):
    with follow(dns, 5555, timeout=1) as ld:
        with pytest.raises(LoaderTimeout, match=f"tcp://{NAME}:5555 resolved to no address within 1s"):
            len(ld)


class Told(logging.Handler):
    """The client's log lines, in ``events`` beside what the loader asked (see ``asks``)."""

    def __init__(self, events: list):
        super().__init__(logging.INFO)
        self.events = events

    def emit(self, record) -> None:
        self.events.append(("log", record.getMessage()))


def _thaw(pids: list) -> None:
    """SIGCONT what was frozen (once; a process already gone is fine)."""
    while pids:
        try:
            os.kill(pids.pop(), signal.SIGCONT)
        except ProcessLookupError:
            pass


@pytest.fixture
def asks(monkeypatch):
    """Every Request with batches the loader sends, as ("ask", endpoint, batches), and every line
    of the client's log as ("log", text), in the order they happen."""
    events: list = []
    real = Replica.request

    def request(self, batches, *args, **kw):
        if batches:
            events.append(("ask", self.endpoint, list(batches)))
        return real(self, batches, *args, **kw)

    monkeypatch.setattr(Replica, "request", request)
    handler = Told(events)
    logger = logging.getLogger("client")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield events
    logger.removeHandler(handler)
    logger.setLevel(old)


def test_a_replica_sigtermed_with_its_record_kept_drains_at_once_exactly_once(dns, make_service, asks, monkeypatch):
    """Scale-down (or a rolling update) with the pod's record still listed: its SIGTERM notice, not
    its record's going nor ``replica_timeout``, moves what it owes to the other replica."""
    port = port_free_on_every_host()
    kw = dict(KW, batch_size=4, image_size=96, prefetch=4)  # the services, not the trainer, set the pace
    a = make_service(host=HOSTS[0], data_port=port, workers=1)
    b = ServiceProcess(port, ["--host", HOSTS[1], "--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1"])
    frozen: list = []
    try:
        with RemoteLoader(a.endpoint, **{**kw, "prefetch": 2}) as one:
            ref = [collect(one) for _ in range(2)]
        dns.set({NAME: HOSTS[:2]})  # and so it stays: the record outlives the process
        a_ep, b_ep = endpoints(HOSTS[0], port=port).pop(), endpoints(HOSTS[1], port=port).pop()
        b_workers = [w["pid"] for w in b.status()["workers"]["list"] if w["pid"]]
        assert b_workers
        waits, got, stopped = [], [], []
        counted = Replica.request  # the asks fixture's: it records every Request

        def request(self, batches, *args, **kw):
            """Mid-epoch, as the loader asks b for more: b's worker is frozen before the Request
            leaves, so b surely still owes these batches when its SIGTERM notice goes out (else a
            loaded machine could let b send all it was asked first, and the test proves nothing).
            It thaws once the client has taken the notice."""
            if batches and not stopped and self.endpoint == b_ep and len(got) >= 10:
                for pid in b_workers:
                    os.kill(pid, signal.SIGSTOP)
                frozen.extend(b_workers)
                counted(self, batches, *args, **kw)
                asks.append(("sigterm", len(got)))
                b.proc.send_signal(signal.SIGTERM)
                stopped.append(len(got))
                return
            counted(self, batches, *args, **kw)

        monkeypatch.setattr(Replica, "request", request)
        with RemoteLoader(f"tcp://{NAME}:{port}", **kw, dns_server=dns.server, dns_refresh_s=0.1,
                          replica_timeout=30.0, timeout=60) as ld:
            it = iter(ld)
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                waits.append(time.perf_counter() - t0)
                got.append(record(batch))
                if frozen and any(e[0] == "log" and "is shutting down" in e[1] for e in asks):
                    _thaw(frozen)  # so b's workers stop as on any SIGTERM, not by its stop ladder's kill
            epoch1 = [record(x) for x in ld]  # the next epoch: the record still lists it
        assert stopped, "the loader never asked b for a batch after the 10th"
        assert b.proc.wait(30) == 0
    finally:
        _thaw(frozen)
        b.stop()
    for mine, theirs in ((got, ref[0]), (epoch1, ref[1])):
        assert sorted(i for x in mine for i in x["indices"]) == list(range(DEMO_SIZE))
        assert [x["images"] for x in mine] == [x["images"] for x in theirs]
    lines = [e[1] for e in asks if e[0] == "log"]
    assert not [t for t in lines if "unreachable" in t], lines  # nothing waited for replica_timeout
    at = [i for i, e in enumerate(asks) if e[0] == "log" and e[1].startswith(f"service replica {b_ep} is shutting")]
    assert len(at) == 1, lines
    said = re.fullmatch(rf"service replica {re.escape(b_ep)} is shutting down; it drains: its (\d+) batches"
                        rf"(?: \(([\d, ]+)\))? go to {re.escape(a_ep)}", asks[at[0]][1])
    assert said, asks[at[0]][1]
    owed = [int(x) for x in said.group(2).split(", ")] if said.group(2) else []
    assert len(owed) == int(said.group(1)) >= 1, "b owed nothing when it stopped: the test proves nothing"
    after = [e for e in asks[at[0]:] if e[0] == "ask"]
    assert not [e for e in after if e[1] == b_ep], "a batch was asked of the replica that said it stops"
    # its batches are the very next asked, of a, lowest first (before any batch never asked of anyone)
    assert after and after[0][1] == a_ep and after[0][2][0] == owed[0]
    asked_of_a = [b for e in after for b in e[2]]
    assert asked_of_a[:len(owed)] == owed
    sigterm = next(i for i, e in enumerate(asks) if e[0] == "sigterm")
    assert sigterm < at[0]
    asked_of_b = {x for e in asks[:at[0]] if e[0] == "ask" and e[1] == b_ep for x in e[2]}
    assert set(owed) <= asked_of_b  # what it was asked and never sent: asked once more, of a
    print(f"longest wait {max(waits) * 1000:.0f} ms; after the SIGTERM {max(waits[stopped[0]:]) * 1000:.0f} ms "
          f"(batches {len(waits)}, {len(owed)} moved)")


def test_a_replica_serving_other_data_mid_epoch_is_quarantined_and_the_epoch_completes_exactly_once(
        dns, make_service, caplog):
    port = port_free_on_every_host()
    a, b = (make_service(host=h, data_port=port, workers=1) for h in HOSTS[:2])
    other = make_service(host=HOSTS[2], data_port=port, workers=1, demo_size=DEMO_SIZE + 16)  # another dataset
    with RemoteLoader(a.endpoint, **KW) as one:
        ref = [collect(one) for _ in range(2)]
    caplog.set_level(logging.INFO, logger="client")
    dns.set({NAME: HOSTS[:2]})
    with follow(dns, port) as ld:
        it = iter(ld)
        got = [record(next(it)) for _ in range(5)]
        dns.set({NAME: HOSTS})  # a rolling update brings a pod on other data
        take_until(it, ld, lambda: [r for r in caplog.records if "quarantined" in r.getMessage()], got,
                   "the replica on other data was refused")
        assert set(ld.replicas()) == endpoints(*HOSTS, port=port)
        got += [record(x) for x in it]
        epoch1 = [record(x) for x in ld]  # it stays listed: asked again at the epoch's start, refused again
        quarantined, counted = ld.quarantined(), ld.stats()["quarantined"]
    for mine, theirs in ((got, ref[0]), (epoch1, ref[1])):
        assert sorted(i for x in mine for i in x["indices"]) == list(range(DEMO_SIZE))
        assert [x["images"] for x in mine] == [x["images"] for x in theirs]
    bad = f"tcp://{HOSTS[2]}:{port}"
    said = [r for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    why = (f"serves 'demo' with {DEMO_SIZE + 16} samples (fingerprint {status(other)['datasets']['demo']['fingerprint']}), "
           f"not the dataset this loader's epochs were planned on ({DEMO_SIZE} samples, fingerprint "
           f"{status(a)['datasets']['demo']['fingerprint']})")
    assert said[0].getMessage().startswith(f"service replica {bad} is quarantined: it {why}; the epoch goes on with ")
    assert quarantined == {bad: why} and counted == 1
    assert status(other)["totals"]["samples"] == 0  # nothing of it was ever used


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_a_colocated_fleet_whose_records_change_and_services_stop_and_come_back_serves_every_epoch_exactly(dns,
                                                                                                           seed):
    """Churn on a co-located fleet, on a seeded schedule: ``local=True`` follows a name over three
    service processes on this host while the records change and services are SIGTERMed or
    SIGKILLed mid-epoch and come back at their address, on this host's /dev/shm or in one of their
    own (where a private mount namespace is permitted). Every case at once that a co-located
    stream must survive: replicas that join (judged at their Accept), come back out of reach
    (asked again over the socket), stop with batches in place unread (asked again), drain, leave.
    Three epochs, each byte for byte the reference; the services end healthy."""
    import random

    rng = random.Random(seed)
    port = port_free_on_every_host()
    args = ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1", "--heartbeat", "0.5"]

    def start(host, own=False):
        return ServiceProcess(port, ["--host", host, *args], drain=True, own_shm_mb=64 if own else 0)

    services = {h: start(h) for h in HOSTS}
    told, killed = [], []
    try:
        kw = dict(batch_size=8, image_size=32, seed=4, shuffle=True)
        with RemoteLoader(services[HOSTS[0]].endpoint, **kw) as one:
            ref = []
            for e in range(3):
                one.set_epoch(e)
                ref.append(collect(one))
        dns.set({NAME: HOSTS})
        with RemoteLoader(f"tcp://{NAME}:{port}", **kw, local=True, dns_server=dns.server, dns_refresh_s=0.1,
                          replica_timeout=3.0, heartbeat_s=0.5, timeout=90) as ld:
            for e in range(3):
                ld.set_epoch(e)
                got = []
                for batch in ld:
                    got.append(record(batch))
                    if rng.random() < 0.12:
                        host, what = rng.choice(HOSTS), rng.random()
                        if what < 0.3:
                            listed = [h for h in HOSTS if rng.random() < 0.7] or [host]
                            dns.set({NAME: listed})
                            told.append(f"epoch {e} batch {len(got)}: records {listed}")
                        else:
                            sig = signal.SIGTERM if what < 0.65 else signal.SIGKILL
                            own = can_own_shm() and rng.random() < 0.5
                            services[host].kill(sig)
                            services[host].stop()
                            killed.append(services[host].proc.pid)
                            services[host] = start(host, own)
                            told.append(f"epoch {e} batch {len(got)}: {host} {sig.name}, back"
                                        f"{' in a /dev/shm of its own' if own else ''}")
                assert sorted(i for x in got for i in x["indices"]) == list(range(DEMO_SIZE)), told
                assert [x["images"] for x in got] == [x["images"] for x in ref[e]], told
            stats = ld.stats()
        assert 0 < stats["local_batches"] and len(told) >= 3, (stats, told)
        for svc in services.values():
            assert svc.status()["healthy"], told
    finally:
        for svc in services.values():
            svc.stop()
        for pid in killed:  # a killed service's segments, which the next one on this /dev/shm would sweep
            for name in shm.list_segments(pid):
                os.unlink(os.path.join(shm.SHM_DIR, name))
