"""The door: every client message checked against its stream's life before it changes anything.

A stream's *life* is one explicit state (:class:`Life`), whatever part of the dispatcher holds
it (an :class:`~loader_service.dispatch.streams.Opening` waiting for slots, a
:class:`~loader_service.dispatch.streams.Stream` being served, one retired while its last
task or send still reads its slots). :data:`MAY_BECOME` lists the transitions a life may
take; the model test of the door (``tests/unit/dispatch/test_door.py``) checks every one it
sees against it.

What a client may ask of a stream is the same in every life: a batch of its own plan, never
one asked already, never after it said ``final``, and never more than its *window* asked and
not yet sent (:func:`window_of`: what the client said it holds at most, which also bounds the
memory a waiting stream keeps for its client). :func:`check_request`
says what is wrong, or None; it reads an :class:`Asked` view and changes nothing, so the
dispatcher applies a message only once the door has let it in.

Pure: no sockets, no clocks, no memory of its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Optional

from wire import protocol as P


class Life(enum.Enum):
    """Where a stream is in its life (one value at a time)."""

    WAITING = "waiting"  # admitted; waits for batch slots that ending or quiet streams hold
    RUNNING = "running"  # has its slots; batches asked for are being made or sent
    CAUGHT_UP = "caught_up"  # every batch asked for made and sent; libzmq may still read a slot
    QUIET = "quiet"  # caught up and no slot in use: its slots may be lent after reclaim_idle_s
    LENT = "lent"  # its slots went to a stream that needed them while it asked for nothing
    STARVED = "starved"  # asked for more after lending its slots; waits for slots to come back
    ENDING = "ending"  # finished, failed or replaced: a task or a send still reads its slots
    ENDED = "ended"  # nothing of it is held any more


MAY_BECOME: Dict[Life, FrozenSet[Life]] = {
    Life.WAITING: frozenset({Life.RUNNING, Life.CAUGHT_UP, Life.QUIET, Life.ENDING, Life.ENDED}),
    Life.RUNNING: frozenset({Life.CAUGHT_UP, Life.QUIET, Life.ENDING, Life.ENDED}),
    Life.CAUGHT_UP: frozenset({Life.RUNNING, Life.QUIET, Life.ENDING, Life.ENDED}),
    Life.QUIET: frozenset({Life.RUNNING, Life.CAUGHT_UP, Life.LENT, Life.ENDING, Life.ENDED}),
    Life.LENT: frozenset({Life.RUNNING, Life.STARVED, Life.ENDED}),
    Life.STARVED: frozenset({Life.RUNNING, Life.ENDED}),
    Life.ENDING: frozenset({Life.ENDED}),
    Life.ENDED: frozenset(),
}


@dataclass(frozen=True)
class Asked:
    """What a stream has been asked so far, as the door reads it (any life)."""

    stream: int
    num_batches: int  # in its rank's plan
    window: int  # most batches asked and not yet sent (see :func:`window_of`)
    count: int  # batches asked (its order's length)
    sent: int  # of those, how many have been sent
    final: bool  # the client said nothing more will be asked
    has: Callable[[int], bool]  # whether a batch is asked already


@dataclass(frozen=True)
class Refusal:
    """Why a message is refused: the Error its stream ends with."""

    code: str
    message: str


def window_of(hello: P.Hello) -> int:
    """The most batches ``hello``'s stream may have asked and not yet been sent:
    the client's window where it says one (the ``RemoteLoader`` does), else ``MAX_WINDOW``, which
    bounds what any stream's asks keep in the service (~100 bytes a batch: ~1.6 MiB at most)."""
    return min(hello.window or P.MAX_WINDOW, P.MAX_WINDOW)


def check_request(msg: P.Request, a: Asked) -> Optional[Refusal]:
    """What is wrong with ``msg`` for the stream ``a`` describes, or None: it may be applied."""
    if not msg.batches:
        return None
    if a.final:
        return Refusal(P.ErrorCode.BAD_MESSAGE, (
            f"Request for {len(msg.batches)} batches on stream {a.stream} after its final Request"))
    unsent = a.count - a.sent + len(msg.batches)  # first: it bounds the work of the checks below
    if unsent > a.window:
        return Refusal(P.ErrorCode.BAD_MESSAGE, (
            f"Request takes stream {a.stream} to {unsent} batches asked and not yet sent, more than its window of "
            f"{a.window}; ask for a batch once one has come"))
    past = [b for b in msg.batches if b >= a.num_batches]
    if past:
        return Refusal(P.ErrorCode.BAD_JOB, past_the_end(max(past), a.num_batches))
    again = next((b for b in msg.batches if a.has(b)), None)
    if again is not None:
        return Refusal(P.ErrorCode.BAD_JOB, f"batch {again} is already part of stream {a.stream}")
    return None


def past_the_end(batch: int, num_batches: int) -> str:
    """The refusal of a batch asked for past the epoch's end (at Hello, or in a Request)."""
    return (f"batch {batch} is past the end of the epoch ({num_batches} batches here); does the client's plan "
            "come from another dataset (replicas serving different data)?")

