"""CURVE on the data port: keys made by the CLI, who gets in, who is refused and how."""

from __future__ import annotations

import os
import shutil
import stat

import httpx
import pytest
import zmq
import zmq.auth

from client import RemoteLoader
from client.errors import LoaderError, LoaderTimeout
from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.cli.main import main as cli
from loader_service.dispatch.curve import RefusalLog
from wire.keys import make_keys

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, status, wait_for

FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keys_command_modes_and_force(tmp_path, capsys):
    d = tmp_path / "keys"
    assert cli(["keys", str(d)]) == 0
    assert sorted(os.listdir(d)) == sorted(FILES)
    assert mode(d) == 0o700
    assert [mode(d / f) for f in FILES] == [0o644, 0o600, 0o644, 0o600]
    before = {f: (d / f).read_bytes() for f in FILES}
    capsys.readouterr()
    assert cli(["keys", str(d)]) == 1
    err = capsys.readouterr().err
    assert "refusing to overwrite" in err and "use --force" in err
    assert {f: (d / f).read_bytes() for f in FILES} == before  # untouched
    assert cli(["keys", str(d), "--force"]) == 0
    after = {f: (d / f).read_bytes() for f in FILES}
    assert all(after[f] != before[f] for f in FILES)
    assert [mode(d / f) for f in FILES] == [0o644, 0o600, 0o644, 0o600]
    # one more client: only its files are written; the same name again needs --force
    assert cli(["keys", str(d), "--client", "trainer-b"]) == 0
    assert sorted(os.listdir(d)) == sorted(FILES + ("trainer-b.key", "trainer-b.key_secret"))
    assert {f: (d / f).read_bytes() for f in FILES} == after
    assert mode(d / "trainer-b.key_secret") == 0o600
    assert cli(["keys", str(d), "--client", "trainer-b"]) == 1
    assert cli(["keys", str(d), "--client", "../evil"]) == 1
    assert not [n for n in os.listdir(d) if n.startswith(".keys-")]  # no temporary left behind
    # --if-missing (the compose one-shot): keeps complete keys, makes absent ones, refuses a partial set
    kept = {f: (d / f).read_bytes() for f in FILES}
    assert cli(["keys", str(d), "--if-missing"]) == 0 and {f: (d / f).read_bytes() for f in FILES} == kept
    assert cli(["keys", str(tmp_path / "fresh"), "--if-missing"]) == 0
    assert sorted(os.listdir(tmp_path / "fresh")) == sorted(FILES)
    os.unlink(tmp_path / "fresh" / "client.key")
    assert cli(["keys", str(tmp_path / "fresh"), "--if-missing"]) == 1


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    assert cli(["keys", str(d)]) == 0
    return str(d)


@pytest.fixture
def curve_service(make_service, keys):
    return make_service(curve_keys=keys)


def refused(svc) -> int:
    return status(svc)["totals"]["refused_handshakes"]


def auth_error(fn) -> LoaderError:
    """The error ``fn`` raises: a LoaderError from the handshake, not from the loader's timeout."""
    with pytest.raises(LoaderError) as info:
        fn()
    assert not isinstance(info.value, LoaderTimeout), info.value
    assert info.value.code == "auth_failed"
    return info.value


def test_authorized_client_gets_every_sample_once(curve_service, keys):
    assert status(curve_service)["data_port_curve"] is True
    with RemoteLoader(curve_service.endpoint, batch_size=32, curve_keys=keys, seed=3) as ld:
        batches = collect(ld)
    assert sorted(indices_of(batches)) == list(range(DEMO_SIZE))
    assert refused(curve_service) == 0


def test_keys_from_the_environment(curve_service, keys, monkeypatch):
    monkeypatch.setenv("LOADER_CURVE_KEYS", keys)
    with RemoteLoader(curve_service.endpoint, batch_size=64) as ld:
        assert sorted(indices_of(collect(ld))) == list(range(DEMO_SIZE))


def test_client_without_keys_is_refused_with_a_clear_error(curve_service, monkeypatch):
    monkeypatch.delenv("LOADER_CURVE_KEYS", raising=False)
    # timeout is long: the error must come from the handshake, not from waiting
    with RemoteLoader(curve_service.endpoint, batch_size=32, timeout=60) as ld:
        err = auth_error(lambda: len(ld))
    assert "authentication failed" in str(err) and "requires CURVE keys" in str(err) and "curve_keys=DIR" in str(err)
    wait_for(lambda: refused(curve_service) >= 1, what="the refusal counted")


def test_unknown_client_key_is_refused(curve_service, keys, tmp_path):
    other = tmp_path / "other"
    make_keys(str(other), ("client",))
    shutil.copy(os.path.join(keys, "server.key"), other / "server.key")  # knows the service, is not known
    with RemoteLoader(curve_service.endpoint, batch_size=32, curve_keys=str(other), timeout=60) as ld:
        err = auth_error(lambda: len(ld))
    assert "refused this client's CURVE key" in str(err)
    wait_for(lambda: refused(curve_service) >= 1, what="the refusal counted")
    # /metrics carries the count
    text = httpx.get(f"{curve_service.http_url}/metrics", timeout=10).text
    assert any(line.startswith("loader_refused_handshakes_total ") and float(line.split()[1]) >= 1
               for line in text.splitlines())
    # adding its public key to the service's directory admits it from the next handshake, no restart
    shutil.copy(other / "client.key", os.path.join(keys, "trainer-b.key"))
    with RemoteLoader(curve_service.endpoint, batch_size=32, curve_keys=str(other)) as ld:
        assert sorted(indices_of(collect(ld))) == list(range(DEMO_SIZE))


def test_foreign_keys_are_refused(curve_service, tmp_path):
    other = tmp_path / "other"
    assert cli(["keys", str(other)]) == 0  # another deployment's keys: wrong server key, unknown client
    with RemoteLoader(curve_service.endpoint, batch_size=32, curve_keys=str(other), timeout=60) as ld:
        err = auth_error(lambda: len(ld))
    assert "server.key is not that service's key" in str(err)


def test_keys_against_a_plain_service(service, keys):
    with RemoteLoader(service.endpoint, batch_size=32, curve_keys=keys, timeout=60) as ld:
        err = auth_error(lambda: len(ld))
    assert "the service at" in str(err) and "--curve-keys" in str(err)


def test_missing_key_files_named(tmp_path):
    with pytest.raises(LoaderError, match=r"client\.key_secret not found"):
        RemoteLoader("tcp://127.0.0.1:9", batch_size=8, curve_keys=str(tmp_path))


def test_service_refuses_to_start_without_its_secret(make_service, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"server\.key_secret not found"):
        make_service(curve_keys=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        make_service(curve_keys=str(tmp_path / "nope"))


def raw_dealer(ctx, endpoint, keys_dir=None):
    """The outsider's 20-line script: a DEALER that asks for the datasets and a stream."""
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    if keys_dir is not None:
        pub, sec = zmq.auth.load_certificate(os.path.join(keys_dir, "client.key_secret"))
        s.curve_publickey, s.curve_secretkey = pub, sec
        s.curve_serverkey, _ = zmq.auth.load_certificate(os.path.join(keys_dir, "server.key"))
    s.connect(endpoint)
    s.send_multipart(P.encode(P.Describe(dataset="nope")))
    s.send_multipart(P.encode(P.Hello(stream=1, spec=JobSpec(batch_size=8, image_size=32, seed=0, world_size=1),
                                      epoch=0, rank=0, batches=[0])))
    return s


def test_raw_sockets_get_nothing(curve_service, tmp_path):
    other = tmp_path / "other"
    assert cli(["keys", str(other)]) == 0
    ctx = zmq.Context()
    socks = []
    try:
        socks = [raw_dealer(ctx, curve_service.endpoint), raw_dealer(ctx, curve_service.endpoint, str(other))]
        # both have been refused (and retried) by the time the count shows them: nothing came back
        wait_for(lambda: refused(curve_service) >= 4, what="the raw sockets' handshakes refused")
        assert [s.poll(0) for s in socks] == [0, 0]
    finally:
        for s in socks:
            s.close()
        ctx.term()
    assert status(curve_service)["clients"] == []


def test_service_keeps_serving_while_refused_clients_retry(curve_service, keys, tmp_path):
    other = tmp_path / "other"
    assert cli(["keys", str(other)]) == 0
    ctx = zmq.Context()
    intruders = []
    try:
        with RemoteLoader(curve_service.endpoint, batch_size=16, curve_keys=keys, prefetch=2) as ld:
            it = iter(ld)
            first = next(it)
            # refused clients reconnect by themselves (ZeroMQ retries): let a few rounds happen mid-epoch
            intruders = [raw_dealer(ctx, curve_service.endpoint), raw_dealer(ctx, curve_service.endpoint, str(other))]
            base = refused(curve_service)
            wait_for(lambda: refused(curve_service) >= base + 6, what="refused clients retrying")
            with RemoteLoader(curve_service.endpoint, batch_size=16, curve_keys="", timeout=60) as bad:
                auth_error(lambda: len(bad))
            rest = [b.indices for b in it]
            assert sorted(list(first.indices) + [i for r in rest for i in r]) == list(range(DEMO_SIZE))
            assert [s.poll(0) for s in intruders] == [0, 0]
    finally:
        for s in intruders:
            s.close()
        ctx.term()


def test_refusal_log_is_rate_limited():
    now = [100.0]
    log = RefusalLog(every_s=60, clock=lambda: now[0])
    first = log.add("unknown client key", "tcp://x")
    assert first is not None and first.startswith("refused 1 handshake on tcp://x: unknown client key x1")
    assert [log.add("a client without CURVE keys", "tcp://x") for _ in range(5)] == [None] * 5
    now[0] += 61
    line = log.add("unknown client key", "tcp://x")
    assert line is not None and line.startswith("refused 6 handshakes on tcp://x in the last 61s: ")
    assert "a client without CURVE keys x5" in line and "unknown client key x1" in line


def test_a_revoked_key_stops_the_stream_at_the_clients_next_message(curve_service, keys):
    """Issue 32 item 7: removing a client's key ends its stream within its next Request (one
    batch taken), not at its next handshake; batches already sent (at most prefetch) may arrive."""
    prefetch = 2
    got_after = 0
    with RemoteLoader(curve_service.endpoint, batch_size=4, curve_keys=keys, prefetch=prefetch,
                      epoch_lookahead=False, timeout=60) as ld:
        it = iter(ld)
        for _ in range(3):
            next(it)
        os.unlink(os.path.join(keys, "client.key"))  # revoked
        with pytest.raises(LoaderError) as info:
            for _ in it:
                got_after += 1
    assert info.value.code == P.ErrorCode.REVOKED, info.value
    assert "no longer authorized" in str(info.value)
    assert got_after <= prefetch  # only what was already on its way (240 / 4 = 60 batches in the epoch)
    assert status(curve_service)["totals"]["revoked"] == 1
    wait_for(lambda: status(curve_service)["connections"]["sessions"] == 0, what="the revoked session dropped")
