"""Co-located mode (issue 41): a trainer on the service's host reads its batches straight from the
slots the workers wrote, instead of receiving them over the socket.

* The service keeps a tiny **probe** segment in its shared memory holding its own name, named in
  every DatasetInfo (:func:`with_probe`). A client that can read it shares the service's
  /dev/shm (the same host, or a container sharing it) and asks for ``Hello.local``.
* A local stream's batch is **handed over** (:func:`hand_over`): the Batch message names the
  segment and each output's block in it (``Batch.local``), only the labels cross the socket, and
  the slot is *borrowed* by the client (``Stream.borrowed``): it stays in the stream's ``sending``
  set, as a batch that zmq still reads does. (Borrowed, never "lent": a *lent* stream is one
  whose slots went to another stream, :class:`~loader_service.dispatch.door.Life`.)
* The client copies the blocks out, or lends them to its trainer in place until it lets the batch
  go (client/local.py), and hands the batch back with a **Release** (:func:`release`), or
  takes it along in its next Request (``Request.released``: one message instead of two),
  checked like every client message: a batch that stream did not hand over is refused
  (``bad_release``) and ends that stream alone.
* A stream that ends (finished, failed, replaced) keeps what its client borrows: it may still be
  reading its last batches, and hands them back with Releases as usual (:func:`retired` finds the
  ended stream). Once the client **moves on** (its next Hello on that connection, or the
  connection gone, SIGKILL included), every slot its streams' client still borrowed is given back
  (:func:`give_back`, from :meth:`BatchMemory.moved_on`): the client reads a slot only between
  receiving its batch and sending the Release, on the same connection (before its next Hello or
  Bye it detaches what its trainer still holds into private memory), so once the service has
  read a newer Hello or seen the connection close, nothing of the old streams is read again
  (their batches still in flight are stale to the client, never read).

Pure bookkeeping beside the stream's :class:`~loader_service.dispatch.stream_state.StreamState`
(but :class:`Colocation`, the probe segment the I/O shell owns): the dispatch state calls it in
three places (sending, a Release, a Describe) and tells the batch memory when a client moves on.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional, Union

from wire import protocol as P
from loader_service.dispatch.door import Refusal
from loader_service.dispatch.sending import Outgoing
from loader_service.dispatch.stream_state import SendBatch
from loader_service.dispatch.streams import Stream
from loader_service.shm import NoSpace, Segment

log = logging.getLogger("loader_service.dispatch.local")

PROBE_BYTES = 4096


class Colocation:
    """The service's probe segment (none where shared memory cannot hold one: then no client is
    ever co-located, and all go over the socket)."""

    def __init__(self) -> None:
        self.probe: Optional[Segment] = None
        try:
            seg = Segment.create(PROBE_BYTES, tag="probe")
        except (OSError, NoSpace) as exc:
            log.warning("no co-located mode: cannot create a probe segment in shared memory: %s", exc)
            return
        name = seg.name.encode()
        seg.array("u1", (len(name),))[:] = list(name)
        self.probe = seg

    @property
    def name(self) -> str:
        return self.probe.name if self.probe is not None else ""

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None


def with_probe(info: P.Message, probe: str) -> P.Message:
    """A DatasetInfo with the probe named (other answers unchanged; no probe: no change)."""
    if isinstance(info, P.DatasetInfo) and probe:
        return dataclasses.replace(info, probe=probe)
    return info


def hand_over(s: Stream, e: SendBatch, out: Outgoing) -> Outgoing:
    """``out`` as a batch handed over in place: the message names the segment and each output's
    block, no output frame is sent, and the client borrows the slot until its Release (or until it
    moves on)."""
    assert s.segment is not None, "a stream sends from its own slots"
    s.borrowed[e.batch] = e.slot
    n, base = len(out.indices), e.slot * s.layout.slot_bytes
    blocks = [[base + o.offset, n * o.sample_bytes] for o in s.layout.outputs]
    message = dataclasses.replace(out.message, chunk=0, local=[s.segment.name, blocks])
    return dataclasses.replace(out, message=message, blocks=[])


def release(s: Stream, msg: P.Release) -> Union[List[int], Refusal]:
    """The slots ``msg`` hands back, or why it is refused (nothing is given back then)."""
    unknown = [b for b in msg.batches if b not in s.borrowed]
    if unknown or len(set(msg.batches)) != len(msg.batches):
        held = sorted(s.borrowed)
        return Refusal(P.ErrorCode.BAD_RELEASE, (
            f"Release of batch(es) {unknown[:8]} that stream {s.id} has not handed over (borrowed now: {held[:8]}"
            f"{' ...' if len(held) > 8 else ''}); a co-located client hands back each batch it received, once"))
    return [s.borrowed.pop(b) for b in msg.batches]


def retired(retiring: List[Stream], ident: bytes, stream: int) -> Optional[Stream]:
    """The ended stream ``stream`` of client ``ident`` whose slots are not back yet, if any."""
    return next((s for s in retiring if s.ident == ident and s.id == stream), None)


def give_back(s: Stream) -> None:
    """Its client moved on: every slot it still borrowed of ``s`` is free again (see the module doc)."""
    for slot in s.borrowed.values():
        s.state.send_complete(slot)
    s.borrowed.clear()


__all__ = ["Colocation", "give_back", "hand_over", "release", "retired", "with_probe"]
