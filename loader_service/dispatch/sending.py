"""Sending a batch: where its outputs lie in a slot, the message that describes it, and frames
that libzmq reads from the slot itself.

A stream's :class:`BatchLayout` is computed once, when the stream is admitted, from the
pipeline's own layout (the one its workers write by), so sending never asks the pipeline for
sizes again. :func:`outgoing` turns a :class:`~loader_service.dispatch.stream_state.SendBatch`
into the Batch message and the blocks of the slot to send (pure); :func:`compact` and
:func:`frame` are the two steps that touch the slot.

A large frame is sent zero-copy: libzmq reads the slot while the dispatcher goes on. The frame
holds a numpy view of the slot, so the segment cannot be unmapped under it (closing raises
BufferError), and when libzmq releases the frame pyzmq drops that view: a ``weakref.finalize``
on it reports the send complete through ``on_sent``. No polling: the report arrives from
pyzmq's garbage-collection thread, and the caller hands it to the dispatcher's loop.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
import zmq

from wire import protocol as P
from wire.plan import RankPlan
from loader_service.decode.pipelines import JobPipeline
from loader_service.dispatch.stream_state import SendBatch
from loader_service.shm import Segment


@dataclass(frozen=True)
class Output:
    """One output's block in a slot: ``capacity`` samples of ``shape``, from ``offset``."""

    name: str
    shape: Tuple[int, ...]  # per sample
    offset: int  # bytes from the start of the slot
    sample_bytes: int


@dataclass(frozen=True)
class BatchLayout:
    """Where a stream's outputs lie in each of its slots, and how the wire names them."""

    capacity: int  # samples a slot holds: the batch size
    outputs: Tuple[Output, ...]  # in frame order
    named: bool  # a named pipeline: the Batch message lists every output

    @classmethod
    def of(cls, pipe: JobPipeline, capacity: int) -> "BatchLayout":
        outputs = tuple(Output(name, tuple(shape), off, math.prod(shape))
                        for name, shape, off in pipe.pipeline.layout(capacity))
        return cls(capacity, outputs, pipe.named)

    @property
    def slot_bytes(self) -> int:
        return self.capacity * sum(o.sample_bytes for o in self.outputs)

    def shape(self, n: int) -> List[int]:
        """The Batch message's ``shape`` for ``n`` samples: ``[n]`` when the outputs are named,
        else the one output's ``[n, *per-sample shape]`` (the original wire shape)."""
        return [n] if self.named else [n, *self.outputs[0].shape]

    def wire_outputs(self) -> list:
        """The Batch message's ``outputs``: ``[[name, per-sample shape], ...]``, or ``[]``."""
        return [[o.name, list(o.shape)] for o in self.outputs] if self.named else []


@dataclass(frozen=True)
class Outgoing:
    """What to send for one batch."""

    message: P.Batch
    indices: np.ndarray  # the dataset indices sent, in order
    keep: Optional[np.ndarray]  # positions kept, when samples were skipped (None: all)
    blocks: List[Tuple[int, int]]  # (offset in the segment, bytes) of each data frame of the outputs, in order


def outgoing(layout: BatchLayout, plan: RankPlan, stream: int, epoch: int, e: SendBatch) -> Outgoing:
    """The Batch message for ``e`` and the blocks of its slot to send: skipped samples left out
    (their positions in ``keep``; with ``e.compact`` the slot must be compacted first)."""
    indices, padding = plan.batch(e.batch), plan.batch_padding(e.batch)
    keep, skipped = None, []
    if e.skipped:
        keep = np.ones(len(indices), dtype=bool)
        for pos, idx, reason in e.skipped:
            keep[pos] = False
            skipped.append([idx, reason])
        indices, padding = indices[keep], padding[keep]
    n = len(indices)
    chunk = P.FRAME_MAX_BYTES if any(n * o.sample_bytes > P.FRAME_MAX_BYTES for o in layout.outputs) else 0
    message = P.Batch(stream=stream, epoch=epoch, index=e.batch, indices=indices.tolist(), shape=layout.shape(n),
                      padding=int(padding.sum()), skipped=skipped, outputs=layout.wire_outputs(), chunk=chunk)
    base = e.slot * layout.slot_bytes
    blocks = []
    for o in layout.outputs:  # an output above FRAME_MAX_BYTES in several frames (see wire.protocol)
        at = base + o.offset
        for size in P.frame_sizes(n * o.sample_bytes, chunk):
            blocks.append((at, size))
            at += size
    return Outgoing(message, indices, keep, blocks)


def compact(segment: Segment, layout: BatchLayout, slot: int, keep: np.ndarray) -> None:
    """Move the kept samples of ``slot`` to the front of every output's block (one-sample tasks
    wrote each sample at its position, gaps included)."""
    kept = int(keep.sum())
    for o in layout.outputs:
        view = segment.array(np.uint8, (len(keep), o.sample_bytes), slot * layout.slot_bytes + o.offset)
        view[:kept] = view[keep]  # boolean indexing copies first: safe to overlap
        del view


def frame(segment: Segment, offset: int, nbytes: int,
          on_sent: Callable[[], None]) -> Tuple[Union[zmq.Frame, bytes], bool]:
    """What to send for ``nbytes`` of ``segment`` at ``offset``, and whether it is zero-copy.
    For a zero-copy frame ``on_sent`` runs (on another thread) once libzmq is done with it;
    a small frame is copied, so the slot is free as soon as this returns."""
    view = segment.array(np.uint8, (nbytes,), offset)
    if nbytes < P.ZERO_COPY_MIN_BYTES:
        return view.tobytes(), False
    return _reported(view, on_sent), True


def start_letting_go() -> None:
    """Start what reports each zero-copy frame libzmq lets go of: pyzmq's garbage-collection
    thread, with a zmq context of its own (an I/O thread: 6 descriptors), and the socket the
    reports go to it on (one more). The first zero-copy frame starts them; made lazily by a
    client's first tracked Accept or large batch, they would count as that client's and outlive
    it. One frame made and dropped here, so they are the service's from its start."""
    frame = zmq.Frame(np.zeros(1, dtype=np.uint8), copy=False)
    del frame


def tracked(data: bytes, on_sent: Callable[[], None]) -> zmq.Frame:
    """``data`` as a zero-copy frame, however small, so that ``on_sent`` runs (on another thread)
    once libzmq lets go of it: by then everything queued before it on its connection has gone to
    the kernel (one pipe, sent in order), or the connection is gone."""
    return _reported(np.frombuffer(data, dtype=np.uint8), on_sent)


def _reported(view: np.ndarray, on_sent: Callable[[], None]) -> zmq.Frame:
    """``view`` as a zero-copy frame; ``on_sent`` runs once pyzmq drops the view (libzmq let go)."""
    weakref.finalize(view, on_sent)
    return zmq.Frame(view, copy=False)


__all__ = ["BatchLayout", "Outgoing", "Output", "compact", "frame", "outgoing", "start_letting_go", "tracked"]
