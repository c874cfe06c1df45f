"""One connection to one service replica, and this epoch's share of the plan on it."""

from __future__ import annotations

import time
import uuid
from typing import List, Optional, Set

import zmq
from zmq.utils.monitor import recv_monitor_message

from loader_service import protocol as P


class Replica:
    """A DEALER socket to ``endpoint`` with its own connection monitor.

    ``todo`` lists the batches of the current epoch this replica is to deliver and has not
    delivered yet, in order; ``stream`` is the stream serving them (-1: none).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, heartbeat_s: float, max_frame_bytes: int = -1):
        """``max_frame_bytes``: a peer that sends a larger frame is disconnected before libzmq
        allocates it (ZMQ_MAXMSGSIZE); -1: no cap."""
        self.endpoint = endpoint
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # the credits bound what can queue here
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # a rogue peer's 3 GB frame costs nothing
        sock.setsockopt(zmq.RECONNECT_IVL, 100)  # reconnect with exponential backoff ...
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)  # ... up to 2 s between tries
        # heartbeats from our side too: a frozen service (or a dead link) reads as a disconnect
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 3000))
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        sock.connect(endpoint)
        self.sock = sock
        self.down_since: Optional[float] = time.monotonic()  # not connected yet
        self.was_connected = False
        # libzmq retries a connection lost to a network error, never one it cut for breaking the
        # protocol (a frame over MAXMSGSIZE): lost and not retried means the peer was refused
        self.retried = True
        self.dead = False  # given up on for the rest of this epoch
        self.stream = -1
        self.todo: List[int] = []
        self.todo_set: Set[int] = set()
        self.asked = 0  # batches requested of the current stream (its prefetch plus credits)
        self.owed = 0  # credits held back while the reorder buffer is full
        self.promote = False  # tell the service, with the next credit, that this stream is current

    def assign(self, batches: List[int]) -> None:
        self.todo = list(batches)
        self.todo_set = set(batches)

    def received(self, batch: int) -> bool:
        """Record a delivered batch; False if it was not expected from this replica."""
        if batch not in self.todo_set:
            return False
        self.todo_set.discard(batch)
        return True

    def remaining(self) -> List[int]:
        return [b for b in self.todo if b in self.todo_set]

    def on_monitor(self) -> bool:
        """Handle one connection event; True when the connection came back after a loss."""
        ev = recv_monitor_message(self.monitor)["event"]
        if ev == zmq.EVENT_DISCONNECTED:
            self.retried = False
            if self.down_since is None:
                self.down_since = time.monotonic()
        elif ev == zmq.EVENT_CONNECT_RETRIED:
            self.retried = True
        elif ev == zmq.EVENT_CONNECTED:
            back = self.was_connected
            self.was_connected, self.down_since = True, None
            return back
        return False

    def send(self, msg: P.Message) -> None:
        self.sock.send_multipart(P.encode(msg))

    def drain(self) -> None:
        while self.sock.getsockopt(zmq.RCVMORE):
            self.sock.recv(copy=False)

    def close(self) -> None:
        try:
            self.sock.send_multipart(P.encode(P.Bye()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(linger=100)  # long enough to hand Bye to the kernel, never a hang
