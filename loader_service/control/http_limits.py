"""Bounds on what one REST connection or request may cost: descriptors, time, memory, log lines.

The REST server shares its process, and so its descriptor table, with the ZeroMQ data plane:
a flood of half-open connections must not starve the data plane of descriptors. uvicorn
leaves three gaps, closed here:

* **connections**: uvicorn accepts without limit (``limit_concurrency`` answers 503 only once
  a request's headers have arrived, so a slowloris still holds a descriptor each). Here a
  connection over ``max_connections`` is closed as soon as it is accepted, and the listen
  backlog equals the cap, so one accept burst cannot take more than that many descriptors.
* **receipt deadline**: uvicorn's keep-alive timer is cancelled on every byte received (the first
  line of its ``data_received``), so a client sending one byte a second holds its connection
  forever, and ASGI middleware runs only once the headers are in.
  Here each request must arrive whole, headers and body, within ``receipt_s`` of the
  connection opening or of the previous response; otherwise the connection is closed.
* **body size**: :class:`BodyLimit` answers 413 from ``Content-Length`` before reading, and
  stops reading a chunked body at the cap.

Repeated warnings (refused connections, deadlines, malformed requests, and the data port's
malformed client messages) are rate-limited (:class:`RateLimitFilter`), so a flood cannot grow
the log without bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from loader_service.log_budget import LineBudget

log = logging.getLogger("loader_service.http")

LOG_INTERVAL_S = 10.0  # at most one line per kind of repeated event in this many seconds
_BODY = b'{"detail":"too many connections to the REST port; try again"}'
TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class RateLimitFilter(logging.Filter):
    """Lets the first record with a given message template through per ``interval_s``; the
    next one that passes says how many were left out in between (a :class:`LineBudget` of one
    line per kind, the kind being the logger and the template)."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        super().__init__()
        self.interval_s = interval_s
        self._budget = LineBudget(1, interval_s)
        self._lock = threading.Lock()  # records come from the REST thread and the dispatcher's

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            note = self._budget.take((record.name, str(record.msg)), time.monotonic())
        if note is None:
            return False
        if note:
            record.msg = f"{record.msg}{note}"
        return True


FD_RESERVE = 256  # descriptors kept for the data plane, workers and files beyond the REST cap


def limit_logs() -> None:
    """Rate-limit the loggers a connection or message flood writes to (idempotent)."""
    from loader_service.dispatch.state import refused_log  # the data port's, named where it is used

    for logger in (logging.getLogger("uvicorn.error"), logging.getLogger("asyncio"), log, refused_log):
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter())


def raise_fd_limit(max_connections: int) -> int:
    """Raise this process's soft descriptor limit to the hard one; warn when it leaves fewer
    than :data:`FD_RESERVE` beyond the REST cap (twice over: an accept burst). Returns it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    if soft != resource.RLIM_INFINITY and soft < 2 * max_connections + FD_RESERVE:
        log.warning("the descriptor limit (%d) leaves little beyond %d REST connections; lower "
                    "max_http_connections or raise the limit (ulimit -n)", soft, max_connections)
    return soft


REFUSED_GRACE_S = 0.25  # a refused connection is closed this long after its 503 (see connection_made)


class Counters:
    """What the guards refused, for ``/v1/status`` and the tests (written on the server's loop)."""

    def __init__(self) -> None:
        self.refused = 0  # connections closed at accept: over the cap
        self.timed_out = 0  # connections closed at the receipt deadline


def guarded_protocol(max_connections: int, receipt_s: float, counters: Counters) -> type:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` with the connection cap and the
    receipt deadline of this module's docstring."""
    lingering = 0  # refused connections waiting out REFUSED_GRACE_S: at most max_connections

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self._receipt = None
            if len(self.connections) >= max_connections:
                self.conn = None  # marks this protocol as refused: it never joins the server's state
                counters.refused += 1
                log.warning("REST: refusing connections over the cap of %d (max_http_connections)", max_connections)
                # Answer, half-close, and close for good a moment later: closing a socket whose
                # request bytes are still unread sends RST, and the client's kernel may then drop
                # the 503 before the client reads it. At most max_connections wait out the grace:
                # past that a flood's connections are closed at once, so the REST port never holds
                # more than twice its cap of descriptors (the data plane needs the rest).
                transport.write(TOO_MANY)
                if lingering >= max_connections:
                    transport.close()
                    return
                if transport.can_write_eof():
                    transport.write_eof()
                self._linger(1)
                self._receipt = asyncio.get_event_loop().call_later(REFUSED_GRACE_S, self._close_refused, transport)
                return
            super().connection_made(transport)
            self._arm()

        @staticmethod
        def _linger(n: int) -> None:
            nonlocal lingering
            lingering += n

        def _close_refused(self, transport) -> None:
            self._receipt = None
            self._linger(-1)
            transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._receipt = self.loop.call_later(receipt_s, self._receipt_expired)

        def _disarm(self) -> None:
            if self._receipt is not None:
                self._receipt.cancel()
                self._receipt = None

        def _receipt_expired(self) -> None:
            self._receipt = None
            if self.transport is not None and not self.transport.is_closing():
                counters.timed_out += 1
                log.warning("REST: closing connections that did not send a whole request within %.0fs "
                            "(http_receipt_s)", receipt_s)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.conn is None:  # refused at accept
                return
            super().data_received(data)
            if self.conn.their_state is not h11.SEND_BODY and self.conn.their_state is not h11.IDLE:
                self._disarm()  # the request is in (DONE), or the connection is ending

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this keep-alive connection gets a fresh deadline

        def connection_lost(self, exc) -> None:
            if self.conn is None and self._receipt is not None:
                self._linger(-1)  # a refused connection the client closed during the grace
            self._disarm()
            if self.conn is not None:
                super().connection_lost(exc)

    return GuardedH11Protocol


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 without being read
    past the cap. The body is read here (at most the cap) and replayed to the app."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                      receive), send)

    async def _too_large(self, scope, receive, send):
        from fastapi.responses import JSONResponse

        response = JSONResponse({"detail": f"request body over {self.max_bytes} bytes (max_http_body_bytes)"},
                                status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)


def _replay(messages, then=None):
    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()  # after the body: the disconnect, when it comes
        return {"type": "http.disconnect"}

    return receive
