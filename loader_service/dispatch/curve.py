"""ZeroMQ CURVE on the data port: the service's ROUTER and its handshake watch (key files: :mod:`wire.keys`).

The service checks each client key with a ZAP
handler (``zmq.auth.ThreadAuthenticator``) that reads the directory again when it changes, so
a client key added counts from the next handshake on, with no restart. A key removed also ends
the streams of connections already open with it: the dispatcher checks the key behind every
Hello and Request (:meth:`DataPortGuard.authorized`: a stat of the directory, and a read
of it when that changed or once a second), so a revoked client gets nothing past its next
message, which a streaming client sends with every batch it takes (docs/security.md).

A refused handshake never reaches the dispatcher as a message: ZeroMQ reports it on the
socket monitor. The dispatcher owns that monitor (one reader per monitor socket) and hands
the handshake events to :class:`DataPortGuard`, which counts them (``/metrics``) and logs them
at most once a minute.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Dict, Optional

import zmq
import zmq.auth

from wire.keys import HANDSHAKE_FAILED, SERVER, load_pair, load_public

log = logging.getLogger("loader_service.dispatch.curve")

RECHECK_S = 1.0  # a connected client's key is read again from its file at least this often
LOG_EVERY_S = 60.0  # refused handshakes: one log line per this interval at most (an open port attracts many)


class ClientKeyDirectory:
    """The ZAP credentials provider: a client key is authorized while a ``*.key`` file other
    than ``server.key`` in the directory holds it. The directory is read again when a file in
    it changes (checked per handshake: a stat of a few files)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._lock = threading.Lock()
        self._stamp: Optional[tuple] = None
        self._keys: Dict[bytes, str] = {}
        self.last_denied = b""  # the z85 key of the latest refused client, for the log line
        self._dir_stamp: Optional[int] = None  # the directory's mtime at the last read
        self._read_at = 0.0
        self.reload()

    def holds(self, key: bytes, now: float) -> bool:
        """Whether ``key`` (z85) is authorized now: the directory is read again if its mtime
        changed (a file added, removed or renamed; a Secret's ..data swapped) or every
        ``RECHECK_S`` (a file edited in place); an unreadable directory authorizes nobody."""
        try:
            stamp = os.stat(self.directory).st_mtime_ns
            if stamp != self._dir_stamp or now - self._read_at >= RECHECK_S:
                self.reload()
        except OSError:
            return False
        return key in self._keys

    def _listing(self) -> tuple:
        entries = []
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.endswith(".key") and e.name != f"{SERVER}.key":
                    st = e.stat()  # follows links: a Kubernetes Secret volume is links to ..data/
                    entries.append((e.name, st.st_mtime_ns, st.st_size))
        return tuple(sorted(entries))

    def reload(self) -> int:
        self._dir_stamp, self._read_at = os.stat(self.directory).st_mtime_ns, time.monotonic()
        stamp = self._listing()
        with self._lock:
            if stamp != self._stamp:
                keys = {}
                for name, _, _ in stamp:
                    try:
                        keys[load_public(self.directory / name)] = name
                    except (ValueError, OSError) as exc:
                        log.error("ignoring client key %s: %s", name, exc)
                self._keys, self._stamp = keys, stamp
                log.info("%d authorized client keys in %s", len(keys), self.directory)
            return len(self._keys)

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            self.reload()
        except OSError as exc:  # the directory went away: refuse, loudly, keep serving
            log.error("cannot read the keys directory %s: %s", self.directory, exc)
            return False
        ok = key in self._keys
        if not ok:
            self.last_denied = key
        return ok


# ---------------------------------------------------------------------------- the service side
REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "a client without CURVE keys (plain ZMTP)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "a client whose server.key is not this service's (cannot decrypt)",
}


class RefusalLog:
    """Logs the first refused handshake at once, then at most one summary per ``every_s``."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self._last: Optional[float] = None
        self._held: Counter = Counter()

    def add(self, reason: str, where: str) -> Optional[str]:
        """Record one refusal; returns the line to log now, or None (held for the next line)."""
        self._held[reason] += 1
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            return None
        held, self._held = self._held, Counter()
        n = sum(held.values())
        since = "" if self._last is None else f" in the last {now - self._last:.0f}s"
        self._last = now
        what = "; ".join(f"{k} x{v}" for k, v in held.most_common())
        return (f"refused {n} handshake{'s' if n > 1 else ''} on {where}{since}: {what} "
                f"(counted in loader_refused_handshakes; at most one such line per {self.every_s:.0f}s)")


class DataPortGuard:
    """What secures the data port: the ZAP authenticator (client keys with CURVE; refused peer
    addresses in any case) and the count of refused handshakes. Lives on the dispatcher thread;
    :meth:`close` before the context's ``term``."""

    def __init__(self, ctx: zmq.Context, auth=None, clients: Optional[ClientKeyDirectory] = None):
        self.ctx, self.auth, self.clients = ctx, auth, clients
        self._log = RefusalLog()

    @property
    def curve(self) -> bool:
        return self.clients is not None

    def deny(self, address: str) -> None:
        """Refuse new connections from ``address`` at the handshake, from now on (the
        authenticator's thread reads the set; adding to it is atomic). Without CURVE the
        authenticator starts with the first address refused: until then no handshake waits for
        a ZAP answer (one for each of a flood's 10,000 connections starved every other handshake,
        docs/benchmarks.md section 18), and libzmq admits every peer when no ZAP handler is bound."""
        if self.auth is None:
            self.auth = _authenticator(self.ctx)
        self.auth.deny(address)

    def authorized(self, user_id: str, now: float) -> bool:
        """Whether the client whose messages carry ZAP ``user_id`` (its z85 public key) may still
        be served; always True without CURVE."""
        return self.clients is None or self.clients.holds(user_id.encode(), now)

    def on_event(self, ev: dict) -> bool:
        """A monitor event the dispatcher does not handle itself; True if it is a refused
        handshake (logged here, counted by the dispatcher)."""
        if not ev["event"] & HANDSHAKE_FAILED:
            return False
        if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            key = self.clients.last_denied.decode(errors="replace") if self.clients else ""
            detail = f"unknown client key {key[:8]}..." if key else "unknown client key"
        else:
            detail = REASONS.get(ev["value"], "")
        if not detail and ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            detail = f"the client left during the handshake ({os.strerror(ev['value'])})"
        elif not detail:
            detail = f"handshake failed ({_name(ev['event'])}, value {ev['value']:#x})"
        line = self._log.add(detail, (ev.get("endpoint") or b"").decode(errors="replace"))
        if line:
            log.warning("%s", line)
        return True

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()  # its ZAP socket lives in the context: stop it before term()
            self.auth = None


def secure_router(ctx: zmq.Context, sock: zmq.Socket, keys_dir: str) -> DataPortGuard:
    """Make ``sock`` (not bound yet) a CURVE server that admits the client keys in
    ``keys_dir``; with no ``keys_dir``, plain ZMTP (handshake failures still counted). The
    addresses :meth:`DataPortGuard.deny` names are refused either way."""
    if not keys_dir:
        # The ZAP domain makes libzmq refuse peers that speak ZMTP 1.0 or 2.0 (zmtp_engine.cpp), as
        # CURVE does: their messages carry no metadata, so no fd (SRCFD) to tie them to a
        # connection, and five bytes of such a handshake used to stop the loop. It asks the ZAP
        # handler once one runs (DataPortGuard.deny); none does until an address is refused. With
        # CURVE it stays unset: the key check answers domain "*" only.
        sock.setsockopt(zmq.ZAP_DOMAIN, b"loader-data")
        return DataPortGuard(ctx)
    directory = Path(keys_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"--curve-keys {keys_dir}: no such directory (make one with: loader-service keys DIR)")
    public, secret = load_pair(directory / f"{SERVER}.key_secret")  # raises before anything starts
    clients = ClientKeyDirectory(directory)
    if not clients._keys:
        log.warning("no client key in %s: every client is refused until one is added (loader-service keys %s "
                    "--client NAME)", directory, directory)
    auth = _authenticator(ctx)
    auth.configure_curve_callback(domain="*", credentials_provider=clients)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    log.info("data port: CURVE on, client keys from %s", directory)
    return DataPortGuard(ctx, auth, clients)


def _authenticator(ctx: zmq.Context):
    """pyzmq's ZAP handler, started: it admits NULL peers whose address is not denied, and CURVE
    peers its credentials provider admits."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("loader_service.zap"))
    auth.start()
    return auth


def _name(event: int) -> str:
    try:
        return zmq.Event(event).name
    except ValueError:
        return str(event)
