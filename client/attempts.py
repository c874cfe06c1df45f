"""What the tries to reach one service met before a ZeroMQ handshake completed, and what to do next.

A pure state machine (events in, an action out; the clock is passed in), read by
:class:`~client.replica.Replica`, which does the I/O. A try that ends before its handshake is
not the service's answer: an L4 proxy without a backend (HAProxy, Envoy, a Kubernetes Service
while no pod is up) accepts and closes; a stranger briefly on the port answers garbage or
nothing; a service starting or stopping drops a handshake. Each is retried with backoff until
the loader's ``timeout``, whose message then says what the tries met (:meth:`Attempts.summary`).

Only the service's own handshake makes a refusal final. The mechanism in a ZMTP greeting
(CURVE or NULL) that differs from ours is read by libzmq (a ``HANDSHAKE_FAILED_PROTOCOL``
event, handled by :class:`~client.curve.HandshakeWatch`); a CURVE client whose server key is
wrong sees only closes, like a proxy's, so after :data:`PROBE_AFTER` closes in a row the
replica reads the endpoint's greeting itself (:func:`~client.curve.greeting_mechanism`): a
CURVE greeting, then one more close, is a refusal of this client's keys. A client without keys
probes the same way: a busy CURVE service may close its handshake before libzmq has read the
mechanism in its greeting (no mismatch event, only a close), and a CURVE greeting read by the
probe is that service's own answer that it requires keys.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Dict, Optional, Union

# How a try ended before its handshake (the counts' keys), in the words of the timeout message.
CLOSED = "closed"  # accepted, then closed (a proxy without a backend, a service starting or stopping)
SILENT = "silent"  # accepted, then no handshake within its deadline (a stranger that says nothing, or not ZMTP)
STRANGER = "stranger"  # answered with bytes that are not ZMTP (libzmq cuts it and never retries it)
BROKEN = "broken"  # a ZMTP peer that broke the handshake (not a mechanism mismatch: that is final)
WHAT = {
    CLOSED: "accepted and closed",
    SILENT: "accepted with no ZeroMQ handshake within its deadline",
    STRANGER: "answered with something that is not ZeroMQ",
    BROKEN: "answered with a broken ZeroMQ handshake",
}

PROBE_AFTER = 3  # closes in a row after which a CURVE client reads the endpoint's greeting
BASE_S = 0.1  # the first retry's delay; doubles per failed try in a row ...
MAX_S = 2.0  # ... up to this (libzmq's reconnect interval and its cap, client/replica.py)


@dataclass(frozen=True)
class Retry:
    """Drop this try (libzmq would retry at once, or never) and connect again at ``at``."""
    at: float


@dataclass(frozen=True)
class Probe:
    """Read the endpoint's ZMTP greeting, then report it with :meth:`Attempts.probed`."""


@dataclass(frozen=True)
class Refuse:
    """The service's own handshake refused this client: final (``auth_failed``)."""
    message: str


Action = Union[Retry, Probe, Refuse]


class Attempts:
    """The tries to reach ``endpoint`` since its last completed handshake. ``keys``: the
    directory of this client's CURVE keys, or None for a plain client."""

    def __init__(self, endpoint: str, keys: Optional[str]):
        self.endpoint, self.keys = endpoint, keys
        self.counts: Dict[str, int] = {}
        self.streak = 0  # tries in a row that ended before their handshake
        self.curve_seen = False  # a probe read a CURVE greeting since the last try ended
        self._failure: Optional[int] = None  # errno of this try's handshake failure (-1: a protocol error)
        self._handshaked = False

    # ------------------------------------------------------------------ libzmq's events, in order
    def connected(self) -> None:
        """A TCP connection is up: a new try begins."""
        self._failure, self._handshaked = None, False

    def failed(self, value: int, protocol: bool = False) -> None:
        """This try's handshake failed: ``value`` is libzmq's errno (no detail), or a ZMTP
        protocol error code when ``protocol``."""
        self._failure = -1 if protocol else value

    def succeeded(self) -> None:
        """The handshake completed: a service answered; what came before is forgotten."""
        self.counts, self.streak, self.curve_seen, self._handshaked = {}, 0, False, True

    def disconnected(self, now: float) -> Optional[Action]:
        """The connection ended: None if its handshake had completed (a lost connection is the
        loader's business), else what to do next."""
        if self._handshaked:
            self._handshaked = False
            return None
        kind = (STRANGER if self._failure is None else BROKEN if self._failure < 0
                else SILENT if self._failure == errno.EAGAIN else CLOSED)
        self._failure = None
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.streak += 1
        if kind == CLOSED:
            if self.curve_seen and self.keys is not None:
                return Refuse(f"authentication failed: the service at {self.endpoint} speaks CURVE (its greeting "
                              f"says so) and closed this client's CURVE handshake {self.streak} times in a row: "
                              f"{self.keys}/server.key is not that service's key")
            if self.streak >= PROBE_AFTER:
                return Probe()
        self.curve_seen = False
        return Retry(now + self.backoff())

    def probed(self, mechanism: Optional[str], now: float) -> Action:
        """What a probe read: the mechanism of the endpoint's greeting, or None (closed,
        silent, not ZMTP)."""
        if mechanism == "CURVE":
            if self.keys is None:
                return Refuse(f"authentication failed: the service at {self.endpoint} requires CURVE keys (its "
                              "greeting says CURVE); pass curve_keys=DIR (client.key_secret + server.key) or set "
                              "LOADER_CURVE_KEYS")
            self.curve_seen = True  # a CURVE service is there now: one more close of ours is a refusal
            return Retry(now)
        if mechanism is not None and self.keys is not None:
            return Refuse(f"authentication failed: this client uses CURVE keys ({self.keys}) but the service at "
                          f"{self.endpoint} does not (its greeting says {mechanism}; start it with --curve-keys, "
                          "or drop curve_keys)")
        return Retry(now + self.backoff())

    # ------------------------------------------------------------------ reading
    def backoff(self) -> float:
        """The delay before the next try: doubles per failed try in a row, capped."""
        return min(MAX_S, BASE_S * 2 ** max(0, self.streak - 1))

    def summary(self) -> str:
        """What the tries since the last handshake met, in words ('' if nothing)."""
        said = [f"{WHAT[k]} {n} time{'s' if n > 1 else ''}" for k, n in sorted(self.counts.items())]
        return f"connections to {self.endpoint} were " + ", ".join(said) if said else ""
