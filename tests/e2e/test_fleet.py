"""A fleet that changes during a run: a trainer given a DNS name follows its records (dnsmasq on
loopback, services on 127.0.0.1-3 on one port). Replicas join and leave mid-epoch, a replica comes
back on a new address, the name resolves to nothing for a while, and every epoch is still served
exactly once, byte for byte as from one service. A name that points at something that is not a
loader service is refused like any stranger."""

from __future__ import annotations

import logging
import time

import pytest

from client import LoaderTimeout, RemoteLoader

from tests.conftest import DEMO_SIZE
from tests.support.dns import DnsServer, port_free_on
from tests.support.helpers import collect, status
from tests.support.proxy import Stranger

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
