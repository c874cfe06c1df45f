"""Where received batches go: host tensors (CPU) or the pinned ring + side stream (CUDA).

A sink's life per epoch: ``receive`` the frames of each batch into host memory as they arrive,
in any order (the loader's reorder buffer holds them) -> ``push`` them *in plan order*, a few
ahead of the trainer (on CUDA that issues the device copy, so out-of-order batches never sit
on the GPU) -> ``hand_over`` each batch as ``next()`` returns it to the trainer -> ``end``.
A received batch the loader will not push (its epoch was left early) goes back with ``discard``.

CPU path: the images tensor *is* libzmq's receive buffer (``recv(copy=False)`` wrapped by
``torch.frombuffer``): after the kernel's copy into that buffer nothing copies the pixels again,
and the tensor holds the message, so the trainer owns it like any tensor. (Receiving into a
fresh ``torch.empty`` instead costs a 10 MB memcpy per batch, plus page faults on memory that
glibc maps anew for every large allocation.)

CUDA path, and why it is race-free. Three guarantees, each one small method, each one removed
in turn by ``tests/cuda``'s mutant runs to show that a race test then fails:

* slot wait (``_wait_slot_free``): ``receive`` reads the data frames straight from the socket
  into a free pinned slot (``recv_into``; libzmq copies once from its message into our
  buffer). There is one slot per batch the loader's window lets it hold, plus one; a slot is
  free again once its batch is pushed. Before a slot is overwritten the CPU waits on the event
  recorded after the H2D copy that last read it, so a slot is never rewritten while a copy may
  still be reading it.
* ``push`` issues the copy with ``non_blocking=True`` on a dedicated side stream of the
  loader's device, normalizes there too, and records a ``done`` event.
* stream wait (``_order_after_copy``): ``hand_over``, called as ``next()`` returns the batch,
  makes the stream *current at that moment* wait on ``done``: the trainer's kernels start
  after the copy and the normalize. Not earlier (waits on future batches would land on the
  compute stream before their time) and not on a stream chosen at receive time.
* allocator guard (``_keep_alive``): ``hand_over`` also calls ``record_stream(current)`` on
  every tensor it hands over. They were allocated on the side stream; without it the caching
  allocator could give their memory to the next side-stream allocation as soon as the trainer
  drops them, while kernels queued on the compute stream still read them. (record_stream
  rather than held references: the trainer decides when a batch dies, not us.)

The stream rule for the trainer: use a batch on the stream that is current (for the loader's
device) when ``next()`` returns it. To use it on another stream, do what you would for any
tensor: ``other.wait_stream(current)`` and ``t.record_stream(other)``. With ``echo > 1`` each
repeat is handed over again, on the stream current at that repeat.

Copies run ahead: the loader pushes up to ``device_prefetch`` batches beyond the one the
trainer holds, in plan order, so the copy of batch k+1 overlaps step k.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import numpy as np
import torch
import zmq

from loader_service import protocol as P

from .batch import Batch
from .config import LoaderConfig
from .errors import LoaderError
from .transform import Normalize


def make_sink(config: LoaderConfig, held: int):
    """The sink for ``config.device`` (already ``"cpu"`` or an explicit ``"cuda:N"``: see
    :func:`client.config.resolve_device`); ``held``: the most received batches the loader holds
    before pushing them (its flow-control window)."""
    return CudaSink(config, held) if config.device.startswith("cuda") else HostSink(config, held)


def _recv_frames(sock: zmq.Socket, msg: P.Batch, images: torch.Tensor, labels: torch.Tensor) -> None:
    """Receive a Batch's two data frames into ``images`` and ``labels`` (exact sizes)."""
    sizes = []
    for buf in (images, labels):
        if not sock.getsockopt(zmq.RCVMORE):
            raise LoaderError(P.ErrorCode.BAD_MESSAGE, "Batch message is missing data frames")
        if buf.numel() == 0:
            sizes.append(len(sock.recv()))
        else:
            sizes.append(sock.recv_into(buf.numpy()))
    extra = 0
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv()
        extra += 1
    _check_sizes(msg, sizes + [0] * extra)


def _recv_data_frames(sock: zmq.Socket, msg: P.Batch) -> List[zmq.Frame]:
    """The rest of a Batch message as zmq frames, without copying; sizes checked."""
    frames = []
    while sock.getsockopt(zmq.RCVMORE):
        frames.append(sock.recv(copy=False))
    _check_sizes(msg, [f.buffer.nbytes for f in frames])
    return frames


def _check_sizes(msg: P.Batch, sizes: List[int]) -> None:
    try:
        P.check_data_sizes(msg, sizes)
    except P.ProtocolError as exc:
        raise LoaderError(exc.code, f"malformed batch from the service: {exc}") from None


def _skipped(msg: P.Batch) -> List[Tuple[int, str]]:
    return [(int(i), str(r)) for i, r in msg.skipped]


class HostSink:
    """CPU: every batch's tensors are its own (the images wrap its zmq message); nothing is pinned."""

    def __init__(self, config: LoaderConfig, held: int = 0):
        self.config = config
        self.normalize = Normalize(config.mean, config.std, config.dtype) if config.normalize else None
        self.h2d_s = 0.0

    def receive(self, sock: zmq.Socket, msg: P.Batch):
        image_frame, label_frame = _recv_data_frames(sock, msg)
        if msg.image_bytes:
            images = torch.frombuffer(image_frame.buffer, dtype=torch.uint8).view(msg.shape)
        else:
            images = torch.empty(msg.shape, dtype=torch.uint8)  # frombuffer refuses an empty buffer
        labels = torch.from_numpy(np.frombuffer(label_frame.bytes, dtype=np.int64).copy())  # small; aligned copy
        return images, labels

    def push(self, msg: P.Batch, payload) -> Batch:
        raw, labels = payload
        images = self.normalize(raw) if self.normalize is not None else raw
        return Batch(images, labels, list(msg.indices), msg.epoch, msg.index, raw, msg.padding, _skipped(msg))

    def discard(self, payload) -> None:
        pass  # the tensors own their memory

    def hand_over(self, batch: Batch) -> Batch:
        return batch  # host tensors need no ordering

    def end(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Slot:
    def __init__(self, nbytes: int, nlabels: int):
        # pinned while the loader's device is current (portable to every device under UVA)
        self.images = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self.labels = torch.empty(nlabels, dtype=torch.int64).pin_memory()
        self.copied: Optional[torch.cuda.Event] = None  # recorded after the H2D copy that read it


class CudaSink:
    """CUDA: pinned ring -> side-stream H2D copy -> normalize on the GPU -> hand-over."""

    def __init__(self, config: LoaderConfig, held: int):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.index is None:
            raise ValueError(f"CudaSink needs an explicit device index, got {config.device!r}")
        self.normalize = Normalize(config.mean, config.std, config.dtype) if config.normalize else None
        self._slot_bytes = config.batch_size * config.image_size * config.image_size * 3
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(device=self.device)
            # one slot per batch the loader may hold before pushing it, plus one to receive into
            self._slots = [_Slot(self._slot_bytes, config.batch_size) for _ in range(held + 1)]
        self._free: Deque[_Slot] = deque(self._slots)  # oldest copy first: most likely finished
        self._done: Dict[int, torch.cuda.Event] = {}  # batch index -> its copy + normalize finished
        self._handed: Optional[Tuple[int, torch.cuda.Event]] = None  # the last batch handed over (echo)
        self.h2d_s = 0.0

    def receive(self, sock: zmq.Socket, msg: P.Batch):
        if msg.image_bytes > self._slot_bytes or len(msg.indices) > self.config.batch_size:
            raise LoaderError(P.ErrorCode.BAD_MESSAGE, f"batch of shape {msg.shape} exceeds the loader's slots")
        slot = self._take_slot()
        n = len(msg.indices)
        images = slot.images[: msg.image_bytes].view(msg.shape)
        labels = slot.labels[:n]
        try:
            _recv_frames(sock, msg, images, labels)
        except BaseException:
            self._free.append(slot)
            raise
        return slot, images, labels

    def _take_slot(self) -> _Slot:
        if not self._free:
            raise LoaderError(P.ErrorCode.INTERNAL, "more batches received than the loader's window allows")
        slot = self._free.popleft()
        if slot.copied is not None:
            t0 = time.perf_counter()
            self._wait_slot_free(slot)
            self.h2d_s += time.perf_counter() - t0
        return slot

    def push(self, msg: P.Batch, payload) -> Batch:
        slot, host_images, host_labels = payload
        t0 = time.perf_counter()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            raw = host_images.to(self.device, non_blocking=True)
            labels = host_labels.to(self.device, non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(self.stream)
            images = self.normalize(raw) if self.normalize is not None else raw
            done = torch.cuda.Event()
            done.record(self.stream)
        self._free.append(slot)  # reusable once ``copied`` has fired (the slot wait checks)
        self.h2d_s += time.perf_counter() - t0
        self._done[msg.index] = done
        return Batch(images, labels, list(msg.indices), msg.epoch, msg.index, raw, msg.padding, _skipped(msg))

    def discard(self, payload) -> None:
        self._free.append(payload[0])

    def hand_over(self, batch: Batch) -> Batch:
        """Order ``batch`` before the trainer's work on the stream current now; see the module doc."""
        done = self._done.pop(batch.index, None)
        if done is None:
            if self._handed is None or self._handed[0] != batch.index:
                raise LoaderError(P.ErrorCode.INTERNAL, f"batch {batch.index} handed over but never pushed")
            done = self._handed[1]  # echo: the same batch again
        self._handed = (batch.index, done)
        current = torch.cuda.current_stream(self.device)
        self._order_after_copy(current, done)
        self._keep_alive({id(x): x for x in (batch.images, batch.raw, batch.labels)}.values(), current)
        return batch

    # The three guarantees, one small method each (tests/cuda replaces each with a no-op in
    # its mutant runs and expects a race test to fail).
    def _wait_slot_free(self, slot: _Slot) -> None:
        slot.copied.synchronize()  # the copy that last read this slot has finished

    @staticmethod
    def _order_after_copy(stream: torch.cuda.Stream, done: torch.cuda.Event) -> None:
        stream.wait_event(done)

    @staticmethod
    def _keep_alive(tensors, stream: torch.cuda.Stream) -> None:
        for t in tensors:
            t.record_stream(stream)

    def end(self) -> None:
        self._done.clear()
        self._handed = None
        self.stream.synchronize()
        self._free = deque(self._slots)  # every copy has finished; batches not pushed are dropped

    def close(self) -> None:
        self.end()
        self._slots, self._free = [], deque()
