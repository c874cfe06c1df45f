"""The client side of CURVE on the data port: the keys a trainer holds, and the reading of
handshake failures from the replica's connection monitor.

A refused handshake is not a message: ZeroMQ closes the connection and retries forever, so
without this the loader would wait out its ``timeout``. The replica's monitor (read only by
:meth:`Replica.on_monitor`, one reader per monitor socket) passes every event to
:meth:`HandshakeWatch.check`, which raises a :class:`LoaderError` that says what to fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq

from wire.keys import CLIENT, HANDSHAKE_FAILED, SERVER, load_pair, load_public

from client.errors import LoaderError

ENV = "LOADER_CURVE_KEYS"
AUTH_FAILED = "auth_failed"  # LoaderError.code
EVENTS = HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED  # what the replica's monitor adds for this module
# The service closing the connection mid-handshake (no reason given) can be a restart as well as
# a wrong server key or a mechanism mismatch the service noticed first: only this many in a row,
# with no success between, count as a refusal.
NO_DETAIL_LIMIT = 3


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


class HandshakeWatch:
    """Turns a connection's handshake failures into a LoaderError."""

    def __init__(self, endpoint: str, keys: Optional[ClientKeys]):
        self.endpoint, self.keys = endpoint, keys
        self._no_detail = 0

    def check(self, event: int, value: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._no_detail = 0
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise LoaderError(AUTH_FAILED, f"authentication failed: the service at {self.endpoint} refused this "
                              f"client's CURVE key ({self.keys.directory if self.keys else '?'}/{CLIENT}.key is not in "
                              f"its keys directory; ZAP status {value})")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                if self.keys is None:
                    raise LoaderError(AUTH_FAILED, f"authentication failed: the service at {self.endpoint} requires "
                                      f"CURVE keys; pass curve_keys=DIR (client.key_secret + server.key) or set {ENV}")
                raise LoaderError(AUTH_FAILED, f"authentication failed: this client uses CURVE keys "
                                  f"({self.keys.directory}) but the service at {self.endpoint} does not "
                                  "(start it with --curve-keys, or drop curve_keys)")
            raise LoaderError(AUTH_FAILED, f"authentication failed: the handshake with {self.endpoint} broke the "
                              f"protocol (error {value:#x}); is that a loader service?")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # Also what a mechanism mismatch looks like when the service hangs up first.
            self._no_detail += 1
            if self._no_detail < NO_DETAIL_LIMIT:
                return
            if self.keys is None:
                raise LoaderError(AUTH_FAILED, f"authentication failed: the service at {self.endpoint} closed the "
                                  f"handshake {self._no_detail} times in a row: it probably requires CURVE keys; pass "
                                  f"curve_keys=DIR (client.key_secret + server.key) or set {ENV} (or that address is "
                                  "not a loader service's data port)")
            raise LoaderError(AUTH_FAILED, f"authentication failed: the service at {self.endpoint} closed the CURVE "
                              f"handshake {self._no_detail} times in a row: {self.keys.directory}/{SERVER}.key is not "
                              "that service's key, or it runs without --curve-keys")
