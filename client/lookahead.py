"""The epoch lookahead: the next epoch started early on a spare set of connections (a second
connection per replica), so the services never idle between epochs.

Best effort: the next iteration adopts it if it is that epoch from its start and every service
accepted it; otherwise (or if a service refuses it, for want of capacity say) its streams are
released at once (closing the spare set says Bye, which frees them on the service).
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Tuple

import zmq

from wire import protocol as P

from client.connections import Connections
from client.errors import LoaderError
from client.flow import EpochFlow
from client.stats import LoaderStats

log = logging.getLogger("client")


class Lookahead:
    """The spare set (a twin of the current set, opened when first needed, then kept: after an
    adoption the set the last epoch ran on becomes the spare) and the epoch streaming ahead on
    it, if any."""

    def __init__(self, timeout: float, stats: LoaderStats):
        self._timeout, self._stats = timeout, stats
        self.spare: Optional[Connections] = None
        self.epoch: Optional[int] = None  # the epoch streaming ahead on the spare set
        self.flow: Optional[EpochFlow] = None  # its flow control; None: nothing streams ahead

    def start(self, current: Connections, epoch: int, total: int) -> None:
        """Start ``epoch`` (of ``total`` batches) on the spare set; nothing if one already streams
        ahead, or while a replica of the ``current`` set is down."""
        if self.flow is not None or not current.healthy():
            return
        if self.spare is None:
            self.spare = current.twin()
        self.epoch, self.flow = epoch, self.spare.start_epoch(epoch, 0, total, lookahead=True)

    def adopt(self, current: Connections, epoch: int, start: int, total: int, sink,
              origin: int = 0) -> Optional[Tuple[Connections, EpochFlow]]:
        """The lookahead's set and flow if it is ``epoch`` from its start and every service
        accepted it (its first message, already there in the usual case): its streams become
        the trainer's current ones and ``current`` the next spare. Otherwise None, and a
        lookahead that streams is dropped. Waits at most the loader's timeout."""
        flow, ahead = self.flow, self.epoch
        if flow is None:
            return None
        self.epoch = self.flow = None
        if ahead != epoch or start != 0 or origin != 0:  # it streams the whole epoch, from its start
            return self._close_spare()
        spare = self.spare
        if sorted(r.endpoint for r in spare.replicas) != sorted(r.endpoint for r in current.replicas):
            log.info("the replicas changed since epoch %d started ahead; starting it plainly", epoch)
            return self._close_spare()
        deadline = time.monotonic() + self._timeout
        for r in spare.replicas:
            lost = False
            while not r.accepted:
                while r.has_event():
                    lost = r.on_monitor() or lost  # reconnected: a restarted service forgot the stream
                left = deadline - time.monotonic()
                # a spare opened at the end of the last epoch may still be in its handshake: wait
                # for it; one that was connected and dropped, or whose try was dropped, lost its stream
                if lost or (r.down_since is not None and r.was_connected) or r.retry_at is not None or left <= 0:
                    log.info("epoch lookahead lost or not answered by %s; starting epoch %d plainly", r.endpoint, epoch)
                    return self._close_spare()
                if not r.wait(left * 1000):
                    continue
                try:
                    msg, _ = spare.recv(r, sink)
                except zmq.Again:  # what the wait saw is gone: nothing to read (as in an epoch's wait)
                    continue
                except LoaderError as exc:  # refused (no capacity, say): start the epoch plainly
                    log.info("epoch lookahead refused by %s (%s); starting epoch %d plainly", r.endpoint, exc, epoch)
                    return self._close_spare()
                if isinstance(msg, P.Accept):
                    if msg.num_batches != total:
                        return self._close_spare()
                    if spare.misplaced(r):  # the stream asked in place, or not, wrongly for where its service is
                        log.info("epoch lookahead on %s asked for the wrong hand-over; starting epoch %d plainly",
                                 r.endpoint, epoch)
                        return self._close_spare()
                    r.accepted = True
        self.spare = current
        for r in spare.replicas:
            r.request([], self._stats.batches, promote=True)  # now the trainer's current epoch
        return spare, flow

    def send_releases(self, current: Connections) -> None:
        """Hand back what the trainer let go of among the batches the spare set lent in place
        (co-located: the last epoch's, now that the set waits as the spare)."""
        if self.spare is not None and self.spare is not current:
            self.spare.send_releases()

    def close(self) -> None:
        self.epoch = self.flow = None
        self._close_spare()

    def _close_spare(self) -> None:
        if self.spare is not None:
            self.spare.close()
            self.spare = None
