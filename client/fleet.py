"""A loader's replicas as they change during a run: the names it follows looked up in the
background (:mod:`client.names`), the rules of :class:`~client.membership.Membership`, and what
they decide carried out on the current set of connections and the epoch's flow control.

Replicas that join mid-epoch open a stream of the epoch that asks for nothing yet: the flow
control gives them batches on demand once their service accepts it. Replicas that drain get no
new batch; those that leave hand what they owe to the others (:meth:`EpochFlow.leave`), and
their socket is closed, so a batch of theirs can never arrive late and be counted twice.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, Sequence

from client.attempts import MAX_S
from client.config import LoaderConfig
from client.errors import LoaderTimeout
from client.flow import EpochFlow
from client.membership import Action, Drain, Join, Leave, Membership, Resume, Say
from client.names import Lookups, default_server, follows

log = logging.getLogger("client")

LOOKUP_POLL_S = 0.05  # while a lookup runs, the epoch's wait wakes this often to read its answer
LOOKUP_TIMEOUT_S = 2.0  # a DNS server asked directly (dns_server) answers within this, or the name resolved to nothing


class Fleet:
    """The replicas behind ``endpoints``: a name (``tcp://NAME:port``) stands for every address it
    resolves to and is followed every ``config.dns_refresh_s`` (0: used as given, once, by
    libzmq); addresses and ipc endpoints are used as given."""

    def __init__(self, endpoints: Sequence[str], config: LoaderConfig, clock: Callable[[], float] = time.monotonic,
                 lookups: Optional[Lookups] = None):
        """``lookups``: what looks the names up (the default: :class:`~client.names.Lookups`
        with the configured resolver)."""
        refresh = config.dns_refresh_s
        names = [e for e in dict.fromkeys(endpoints) if refresh > 0 and follows(e)]
        fixed = [e for e in dict.fromkeys(endpoints) if e not in names]
        self.membership = Membership(names, fixed, refresh_s=refresh or 1.0, backoff_s=MAX_S,
                                     drain_s=config.replica_timeout)
        server = config.dns_server if config.dns_server is not None else default_server()
        self._lookups = lookups if lookups is not None else Lookups(names, server, LOOKUP_TIMEOUT_S)
        self._clock = clock
        self._started = False

    def first(self, timeout: float) -> List[str]:
        """The replicas to start with: the names looked up (again every ``MAX_S`` while they
        resolve to nothing) until one has an address, within ``timeout``."""
        if self._started:
            return self.membership.active()
        deadline = self._clock() + timeout
        while True:
            left = deadline - self._clock()
            answers = self._lookups.now(max(0.0, min(left, LOOKUP_TIMEOUT_S))) if self.membership.following else {}
            if answers is not None:
                for a in self.membership.resolved(self._clock(), answers):
                    if isinstance(a, Say):
                        log.info("%s", a.text)
            if self.membership.active():
                self._started = True
                return self.membership.active()
            left = deadline - self._clock()
            if left <= MAX_S / 20:  # no time left for another lookup
                names = ", ".join(self.membership.names)
                raise LoaderTimeout(f"{names} resolved to no address within {timeout:g}s (is the service "
                                    "deployed and ready, and is its name right? the shipped headless Service "
                                    "(deploy/k8s, deploy/helm) lists ready pods only: a pod is listed once its "
                                    "/readyz answers 200, and no longer once it is terminating)")
            if answers is not None:
                time.sleep(min(MAX_S, left / 2))  # the next try; half the time left, so a last one fits

    def wake_at(self, now: float) -> float:
        """When the epoch's wait should wake up for the fleet's sake."""
        if self._lookups.running:
            return now + LOOKUP_POLL_S
        return self.membership.due()

    # ------------------------------------------------------------------ following, during a run
    def follow(self, conns, now: float, flow: Optional[EpochFlow] = None, epoch: int = 0) -> None:
        """Start a lookup that is due, read one that finished, and carry out what the membership
        decides on ``conns`` (and on ``flow``, the epoch running on them, if any)."""
        if flow is not None and not self._lookups.running and now < self.membership.due():
            return  # nothing is due (every rule of the membership waits on a lookup or a deadline)
        actions: List[Action] = []
        if self._lookups.running:
            answers = self._lookups.result()
            if answers is not None:
                actions += self.membership.resolved(now, answers)
        elif self.membership.lookup_due(now):
            self._lookups.start()
        actions += self.membership.tick(now)
        if flow is None:  # between epochs no stream owes anything: a draining replica leaves now
            for r in conns.replicas:
                if r.draining:
                    actions += self.membership.drained(r.endpoint, now)
        self._carry_out(actions, conns, flow, epoch, now)

    def lost(self, conns, r, now: float, flow: Optional[EpochFlow] = None) -> None:
        """``r``'s connection was lost."""
        self._carry_out(self.membership.lost(r.endpoint, now), conns, flow, 0, now)

    def delivered(self, conns, r, now: float, flow: EpochFlow) -> None:
        """``r`` delivered a batch: a draining replica that owes nothing more leaves."""
        if r.draining and not flow.outstanding.get(r.index):
            self._carry_out(self.membership.drained(r.endpoint, now), conns, flow, 0, now)

    def _carry_out(self, actions: List[Action], conns, flow: Optional[EpochFlow], epoch: int, now: float) -> None:
        todo = list(actions)
        while todo:
            a = todo.pop(0)
            if isinstance(a, Say):
                log.warning("%s", a.text)
                continue
            r = conns.find(a.endpoint)
            if isinstance(a, Join) and r is None:
                r = conns.join(a.endpoint)
                if flow is not None:
                    flow.join(r.index)
                    conns.hello(r, epoch, [])  # batches come on demand once its service accepts
                log.info("service replica %s joins (%d replicas now)", a.endpoint, len(conns.replicas))
            elif isinstance(a, Resume) and r is not None:
                r.draining = False
                log.info("service replica %s is resolved again; it takes batches again", a.endpoint)
            elif isinstance(a, Drain) and r is not None:
                r.draining = True
                owes = flow is not None and bool(flow.outstanding.get(r.index))
                log.info("service replica %s is no longer resolved; it drains (%s)", a.endpoint,
                         "owes nothing" if not owes else f"{len(flow.outstanding[r.index])} batches to deliver")
                if not owes:
                    todo += self.membership.drained(a.endpoint, now)
                elif r.down_since is not None:
                    todo += self.membership.lost(a.endpoint, now)
            elif isinstance(a, Leave) and r is not None:
                orphans = flow.leave(r.index) if flow is not None and r.index in flow.outstanding else []
                conns.leave(r)
                log.info("service replica %s leaves%s", a.endpoint,
                         f"; its {len(orphans)} batches go to the others" if orphans else "")


__all__ = ["Fleet"]
