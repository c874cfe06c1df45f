"""One connection to one service replica: its socket, its connection state, its stream.

A try that ends before its ZeroMQ handshake (a proxy without a backend, a stranger on the
port) is retried here, with backoff, by :mod:`client.attempts`' rules: the socket drops that
try (libzmq would retry at once, or, after a peer that is not ZeroMQ, never) and connects
again when :meth:`Replica.tick` finds the retry due.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from wire import protocol as P

from client.attempts import Attempts, Probe, Refuse
from client.curve import AUTH_FAILED, EVENTS as HANDSHAKE_EVENTS, ClientKeys, HandshakeWatch, greeting_mechanism, \
    secure_dealer
from client.errors import LoaderError
from client.lanes import Lanes
from client.local import Borrowed


MAX_LANES_LOST = 3  # bulk lane sets of one connection that may fail before it goes on without
CUT_GRACE_S = 1.0  # a disconnect with no reconnect scheduled this long after it was a cut
HANDSHAKE_S = 5.0  # a peer that accepts and says nothing for this long is dropped and tried again
_POLLIN = int(zmq.POLLIN)


class Replica:
    """A DEALER socket to ``endpoint`` with its own connection monitor (read only through
    :meth:`on_monitor`). ``stream`` is the stream this connection is on (-1: none); which
    batches it was asked for is the loader's flow control's business (:mod:`client.flow`)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, heartbeat_s: float, index: int = 0,
                 curve: Optional[ClientKeys] = None, max_frame_bytes: int = -1, max_queued: int = 0):
        """``max_frame_bytes``: a peer that sends a larger frame is disconnected before libzmq
        allocates it (ZMQ_MAXMSGSIZE); -1: no cap. ``max_queued``: messages libzmq queues for
        us before it stops reading the connection (0: no cap); with the frame cap it bounds
        what a peer can make this process hold."""
        self.index = index  # this replica's id in its set of connections (never reused there)
        self.endpoint = endpoint
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, max_queued)
        sock.setsockopt(zmq.SNDHWM, 0)  # requests are few (the window bounds them): a send fails only when cut
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # a rogue peer's 3 GB frame costs nothing
        sock.setsockopt(zmq.RECONNECT_IVL, 100)  # reconnect with exponential backoff ...
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)  # ... up to 2 s between tries
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))  # libzmq's default: 30 s
        # heartbeats: a frozen service (or a dead link) reads as a disconnect; and the PINGs tell the
        # service this client lives while its trainer is busy (it sends none of its own: it cuts a
        # connection that brings nothing for 3 of these, loader_service/dispatch/silence.py)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 3000))
        secure_dealer(sock, curve)  # CURVE keys, if any (client/curve.py)
        self.handshake = HandshakeWatch(endpoint, curve)
        self.attempts = Attempts(endpoint, curve.directory if curve is not None else None)
        # "Connected" is the end of the ZMTP handshake, not the TCP connect: a refused handshake
        # (CURVE) ends the session, and a send into it would block for good.
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_EVENTS
                                               | zmq.EVENT_CONNECT_RETRIED)
        sock.connect(endpoint)
        self.sock = sock
        self.down_since: Optional[float] = time.monotonic()  # not connected yet
        self.was_connected = False
        self.reached = False  # a TCP connection was made (something listens there), handshake or not
        self.shutdown_at: Optional[float] = None  # when the service said it shuts down (monotonic; and wall)
        self.shutdown_wall = 0.0
        self.retry_at: Optional[float] = None  # a try that ended before its handshake: when to connect again
        self._dropped = False  # a try was dropped, and what was queued on it with it: send it again
        # libzmq retries a connection lost to a network error, never one it cut for breaking the
        # protocol (a frame over MAXMSGSIZE): lost and not retried means the peer was refused
        self.retried = True
        self.dead = False  # given up on for the rest of this epoch
        self.refused = ""  # why its service is quarantined (it serves other data); "" while it is not
        self.draining = False  # no longer resolved: takes no new batch, leaves once it owes nothing
        self.stream = -1
        self.slots = 0  # the current stream's batch slots on its service (its Hello's)
        self.epoch = 0  # of the current stream
        self.accepted = False  # the service accepted the current stream
        self.local = False  # the current stream asked for its batches in place (Hello.local)
        # what the service last said it does for our stream (answer to a probe), and when;
        # cleared by each batch, so it always describes the current wait
        self.progress: Optional[P.Progress] = None
        self.progress_at = 0.0
        # stall seconds not yet reported to this replica's service (each service hears all of them once)
        self.wait_s = 0.0
        self.h2d_s = 0.0
        # co-located: the batches of this connection the trainer holds in place (its limit is
        # set by the loader once it knows the stream's slots; 0: every batch copied out)
        self.borrowed = Borrowed()
        # bulk lanes to its service, once open (client.lanes); why this connection goes without them
        self.lanes: Optional[Lanes] = None
        self.lanes_off = ""  # "": lanes may be opened with the next accepted stream
        self.lanes_lost = 0  # lane sets that failed while this connection's service instance served it
        self.service = ""  # that instance's id (Accept.service; a restart is a new one)
        self.reconnected = False  # the connection came back since the last Accept (a new process may serve it)
        self.stale_batches = 0  # batches in a row sent on lanes it no longer had (client.epoch)
        self.gone_batches = 0  # batches in a row handed over in shared memory that no longer exists (client.epoch)
        self.identity = sock.getsockopt(zmq.IDENTITY)

    def stall(self, wait_s: float, h2d_s: float) -> None:
        """The trainer waited ``wait_s`` more seconds; the next message reports it."""
        self.wait_s += wait_s
        self.h2d_s += h2d_s

    def hello(self, stream: int, hello: P.Hello) -> None:
        """Start ``stream`` on this connection (``hello``'s stream field is set here)."""
        self.stream, self.epoch, self.accepted, self.progress = stream, hello.epoch, False, None
        self.slots, self.local = hello.slots, hello.local
        if self.lanes is not None:
            self.lanes.assembly.forget(stream)
        self.move_on()
        self.send(dataclasses.replace(hello, stream=stream))

    def send_releases(self, owed: Optional[int] = None) -> None:
        """Hand back the batches held in place that the trainer let go of since the last call.
        ``owed`` (a wait for a batch, with the Request that follows it to come): the current
        stream's batches owed; its let-go ones stay for that Request (which takes them along) while
        the stream's slots hold every owed batch without them, so a waiting trainer sends one
        message per batch, not two."""
        keep = None
        if owed is not None and self.borrowed.room_without_releases(self.stream, self.slots, owed):
            keep = self.stream
        for stream, batches in self.borrowed.releases(keep).items():
            self.send(P.Release(stream=stream, batches=batches))

    def move_on(self) -> None:
        """Before what makes the service take back every slot this connection borrowed (a Hello,
        the Bye): what was let go of is handed back, what is still held is detached."""
        self.send_releases()
        self.borrowed.detach()

    def request(self, batches, consumed: int, promote: bool = False, final: bool = False,
                probe: bool = False) -> None:
        """Ask the current stream for ``batches``, with the stall seconds since the last report
        (``probe``: and for a :class:`~wire.protocol.Progress` report). The stream's batches the
        trainer let go of go with it (``Request.released``), those of older streams in a Release."""
        back = self.borrowed.releases()
        released = back.pop(self.stream, [])
        for stream, let_go in back.items():
            self.send(P.Release(stream=stream, batches=let_go))
        self.send(P.Request(stream=self.stream, batches=list(batches), wait_s=self.wait_s, h2d_s=self.h2d_s,
                            consumed=consumed, promote=promote, final=final, probe=probe, released=released))
        self.wait_s = self.h2d_s = 0.0

    def on_monitor(self) -> bool:
        """Handle one connection event; True when the connection came back after a loss (or
        after a dropped try: what was sent before it is lost). Raises LoaderError when the
        service refuses the handshake (keys)."""
        msg = recv_monitor_message(self.monitor)
        ev, value = msg["event"], msg["value"]
        self.handshake.check(ev, value)
        if ev == zmq.EVENT_DISCONNECTED:
            self._ended(time.monotonic())
        elif ev == zmq.EVENT_CONNECT_RETRIED:
            self.retried = True
        elif ev == zmq.EVENT_CONNECTED:
            self.reached = True
            self.attempts.connected()
        elif ev in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            self.attempts.failed(value, protocol=ev == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        elif ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.attempts.succeeded()
            back = self.was_connected or self._dropped
            self.was_connected, self.down_since, self._dropped, self.shutdown_at = True, None, False, None
            self.reconnected = self.reconnected or back
            return back
        return False

    def _ended(self, now: float) -> None:
        """The connection ended: a lost one is libzmq's to retry (or a cut); a try that ended
        before its handshake is dropped and tried again later, unless the service refused it."""
        if self.down_since is None:
            self.down_since = now
        action = self.attempts.disconnected(now)
        if isinstance(action, Probe):
            action = self.attempts.probed(greeting_mechanism(self.endpoint), time.monotonic())
        if isinstance(action, Refuse):
            raise LoaderError(AUTH_FAILED, action.message)
        if action is None:
            self.retried = False  # until libzmq says it retries
            return
        self.retried = True  # ours to retry: never a cut
        try:
            self.sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass
        self._dropped, self.retry_at = True, action.at

    def tick(self, now: float) -> None:
        """Connect again if a dropped try's retry is due."""
        if self.retry_at is not None and now >= self.retry_at:
            self.retry_at = None
            self.sock.connect(self.endpoint)

    def cut_at(self) -> Optional[float]:
        """When this connection counts as cut for good: libzmq schedules its reconnect (and says
        so) within a millisecond of a disconnect it will retry, and never retries one it cut for
        breaking the protocol. None while connected or retrying."""
        return self.down_since + CUT_GRACE_S if self.down_since is not None and not self.retried else None

    def is_cut(self, now: float) -> bool:
        """Cut for good: past :meth:`cut_at`, with no connection event left unread. The trainer may
        step for longer than the grace between reading a disconnect and reading libzmq's next event
        (its reconnect, queued right behind): that event, not the clock, says what became of it."""
        at = self.cut_at()
        return at is not None and now >= at and not self.has_event()

    def has_message(self) -> bool:
        """A message waits on the socket (never blocks)."""
        # ZMQ_EVENTS, not a poll: it asks libzmq the same question without building a poller (a
        # third of the cost, once or twice per batch); a plain int mask, as ``& zmq.POLLIN`` makes
        # an enum.Flag each time (another third)
        return bool(self.sock.getsockopt(zmq.EVENTS) & _POLLIN)

    def has_event(self) -> bool:
        """A connection event waits on the monitor (never blocks)."""
        return bool(self.monitor.poll(0))

    def wait(self, timeout_ms: float) -> bool:
        """Wait up to ``timeout_ms`` for a message or a connection event; True if a message came."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        return self.sock in dict(poller.poll(timeout_ms))

    def send(self, msg: P.Message) -> None:
        """Queue ``msg`` (never blocks). A connection libzmq cut for good has nowhere to queue it:
        the message is dropped, and the loader's cut check gives that replica up."""
        frames = P.encode(msg)
        try:
            if len(frames) == 1:  # every message a client sends: send_multipart's loop costs as much again
                self.sock.send(frames[0], zmq.NOBLOCK)
            else:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass

    def drain(self) -> None:
        while self.sock.getsockopt(zmq.RCVMORE):
            self.sock.recv(copy=False)

    def served_by(self, service: str) -> None:
        """The service instance that accepted this connection's stream. A new one over a new
        connection (its service restarted, or another took its address) starts with no lane set
        lost: a set that died with the process before it is not lanes that keep failing, and a long
        run whose services are restarted now and then keeps its lanes. Lanes still open to the old
        process are let go. (A new id on the same connection is a peer's game, not a restart: the
        count stands, so lanes that keep failing are still given up.)"""
        reconnected, self.reconnected = self.reconnected, False
        if not service or service == self.service:
            return
        if self.service and reconnected:
            if self.lanes is not None:
                self.lanes.close()
                self.lanes = None
            if self.lanes_lost >= MAX_LANES_LOST:
                self.lanes_off = ""
            self.lanes_lost = 0
        self.service = service

    def drop_lanes(self, why: str) -> None:
        """Close the bulk lanes, which failed: the next accepted stream opens new ones (a service
        that restarted), up to MAX_LANES_LOST failed sets with one service process; then data
        frames until another process serves the connection (:meth:`served_by`)."""
        self.lanes_lost += 1
        if self.lanes_lost >= MAX_LANES_LOST:
            self.lanes_off = f"{self.lanes_lost} sets of bulk lanes failed, the last: {why}"
        if self.lanes is not None:
            self.lanes.close()
            self.lanes = None

    def close(self) -> None:
        if self.lanes is not None:
            self.lanes.close()
        try:
            self.move_on()  # a detach that fails is raised, after the socket is closed all the same
        finally:
            try:
                self.sock.send_multipart(P.encode(P.Bye()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(linger=100)  # long enough to hand Bye to the kernel, never a hang
