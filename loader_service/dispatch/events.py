"""What goes in and out of the dispatch state: *events* the I/O shell read, *commands* it carries out.

:meth:`~loader_service.dispatch.state.DispatchState.handle` takes one event and returns the
commands it decided; the shell (:mod:`.loop`) reads sockets, sentinels and clocks into events
and turns commands into sends, worker tasks and signals. Nothing here holds state or does I/O.
A stream's own decisions (:data:`~loader_service.dispatch.stream_state.Effect`: send a batch,
finish, fail) stay inside the dispatch state; the words differ on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple, Union

from wire import protocol as P

if TYPE_CHECKING:  # pragma: no cover
    from loader_service.dispatch.streams import Stream
    from loader_service.dispatch.unread import Sending
    from loader_service.shm import Segment
    from loader_service.workers.pool_state import WorkerRecord


# ---------------------------------------------------------------------- events (shell -> state)
@dataclass(frozen=True)
class Accepted:
    """The data port accepted a connection on ``fd`` (monitor)."""

    fd: int


@dataclass(frozen=True)
class Disconnected:
    """The connection on ``fd`` closed (monitor)."""

    fd: int


@dataclass(frozen=True)
class HandshakeRefused:
    """A CURVE handshake was refused (the guard logged why)."""


@dataclass(frozen=True)
class ClientMessage:
    """A client's message as the ROUTER handed it over: ``frames`` after the identity (zmq frames
    or anything with ``.bytes`` and ``.buffer``: not yet decoded, every byte hostile), the fd of
    its connection, and its CURVE key (``""`` without CURVE)."""

    ident: bytes
    fd: int
    frames: Sequence[Any]
    user_id: str = ""


@dataclass(frozen=True)
class WorkerDone:
    """A worker finished ``done.task``; ``began``: the task queued behind it, which runs from now."""

    done: P.Done
    began: Optional[int]


@dataclass(frozen=True)
class WorkerLost:
    """A worker exited: the tasks it ``held``, the one it ``died_on`` (None: between tasks)."""

    held: Tuple[int, ...]
    died_on: Optional[int]
    exitcode: Optional[int]


@dataclass(frozen=True)
class LetGo:
    """libzmq let go of the last zero-copy frame of a batch sent from ``stream``'s ``slot``."""

    stream: "Stream"
    slot: int


@dataclass(frozen=True)
class Flushed:
    """libzmq let go of the Accept of ``stream`` sent to ``ident`` (a :class:`Send` with ``track``):
    all it had queued for that connection before it has gone to the kernel too."""

    ident: bytes
    stream: int


@dataclass(frozen=True)
class Unreachable:
    """A send to ``ident`` found its connection gone (ROUTER_MANDATORY)."""

    ident: bytes


@dataclass(frozen=True)
class CommandFailed:
    """Carrying out a command for client ``ident`` raised (a bug): that client alone is failed."""

    ident: bytes
    what: str
    error: str
    traceback: str


@dataclass(frozen=True)
class Quiet:
    """How long each connection asked about by a :class:`Probe` has brought no data (the kernel's
    ``TCP_INFO``), its peer's address, and the send side of its socket and of each of its bulk
    lanes (:class:`~.unread.Sending`; none where the kernel does not count it): (fd, serial,
    seconds, address, sockets). A connection the shell could not read is left out."""

    readings: Tuple[Tuple[int, int, float, str, Tuple[Sending, ...]], ...]


@dataclass(frozen=True)
class Tick:
    """The end of a round of events: deadlines, slots to lend or give back, idle workers to fill."""


@dataclass(frozen=True)
class HeapTrimmed:
    """The heap was given back to the system (``freed`` bytes of RSS)."""

    freed: int


@dataclass(frozen=True)
class StopAsked:
    """End serving, after letting tasks in flight finish and go out for up to ``drain_s``."""

    drain_s: float


@dataclass(frozen=True)
class Closing:
    """The service closes: tell every client (the workers stop next)."""


@dataclass(frozen=True)
class Closed:
    """The workers have stopped: drop every session and give every slot back."""


Event = Union[Accepted, Disconnected, HandshakeRefused, ClientMessage, WorkerDone, WorkerLost, LetGo, Flushed,
              Unreachable, CommandFailed, Quiet, Tick, HeapTrimmed, StopAsked, Closing, Closed]


# ---------------------------------------------------------------------- commands (state -> shell)
@dataclass(frozen=True)
class Send:
    """Send ``message`` to client ``ident``; with ``track`` (an Accept), :class:`Flushed` comes back
    once libzmq lets go of it (sent to the kernel, or dropped with its connection)."""

    ident: bytes
    message: P.Message
    track: bool = False


@dataclass(frozen=True)
class SendData:
    """Send a batch to ``ident``: its ``message``, the ``blocks`` (offset, size) of ``segment`` (large
    ones zero-copy: :class:`LetGo` comes back once libzmq lets go of them all, or at once if none
    was), then ``labels``. Without ``let_go`` no LetGo comes: a co-located client borrows the
    slot and hands it back with a Release (:mod:`.local`)."""

    ident: bytes
    message: "P.Batch"
    segment: "Segment"
    blocks: Tuple[Tuple[int, int], ...]
    labels: bytes
    stream: "Stream"
    slot: int
    let_go: bool = True

    @property
    def header(self) -> bytes:
        """The message's frame 0, as sent in data frames."""
        return P.encode_header(self.message)


@dataclass(frozen=True)
class Assign:
    """Hand ``task`` to ``worker`` (for client ``ident``); then hint the stream's source that
    ``batch`` is next (a remote source downloads what it needs on a thread)."""

    ident: bytes
    worker: "WorkerRecord"
    task: P.Task
    stream: "Stream"
    batch: int


@dataclass(frozen=True)
class Kill:
    """Kill worker process ``pid`` (its task outlived its deadline; its loss comes as :class:`WorkerLost`)."""

    pid: int


@dataclass(frozen=True)
class Cut:
    """Shut down connection ``fd`` (serial ``serial`` in the sessions' table) if it is still that
    one: it sent past its allowance (:mod:`.flood`), or brought nothing for too long (:mod:`.silence`)."""

    fd: int
    serial: int


@dataclass(frozen=True)
class Probe:
    """Read how long each connection (fd, serial, the identity of its session or b"") has brought no
    data, and what waits unread on it and its lanes; answered by :class:`Quiet` (:mod:`.silence`,
    :mod:`.unread`)."""

    connections: Tuple[Tuple[int, int, bytes], ...]


@dataclass(frozen=True)
class Deny:
    """Refuse new data-port connections from ``address`` at the handshake (ZAP), from now on: it
    has stranded connections (:mod:`.silence`)."""

    address: str


@dataclass(frozen=True)
class Unmap:
    """Segment ``name`` was unlinked: the workers drop their mappings of it."""

    name: str


@dataclass(frozen=True)
class TrimHeap:
    """Give the heap that departed sessions freed back to the system (the shell does it once, at
    the end of the chain of events that asked: a burst of disconnects may ask several times)."""


@dataclass(frozen=True)
class EndLoop:
    """Stop serving now (a stop asked, and what was in flight has gone out or its time is up)."""


Command = Union[Send, SendData, Assign, Kill, Cut, Probe, Deny, Unmap, TrimHeap, EndLoop]

__all__ = ["Accepted", "Assign", "ClientMessage", "Closed", "Closing", "Command", "CommandFailed", "Cut", "Deny",
           "Disconnected", "EndLoop", "Event", "Flushed", "HandshakeRefused", "HeapTrimmed", "Kill", "LetGo",
           "Probe", "Quiet", "Send", "SendData", "StopAsked", "Tick", "TrimHeap", "Unmap", "Unreachable",
           "WorkerDone", "WorkerLost"]
