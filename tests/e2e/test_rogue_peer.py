"""A client pointed at a hostile ZeroMQ peer: the peer's oversized frames cost the client no
memory, and the client fails with an error that says what happened."""

import socket
import struct
import threading

import pytest

from client import LoaderError, LoaderTimeout, RemoteLoader

from tests.conftest import DEMO_SIZE

CLAIM = 1 << 30  # the rogue's frame: 1 GiB, streamed for real if the client takes it


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed")
        out += chunk
    return out


class RoguePeer:
    """Speaks ZMTP 3.0 (NULL mechanism) as a ROUTER over a raw socket, then sends each client one
    frame that claims :data:`CLAIM` bytes and streams zeros until the client hangs up.
    ``sent`` counts the frame bytes clients accepted; ``connections`` the connections served."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.sent, self.connections, self._stop = 0, 0, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(10)
                try:
                    self._one(conn)
                except OSError:  # the client cut us off: what it should do
                    pass

    def _one(self, conn: socket.socket) -> None:
        conn.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31)
        _recv_exact(conn, 64)  # the client's greeting
        prop = lambda k, v: bytes([len(k)]) + k + struct.pack(">I", len(v)) + v  # noqa: E731
        ready = b"\x05READY" + prop(b"Socket-Type", b"ROUTER")
        conn.sendall(b"\x04" + bytes([len(ready)]) + ready)
        flags = _recv_exact(conn, 1)[0]  # the client's READY command
        size = struct.unpack(">Q", _recv_exact(conn, 8))[0] if flags & 0x02 else _recv_exact(conn, 1)[0]
        _recv_exact(conn, size)
        conn.sendall(b"\x02" + struct.pack(">Q", CLAIM))  # a long message frame, no MORE flag
        zeros = bytes(1 << 20)
        while self.sent < CLAIM and not self._stop.is_set():
            conn.sendall(zeros)
            self.sent += len(zeros)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(30)
        self.listener.close()


@pytest.fixture
def rogue():
    peer = RoguePeer()
    yield peer
    peer.close()


def test_a_rogue_peer_s_huge_frame_costs_the_client_no_memory_and_a_clear_error(rogue):
    ld = RemoteLoader(f"tcp://127.0.0.1:{rogue.port}", batch_size=8, image_size=32, timeout=120)
    try:
        with pytest.raises(LoaderError, match=r"cut for breaking the protocol and is not retried: a peer that "
                                              r"sends a frame over this loader's cap of 1073152 bytes") as info:
            next(iter(ld))
    finally:
        ld.close()
    assert "is this endpoint a loader service?" in str(info.value)
    assert not isinstance(info.value, LoaderTimeout)  # raised once the cut was certain, not at the timeout
    assert rogue.connections == 1  # cut off for good, as soon as the frame's size arrived
    # what the client let in before cutting off: socket buffers, not the frame (cap: 1 MiB + 24 KiB images)
    assert rogue.sent < 32 << 20, rogue.sent


def test_a_rogue_replica_is_given_up_at_once_and_the_real_one_serves_the_epoch(rogue, make_service):
    """Replicas [a service, a rogue]: the rogue's connection is cut, its share of batches goes to
    the service at once (not after replica_timeout), and the epoch is exactly once."""
    svc = make_service()
    with RemoteLoader([svc.endpoint, f"tcp://127.0.0.1:{rogue.port}"], batch_size=8, image_size=32,
                      replica_timeout=600, timeout=120, epoch_lookahead=False) as ld:
        assert sorted(i for b in ld for i in b.indices) == list(range(DEMO_SIZE))
    assert rogue.sent < 32 << 20, rogue.sent
