"""Which service replicas a loader's endpoints stand for, followed while it runs.

A pure state machine (events in, actions out; the clock is passed in), driven by
:class:`client.fleet.Fleet`, which does the lookups and the connecting. An endpoint given as a
DNS name (a Kubernetes headless Service, say) stands for every address the name resolves to,
and is looked up again every ``refresh_s`` and soon after any connection loss (at most once
per ``backoff_s``: a replica that keeps dropping does not flood the resolver):

* an address that appears **joins**: the loader connects to it, and the flow control gives it
  batches on demand from then on (mid-epoch too);
* an address that disappears **drains**: it gets no new batch, and **leaves** once it has
  delivered what it owes, or at once if its connection is down, or ``drain_s`` after it began
  draining; what it still owes then goes to the others (so nothing is lost or doubled);
* an address that left joins again no sooner than ``backoff_s`` after it left, so a flapping
  record costs at most one reconnect per address per ``backoff_s``; a draining address that
  comes back simply **resumes** (no reconnect);
* a name that resolves to nothing (no record, or the resolver fails) keeps its last answer:
  the current replicas stay, and the loader says so once, until the name resolves again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Union

_NEVER = float("inf")
MAX_PER_NAME = 64  # addresses taken from one name's answer (sorted): a hostile answer costs bounded sockets


@dataclass(frozen=True)
class Change:
    """What to do about one member, ``endpoint`` (the subclasses say what)."""
    endpoint: str


class Join(Change):
    """Connect to ``endpoint``; it takes batches once its service accepts the stream."""


class Resume(Change):
    """``endpoint`` was draining and is resolved again: it takes new batches again."""


class Drain(Change):
    """``endpoint`` is gone from its name's answer: no new batch for it; report
    :meth:`Membership.drained` once it owes nothing, :meth:`Membership.lost` if it drops."""


class Leave(Change):
    """Close ``endpoint``; what it still owes goes to the others."""


@dataclass(frozen=True)
class Say:
    """A line for the log."""
    text: str


Action = Union[Join, Resume, Drain, Leave, Say]
Answer = Union[FrozenSet[str], str]  # the endpoints a name resolved to, or why it resolved to none


class Membership:
    """The replicas of ``names`` (``tcp://host:port`` endpoints followed through DNS) and of
    ``fixed`` (endpoints used as given: addresses, ipc). Nothing is a member before the first
    :meth:`resolved`, which joins ``fixed`` and every address found."""

    def __init__(self, names: Sequence[str], fixed: Sequence[str], *, refresh_s: float, backoff_s: float,
                 drain_s: float):
        if refresh_s <= 0 or backoff_s <= 0 or drain_s <= 0:
            raise ValueError("refresh_s, backoff_s and drain_s must be > 0")
        self.names, self.fixed = tuple(names), frozenset(fixed)
        self.refresh_s, self.backoff_s, self.drain_s = refresh_s, backoff_s, drain_s
        self.answers: Dict[str, FrozenSet[str]] = {}  # each name's last answer with an address in it
        self.members: Dict[str, Optional[float]] = {}  # endpoint -> None (active) or when it began draining
        self.cooling: Dict[str, float] = {}  # endpoint that left -> when it may join again
        self.next_lookup = float("-inf")  # due at once
        self._last_lookup = float("-inf")
        self._said_empty: Set[str] = set()  # names said to resolve to nothing, until they resolve again

    # ------------------------------------------------------------------ reading
    @property
    def following(self) -> bool:
        """Whether any endpoint is a name to look up."""
        return bool(self.names)

    def wanted(self) -> FrozenSet[str]:
        return self.fixed.union(*self.answers.values())

    def active(self) -> List[str]:
        """Members that take new batches, sorted (every rank lists them in the same order)."""
        return sorted(e for e, since in self.members.items() if since is None)

    def due(self) -> float:
        """When :meth:`tick` (or a lookup) has something to do."""
        # (several times per batch, mostly with no name, nothing draining, nothing cooling)
        due = self.next_lookup if self.names else _NEVER
        for since in self.members.values():
            if since is not None:
                due = min(due, since + self.drain_s)
        if self.cooling:
            wanted = self.wanted()
            due = min([due, *(at for e, at in self.cooling.items() if e in wanted)])
        return due

    def lookup_due(self, now: float) -> bool:
        return bool(self.names) and now >= self.next_lookup

    # ------------------------------------------------------------------ events
    def resolved(self, now: float, answers: Mapping[str, Answer]) -> List[Action]:
        """A lookup of every name finished: ``answers[name]`` is the endpoints it resolved to
        (IPv4 addresses, on the name's port), or a string saying why none."""
        self._last_lookup, self.next_lookup = now, now + self.refresh_s
        out: List[Action] = []
        for name in self.names:
            got = answers.get(name, "not looked up")
            if isinstance(got, frozenset) and got:
                if len(got) > MAX_PER_NAME:
                    out.append(Say(f"{name} resolved to {len(got)} addresses; following the first "
                                   f"{MAX_PER_NAME} (sorted)"))
                    got = frozenset(sorted(got)[:MAX_PER_NAME])
                if name in self._said_empty:
                    self._said_empty.discard(name)
                    out.append(Say(f"{name} resolves again: {', '.join(sorted(got))}"))
                self.answers[name] = got
            elif name not in self._said_empty:
                self._said_empty.add(name)
                why = got if isinstance(got, str) else "no address"
                keep = ", ".join(sorted(self.answers.get(name, ()))) or "none yet"
                out.append(Say(f"{name} resolved to nothing ({why}); keeping its current replicas ({keep}) "
                               "until it resolves again"))
        return out + self._reconcile(now)

    def lost(self, endpoint: str, now: float) -> List[Action]:
        """The connection to ``endpoint`` was lost: look the names up again soon (a pod that
        Kubernetes recreates comes back on a new address); a draining member leaves at once."""
        if self.names:
            self.next_lookup = min(self.next_lookup, max(now, self._last_lookup + self.backoff_s))
        if self.members.get(endpoint) is not None:
            return [self._leave(endpoint, now)]
        return []

    def drained(self, endpoint: str, now: float) -> List[Action]:
        """``endpoint`` owes nothing more: a draining member leaves."""
        if self.members.get(endpoint) is not None:
            return [self._leave(endpoint, now)]
        return []

    def tick(self, now: float) -> List[Action]:
        """Leave the members that drained too long; join those whose backoff ended."""
        out: List[Action] = [self._leave(e, now) for e, since in sorted(self.members.items())
                             if since is not None and now >= since + self.drain_s]
        return out + self._reconcile(now)

    # ------------------------------------------------------------------ the rules
    def _reconcile(self, now: float) -> List[Action]:
        wanted, out = self.wanted(), []
        for e in sorted(wanted):
            if e in self.members:
                if self.members[e] is not None:
                    self.members[e] = None
                    out.append(Resume(e))
            elif self.cooling.get(e, float("-inf")) <= now:
                self.cooling.pop(e, None)
                self.members[e] = None
                out.append(Join(e))
        for e in sorted(set(self.members) - wanted):
            if self.members[e] is None:
                self.members[e] = now
                out.append(Drain(e))
        for e in [e for e, at in self.cooling.items() if at <= now and e not in wanted]:
            del self.cooling[e]  # bounded: only addresses that left within the last backoff_s stay
        return out

    def _leave(self, endpoint: str, now: float) -> Leave:
        del self.members[endpoint]
        self.cooling[endpoint] = now + self.backoff_s
        return Leave(endpoint)


__all__ = ["Membership", "Join", "Resume", "Drain", "Leave", "Say", "Action", "MAX_PER_NAME"]
