"""Transient is not fatal: a service restarted behind an accept-then-close L4 proxy, or a stranger
briefly on the data port, is waited for (exactly once, no error); only the loader's timeout ends
the wait, with a message that says what the tries met. A service that stops for good says so."""

import signal
import threading
import time

import pytest

from client import LoaderError, LoaderTimeout, RemoteLoader

from tests.conftest import DEMO_SIZE
from testkit.helpers import wait_for
from testkit.proxy import Proxy, Stranger
from testkit.service import ServiceProcess, free_port

KW = dict(batch_size=8, image_size=32, seed=4, prefetch=1, epoch_lookahead=False)
DOWN_S = 2.5  # how long the service stays away in the restart stories (the scenario, not a wait)


def start(port: int) -> ServiceProcess:
    return ServiceProcess(port, ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "2"],
                          env=dict(LOADER_HEARTBEAT_S="0.5"))


@pytest.fixture
def services():
    started = []

    def make(port: int) -> ServiceProcess:
        sp = start(port)
        started.append(sp)
        return sp

    yield make
    for sp in started:
        sp.stop()


def in_background(fn) -> threading.Thread:
    errors = []

    def run():
        try:
            fn()
        except BaseException as exc:  # re-raised by the test
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.errors = errors
    t.start()
    return t


def test_a_restart_behind_an_accept_then_close_proxy_is_waited_for_exactly_once(services):
    port = free_port()
    first = services(port)
    got = []
    with Proxy(("127.0.0.1", port)) as proxy:
        with RemoteLoader(proxy.endpoint, **KW, timeout=60) as ld:
            it = iter(ld)
            for _ in range(5):
                got.extend(next(it).indices)

            def restart():
                first.proc.send_signal(signal.SIGTERM)
                first.proc.wait(30)
                wait_for(lambda: proxy.closed >= 3, what="the proxy to accept and close the loader's tries")
                time.sleep(DOWN_S)
                services(port)

            t = in_background(restart)
            try:
                for b in it:  # waits through the proxy's closes while the service is away
                    got.extend(b.indices)
            finally:
                t.join(60)  # before the fixture stops the services, whatever happened
                # here, so that a service that failed to come back shows beside a loader's timeout
                assert not t.errors, t.errors
            assert ld.stats()["restarts"] >= 1
    assert sorted(got) == list(range(DEMO_SIZE))
    assert proxy.closed >= 3


@pytest.mark.parametrize("reply", [b"\xff" + b"x" * 63, b"HTTP/1.1 400 Bad Request\r\n\r\n", None],
                         ids=["not-zmtp", "http", "silent"])
def test_a_stranger_briefly_on_the_data_port_is_waited_out_exactly_once(services, reply):
    stranger = Stranger(reply=reply)
    port = stranger.port
    try:
        with RemoteLoader(stranger.endpoint, **KW, timeout=60) as ld:
            def take_over():
                wait_for(lambda: stranger.connections >= 1, what="the loader to reach the stranger")
                time.sleep(1.0)  # the loader meets the stranger for a while
                stranger.close()
                services(port)

            t = in_background(take_over)
            try:
                got = [i for b in ld for i in b.indices]
            finally:
                t.join(60)  # before the fixture stops the services, whatever happened
                # here, so that a service that failed to come back shows beside a loader's timeout
                assert not t.errors, t.errors
    finally:
        stranger.close()
    assert sorted(got) == list(range(DEMO_SIZE))


def test_a_proxy_that_never_finds_a_backend_fails_at_the_timeout_saying_what_was_seen():
    with Proxy(None) as proxy:
        with RemoteLoader(proxy.endpoint, **KW, timeout=3) as ld:
            with pytest.raises(LoaderTimeout) as info:
                len(ld)
    msg = info.value.message
    assert msg.startswith(f"connections to {proxy.endpoint} were accepted and closed ")
    assert msg.endswith("; no loader service answered within 3s (a TCP proxy without a backend, a service still "
                        "starting, or something else on that port?)")
    assert "CURVE" not in msg and "auth" not in msg
    assert proxy.closed >= 3


def test_a_stranger_that_never_leaves_fails_at_the_timeout_saying_what_was_seen():
    with Stranger(reply=b"\xff" + b"x" * 63) as stranger:
        with RemoteLoader(stranger.endpoint, **KW, timeout=3) as ld:
            with pytest.raises(LoaderTimeout) as info:
                len(ld)
    msg = info.value.message
    assert msg.startswith(f"connections to {stranger.endpoint} were answered with something that is not ZeroMQ ")
    assert "no loader service answered within 3s" in msg
    assert "CURVE" not in msg and "not retried" not in msg
    assert stranger.connections >= 3  # retried, with backoff


def test_a_service_that_stops_for_good_is_named_as_having_announced_it(services):
    port = free_port()
    svc = services(port)
    with RemoteLoader(svc.endpoint, **KW, timeout=4) as ld:
        it = iter(ld)
        next(it)
        svc.proc.send_signal(signal.SIGTERM)
        svc.proc.wait(30)
        with pytest.raises(LoaderError) as info:
            for _ in it:
                pass
    msg = info.value.message
    assert isinstance(info.value, LoaderTimeout)
    assert msg.startswith(f"the loader service at {svc.endpoint} announced it was shutting down "), msg
    assert "s ago (at " in msg and msg.endswith("and has not come back within 4s")
    assert "lost the connection" not in msg
