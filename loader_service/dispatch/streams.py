"""A stream as the dispatcher holds it: an :class:`Opening` (admitted, all but its slots) and a
:class:`Stream` (served). Records only: a stream's batches are its
:class:`~loader_service.dispatch.stream_state.StreamState`, its slots and its ``life`` are
:mod:`memory`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from wire import protocol as P
from wire.plan import RankPlan
from loader_service.decode.pipelines import JobPipeline
from loader_service.dispatch import scheduler
from loader_service.dispatch.door import Asked, Life, window_of
from loader_service.dispatch.sending import BatchLayout
from loader_service.dispatch.sessions import Session
from loader_service.dispatch.stream_state import StreamLimits, StreamState
from loader_service.shm import Segment
from loader_service.sources import Source


def _what(nslots: int, layout: BatchLayout) -> str:
    return f"prefetch {nslots} x {layout.slot_bytes / 2**20:.1f} MiB"


@dataclass(eq=False)  # identity: streams are compared as objects (``in retiring``), never by value
class Stream:
    """A stream's I/O side: whose it is, what it reads, where its slots live."""

    ident: bytes
    hello: P.Hello
    source: Source
    plan: RankPlan
    pipe: JobPipeline
    layout: BatchLayout
    state: StreamState
    segment: Optional[Segment]  # None: lent out while the stream was quiet (see BatchMemory)
    lookahead: bool  # low priority until the client promotes it
    asked_at: float  # the client's last ask for work: how long the stream has been quiet
    asked: bool = False  # the client asked for more since the stream began: it reads what it is sent
    wait_s: float = 0.0  # the client's stall figures during this stream (sum of its deltas)
    h2d_s: float = 0.0
    life: Life = Life.RUNNING  # where it is; moved by its BatchMemory only, as door.MAY_BECOME allows
    # co-located (Hello.local): batch -> slot its client reads until its Release (dispatch/local.py)
    borrowed: Dict[int, int] = field(default_factory=dict)

    @property
    def id(self) -> int:
        return self.hello.stream

    @property
    def tier(self) -> int:
        """Its tier in the scheduler's line (:func:`~loader_service.dispatch.scheduler.tier`)."""
        return scheduler.tier(self.lookahead, self.state.next_send, self.asked)

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    @property
    def nbytes(self) -> int:
        """The size of its slots (held or lent)."""
        return self.state.num_slots * self.slot_bytes

    @property
    def what(self) -> str:
        """Its slots, for messages."""
        return _what(self.state.num_slots, self.layout)

    def asks(self) -> Asked:
        """What it has been asked so far (what the door checks a new ask against)."""
        st = self.state
        return Asked(self.id, self.plan.num_batches, window_of(self.hello), len(st.order), st.next_send, st.final,
                     st.has)


@dataclass(eq=False)
class Opening:
    """A stream admitted but not yet given its slots: what :meth:`open` needs."""

    session: Session
    hello: P.Hello
    source: Source
    plan: RankPlan
    pipe: JobPipeline
    layout: BatchLayout
    limits: StreamLimits
    order: List[int]  # the batches asked so far, in the order asked
    final: bool  # no batch will be added to ``order``
    nslots: int
    _has: Set[int] = field(default_factory=set, repr=False)  # the batches of ``order``: the door's repeat check

    @property
    def ident(self) -> bytes:
        return self.session.ident

    @property
    def nbytes(self) -> int:
        return self.nslots * self.layout.slot_bytes

    @property
    def what(self) -> str:
        return _what(self.nslots, self.layout)

    def __post_init__(self) -> None:
        self._has = set(self.order)

    def asks(self) -> Asked:
        """What it has been asked so far (what the door checks a new ask against)."""
        return Asked(self.hello.stream, self.plan.num_batches, window_of(self.hello), len(self.order), 0, self.final,
                     self._has.__contains__)

    def asked(self, msg: P.Request) -> None:
        """A Request that came while it waited for slots, let in by the door
        (:mod:`~loader_service.dispatch.door`): it counts when it opens."""
        self.order.extend(msg.batches)
        self._has.update(msg.batches)
        self.final = self.final or msg.final

    def open(self, segment: Segment, now: float) -> Stream:
        """The stream, on ``segment``."""
        state = StreamState(self.order, self.nslots, self.plan.batch, self.source.describe, self.limits,
                            final=self.final)
        return Stream(ident=self.ident, hello=self.hello, source=self.source, plan=self.plan, pipe=self.pipe,
                      layout=self.layout, state=state, segment=segment, lookahead=self.hello.lookahead, asked_at=now)
