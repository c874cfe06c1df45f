"""Hostile REST clients cost bounded descriptors, time, memory and log lines: slowloris,
connection floods, huge bodies, non-finite numbers."""

import socket
import threading

import httpx
import psutil
import pytest

from client import RemoteLoader
from loader_service.control.http_limits import RateLimitFilter
from testkit.service import ServiceProcess, free_port

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, wait_for
from testkit.hostile import half_open

TOKEN = {"Authorization": "Bearer secret"}


def closed_by_server(s: socket.socket) -> bytes:
    """Everything the server sent until it closed (the socket's timeout bounds the wait)."""
    out = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            return out
        out += chunk


@pytest.fixture
def svc(make_service):
    return make_service(api_token="secret", http_receipt_s=1.0, max_http_connections=4)


def test_a_request_that_does_not_arrive_whole_is_cut_at_the_receipt_deadline(svc):
    s = half_open(svc.http_port)
    try:
        # a byte at a time restarts uvicorn's keep-alive timer; the receipt deadline does not move
        s.settimeout(0.2)
        for _ in range(200):  # 40 s at most; the deadline is 1 s
            try:
                s.sendall(b"a")
                if s.recv(4096) == b"":
                    break
            except socket.timeout:
                continue
            except ConnectionError:
                break
        else:
            pytest.fail("the server kept a trickling request open")
    finally:
        s.close()
    assert svc.http_counters.timed_out == 1
    assert httpx.get(f"{svc.http_url}/healthz", timeout=10).status_code == 200  # a whole request is served


def test_connections_over_the_cap_get_503_and_the_port_serves_again_after_the_deadline(svc):
    held = [half_open(svc.http_port) for _ in range(4)]
    try:
        wait_for(lambda: len(_server_conns(svc.http_port)) >= 4, what="the server to accept 4 connections")
        over = half_open(svc.http_port)
        over.settimeout(10)
        answer = closed_by_server(over)
        over.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
        assert svc.http_counters.refused >= 1
        for s in held:  # each is closed at its receipt deadline
            s.settimeout(10)
            assert closed_by_server(s) == b""
        assert httpx.get(f"{svc.http_url}/healthz", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()


def _server_conns(port: int) -> list:
    return [c for c in psutil.Process().net_connections(kind="tcp")
            if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED]


def test_a_body_over_the_cap_is_refused_413_before_it_is_read(svc):
    s = socket.create_connection(("127.0.0.1", svc.http_port), timeout=10)
    try:  # claims 100 MB, sends none of it: the answer must not wait for the body
        s.sendall(b"PUT /v1/workers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer secret\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
        answer = closed_by_server(s)
    finally:
        s.close()
    assert answer.startswith(b"HTTP/1.1 413") and b"65536" in answer
    # chunked: no length to check first, so reading stops at the cap
    chunks = (b'{"count": 1' + b" " * 8192 for _ in range(20))
    r = httpx.put(f"{svc.http_url}/v1/workers", content=chunks, timeout=10,
                  headers={**TOKEN, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert httpx.put(f"{svc.http_url}/v1/workers", json={"count": 2}, headers=TOKEN, timeout=10).status_code == 200


def test_a_body_without_a_token_is_refused_401_before_any_size_check(svc):
    r = httpx.put(f"{svc.http_url}/v1/workers", content=b"x" * 100_000, timeout=10)
    assert r.status_code == 401


@pytest.mark.parametrize("raw", [b'{"count": 1e400}', b'{"count": -1e400}', b'{"count": NaN}',
                                 b'{"count": Infinity}', b'{"count": [NaN]}', b'{"count": {"a": 1e999}}'])
def test_non_finite_numbers_get_422_not_500(svc, raw):
    r = httpx.put(f"{svc.http_url}/v1/workers", content=raw, timeout=10,
                  headers={**TOKEN, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "count"]


def test_repeated_log_lines_are_rate_limited():
    import logging

    f, out = RateLimitFilter(interval_s=3600), []
    for i in range(1000):
        rec = logging.LogRecord("x", logging.WARNING, __file__, 1, "refusing %d", (i,), None)
        if f.filter(rec):
            out.append(rec)
    assert len(out) == 1


def test_slowloris_under_a_low_fd_limit_leaves_the_data_plane_serving(demo_source):
    """A service with 256 descriptors, flooded with 1,000 half-requests while a client streams
    an epoch: the epoch is exact, the REST port answers again once the flood stops, and the
    log stays small."""
    sp = ServiceProcess(free_port(), ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "2",
                                      "--max-http-connections", "32", "--http-receipt", "2"],
                        env=dict(LOADER_HEARTBEAT_S="0.5"), nofile=256)
    held, stop, errors = [], threading.Event(), []

    def flood() -> None:
        while not stop.is_set() and len(held) < 1000:
            try:
                held.append(half_open(sp.http_port, timeout=5))
            except OSError as exc:  # a refused or reset connect is the server coping, not a failure
                errors.append(exc)

    threads = [threading.Thread(target=flood) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(held) >= 300, timeout=60, what="the flood to hold 300 connections")
        with RemoteLoader(sp.endpoint, batch_size=16, image_size=24, seed=3, epoch_lookahead=False) as ld:
            batches = collect(ld)
        assert sorted(indices_of(batches)) == list(range(DEMO_SIZE))
        stop.set()
        for t in threads:
            t.join(60)
        # the flood sockets stay open, silent; the server cuts its share at the receipt deadline
        wait_for(lambda: _healthz(sp.url) == 200, timeout=30, what="/healthz to answer again")
        st = sp.status()
        assert sorted(st["workers"]["counts"].items()) == [("idle", 2)]
    finally:
        stop.set()
        for s in held:
            s.close()
        sp.proc.terminate()
        _, log = sp.proc.communicate(timeout=60)
        sp.stop()
    assert log.count("\n") < 40, log[-3000:]


def _healthz(url: str) -> int:
    try:
        return httpx.get(f"{url}/healthz", timeout=5).status_code
    except httpx.HTTPError:
        return 0
