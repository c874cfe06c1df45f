"""The client side of CURVE on the data port: the keys a trainer holds, and the reading of
handshake failures from the replica's connection monitor.

A refused handshake is not a message: ZeroMQ closes the connection and retries forever, so
without this the loader would wait out its ``timeout``. The replica's monitor (read only by
:meth:`Replica.on_monitor`, one reader per monitor socket) passes every event to
:meth:`HandshakeWatch.check`, which raises a :class:`LoaderError` that says what to fix when
the service's handshake says so: its ZAP handler refused our key, or its greeting names
another mechanism. A mere close says nothing of keys (a proxy without a backend closes too):
:mod:`client.attempts` retries it, and reads the endpoint's greeting with
:func:`greeting_mechanism` before it calls a CURVE client's closes a refusal.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq

from wire.keys import CLIENT, HANDSHAKE_FAILED, SERVER, load_pair, load_public

from client.errors import LoaderError

ENV = "LOADER_CURVE_KEYS"
AUTH_FAILED = "auth_failed"  # LoaderError.code
EVENTS = HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED  # what the replica's monitor adds for this module
SIGNATURE = b"\xff" + b"\0" * 8 + b"\x7f"  # ZMTP 3's greeting begins so (rfc.zeromq.org/spec/23)
PROBE_S = 0.5  # a greeting probe's deadline: a service answers in a round trip


@dataclass(frozen=True)
class ClientKeys:
    directory: str
    public: bytes
    secret: bytes
    server: bytes


def client_keys(directory: Optional[str]) -> Optional[ClientKeys]:
    """The keys in ``directory`` (``client.key_secret`` and ``server.key``), or None for a
    plain connection. Raises LoaderError naming the missing or unreadable file."""
    if not directory:
        return None
    d = Path(directory)
    try:
        public, secret = load_pair(d / f"{CLIENT}.key_secret")
        server = load_public(d / f"{SERVER}.key")
    except (OSError, ValueError) as exc:
        raise LoaderError(AUTH_FAILED, f"curve_keys={directory!r}: {exc}") from None
    return ClientKeys(str(d), public, secret, server)


def default_keys_dir() -> str:
    return os.environ.get(ENV, "")


def secure_dealer(sock: zmq.Socket, keys: Optional[ClientKeys]) -> None:
    """Give ``sock`` (not connected yet) this loader's CURVE ``keys``, in ZeroMQ's CURVE client
    role; nothing for None."""
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.server


def parse_greeting(data: bytes) -> Optional[str]:
    """The security mechanism a ZMTP 3 greeting names (``data``: its first 32 bytes or what
    came of them), or None if ``data`` is not one."""
    if len(data) < 32 or data[0] != 0xFF or not data[9] & 1 or data[10] < 3:
        return None
    name = data[12:32].rstrip(b"\0")
    return name.decode("ascii") if name.isalnum() and name.isascii() else None


def greeting_mechanism(endpoint: str, timeout_s: float = PROBE_S) -> Optional[str]:
    """Connect to ``endpoint`` (tcp or ipc) over a plain socket and read the mechanism of its
    ZMTP greeting (a ZeroMQ peer names it once it has our signature and major version); None
    if it closes, says nothing within ``timeout_s``, or says something else. The peer sees a
    handshake dropped, as from any client that gives up."""
    kind, _, rest = endpoint.partition("://")
    try:
        if kind == "tcp":
            host, _, port = rest.rpartition(":")
            sock = socket.create_connection((host.split(";")[-1].strip("[]"), int(port)), timeout=timeout_s)
        elif kind == "ipc":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            sock.connect(rest)
        else:
            return None
    except (OSError, ValueError):
        return None
    deadline, data = time.monotonic() + timeout_s, b""
    try:
        sock.sendall(SIGNATURE + b"\x03")
        while len(data) < 32 and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(32 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    finally:
        sock.close()
    return parse_greeting(data)


class HandshakeWatch:
    """Turns the handshake failures that are the service's own refusal into a LoaderError
    (any other failure is :mod:`client.attempts`' business)."""

    def __init__(self, endpoint: str, keys: Optional[ClientKeys]):
        self.endpoint, self.keys = endpoint, keys

    def check(self, event: int, value: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            # the service's ZAP handler refuses an unknown key, and (with or without keys) an address
            # many of whose connections it could not close (loader_service/dispatch/silence.py)
            if self.keys is None:
                raise LoaderError(AUTH_FAILED, f"the service at {self.endpoint} refused this client's address at the "
                                  f"handshake (ZAP status {value}): it refuses an address that left it many "
                                  "connections it cannot close (its log says which; a restart clears it)")
            raise LoaderError(AUTH_FAILED, f"authentication failed: the service at {self.endpoint} refused this "
                              f"client's CURVE key ({self.keys.directory}/{CLIENT}.key is not in its keys directory), "
                              f"or its address (ZAP status {value})")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.keys is None:
                raise LoaderError(AUTH_FAILED, f"authentication failed: the service at {self.endpoint} requires "
                                  f"CURVE keys; pass curve_keys=DIR (client.key_secret + server.key) or set {ENV}")
            raise LoaderError(AUTH_FAILED, f"authentication failed: this client uses CURVE keys "
                              f"({self.keys.directory}) but the service at {self.endpoint} does not "
                              "(start it with --curve-keys, or drop curve_keys)")
