"""Where received batches go: host tensors (CPU) or the pinned ring + side stream (CUDA).

A sink's life per epoch: ``begin`` -> (``receive`` frames of one batch into host memory,
``push`` it, then take what ``ready`` yields) per batch -> ``end``.

CPU path: the images tensor *is* libzmq's receive buffer (``recv(copy=False)`` wrapped by
``torch.frombuffer``): after the kernel's copy into that buffer nothing copies the pixels again,
and the tensor holds the message, so the trainer owns it like any tensor. (Receiving into a
fresh ``torch.empty`` instead costs a 10 MB memcpy per batch, plus page faults on memory that
glibc maps anew for every large allocation.)

CUDA path, and why it is race-free:

* ``receive`` reads the data frames straight from the socket into a pinned ring slot
  (``recv_into``; libzmq copies once from its message into our buffer). Before a slot is
  overwritten we wait on the event recorded after the H2D copy that last read it, so a slot is
  never reused while a copy may still be reading it.
* ``push`` issues the copy with ``non_blocking=True`` on a dedicated side stream, then
  normalizes there too, and records an event.
* ``ready`` hands a batch over only after making the consumer's current stream wait on that
  event, and calls ``record_stream(current)`` on every tensor it hands over. The tensors were
  allocated on the side stream; without record_stream the caching allocator could give their
  memory to the next side-stream allocation as soon as the trainer drops them, while kernels
  queued on the compute stream still read them. (We use record_stream rather than holding
  references because the trainer decides when a batch dies, not us.)
* ``device_prefetch`` batches are copied ahead, so the copy of batch k+1 overlaps step k.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, Iterator, List, Optional, Tuple

import numpy as np
import torch
import zmq

from loader_service import protocol as P

from .batch import Batch
from .config import LoaderConfig
from .errors import LoaderError
from .transform import Normalize


def make_sink(config: LoaderConfig):
    device = torch.device(config.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LoaderError("bad_device", f"device={config.device!r} but CUDA is not available in this torch "
                              f"build ({torch.__version__}); use device='cpu'")
        return CudaSink(config, device)
    if device.type != "cpu":
        raise ValueError(f"unsupported device {config.device!r}: use 'cpu' or 'cuda[:N]'")
    return HostSink(config)


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

    def __init__(self, config: LoaderConfig):
        self.config = config
        self.normalize = Normalize(config.mean, config.std, config.dtype) if config.normalize else None
        self._pending: Deque[Batch] = deque()

    def begin(self, n: int) -> None:
        self._pending.clear()

    def receive(self, sock: zmq.Socket, msg: P.Batch):
        image_frame, label_frame = _recv_data_frames(sock, msg)
        if msg.image_bytes:
            images = torch.frombuffer(image_frame.buffer, dtype=torch.uint8).view(msg.shape)
        else:
            images = torch.empty(msg.shape, dtype=torch.uint8)  # frombuffer refuses an empty buffer
        labels = torch.from_numpy(np.frombuffer(label_frame.bytes, dtype=np.int64).copy())  # small; aligned copy
        return images, labels

    def push(self, msg: P.Batch, payload) -> None:
        raw, labels = payload
        images = self.normalize(raw) if self.normalize is not None else raw
        self._pending.append(Batch(images, labels, list(msg.indices), msg.epoch, msg.index, raw,
                                   msg.padding, _skipped(msg)))

    def ready(self, final: bool) -> Iterator[Batch]:
        while self._pending:
            yield self._pending.popleft()

    def end(self) -> None:
        self._pending.clear()

    def close(self) -> None:
        self._pending.clear()


class _Slot:
    def __init__(self, nbytes: int, nlabels: int):
        self.images = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self.labels = torch.empty(nlabels, dtype=torch.int64).pin_memory()
        self.copied: Optional[torch.cuda.Event] = None  # recorded after the H2D copy that read it


class CudaSink:
    """CUDA: pinned ring -> side-stream H2D copy -> normalize on the GPU."""

    def __init__(self, config: LoaderConfig, device: torch.device):
        self.config, self.device = config, device
        self.normalize = Normalize(config.mean, config.std, config.dtype) if config.normalize else None
        self.stream = torch.cuda.Stream(device=device)
        self._slot_bytes = config.batch_size * config.image_size * config.image_size * 3
        # one slot per batch whose copy may be in flight, plus the one being received
        self._ring = [_Slot(self._slot_bytes, config.batch_size) for _ in range(config.device_prefetch + 1)]
        self._next_slot = 0
        self._inflight: Deque[Tuple[Batch, torch.cuda.Event]] = deque()
        self.h2d_s = 0.0

    def begin(self, n: int) -> None:
        self._inflight.clear()

    def receive(self, sock: zmq.Socket, msg: P.Batch):
        if msg.image_bytes > self._slot_bytes or len(msg.indices) > self.config.batch_size:
            raise LoaderError(P.ErrorCode.BAD_MESSAGE, f"batch of shape {msg.shape} exceeds the loader's slots")
        slot = self._ring[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._ring)
        if slot.copied is not None:
            t0 = time.perf_counter()
            slot.copied.synchronize()  # the copy that last read this slot has finished
            self.h2d_s += time.perf_counter() - t0
        n = len(msg.indices)
        images = slot.images[: msg.image_bytes].view(msg.shape)
        labels = slot.labels[:n]
        _recv_frames(sock, msg, images, labels)
        return slot, images, labels

    def push(self, msg: P.Batch, payload) -> None:
        slot, host_images, host_labels = payload
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            raw = host_images.to(self.device, non_blocking=True)
            labels = host_labels.to(self.device, non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(self.stream)
            images = self.normalize(raw) if self.normalize is not None else raw
            done = torch.cuda.Event()
            done.record(self.stream)
        self.h2d_s += time.perf_counter() - t0
        batch = Batch(images, labels, list(msg.indices), msg.epoch, msg.index, raw, msg.padding, _skipped(msg))
        self._inflight.append((batch, done))

    def ready(self, final: bool) -> Iterator[Batch]:
        keep = 0 if final else self.config.device_prefetch - 1
        while len(self._inflight) > keep:
            batch, done = self._inflight.popleft()
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)  # the trainer's kernels start after the copy + normalize
            for t in {id(x): x for x in (batch.images, batch.raw, batch.labels)}.values():
                t.record_stream(current)
            yield batch

    def end(self) -> None:
        self._inflight.clear()
        self.stream.synchronize()

    def close(self) -> None:
        self._inflight.clear()
        self._ring = []
