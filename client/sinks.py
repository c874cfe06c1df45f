"""Where received batches go: host tensors (CPU) or the pinned ring + side stream (CUDA).

A sink's life per epoch (:mod:`client.epoch`): ``receive`` the frames of each batch into host
memory as they arrive, in any order (the epoch's ordering window holds them) -> ``push`` them
*in plan order*, a few ahead of the trainer (on CUDA that issues the device copy, so
out-of-order batches never sit on the GPU) -> ``hand_over`` each batch as ``next()`` returns it
to the trainer -> ``end``, which also takes back the host memory of batches received and never
pushed (an epoch left early). A batch received that will never be pushed (a late copy from a
replica whose batches went to the others) is given back at once with ``drop``.

CPU path: the images tensor *is* libzmq's receive buffer (``recv(copy=False)`` wrapped by
``torch.frombuffer``): after the kernel's copy into that buffer nothing copies the pixels again,
and the tensor holds the message, so the trainer owns it like any tensor. (Receiving into a
fresh ``torch.empty`` instead costs a 10 MB memcpy per batch, plus page faults on memory that
glibc maps anew for every large allocation.) A co-located batch (``local=True``) is lent in place:
its tensors are views of the service's slot, handed back once the trainer lets go of them
(client/local.py).

CUDA path, and why it is race-free. Three guarantees, each one small method, each one removed
in turn by ``tests/cuda``'s mutant runs to show that a race test then fails:

* ring wait (``_wait_pinned_free``): ``receive`` reads the data frames straight from the socket
  into a free entry of the pinned ring (``recv_into``; libzmq copies once from its message into
  our buffer). There is one entry per batch the loader's window lets it hold, plus one; an entry
  is free again once its batch is pushed. Before an entry is overwritten the CPU waits on the
  event recorded after the H2D copy that last read it, so it is never rewritten while a copy may
  still be reading it. (A "slot" is always the service's batch memory, never the ring's.)
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

Co-located (``local=True``): where CUDA can page-lock the service's segment
(``cudaHostRegister``, once per mapping), the H2D copy reads the service's slot itself; no byte is
copied on the CPU, and the ring's entry only carries the labels. One more guarantee, removed by its
own mutant run: copy read (``_copy_has_read``): the service's slot is let go of (its ``Release``
queued) only once the copy that reads it has finished. Where registration fails, each batch is
copied from the slot into the ring's entry and handed back at once.

Bulk lanes (``lanes=N``): on a GPU the lanes receive each batch into page-locked buffers of their
own (client/lanes.py), and the H2D copy reads it there: the only CPU copy of its bytes is the
kernel's, from the socket. The same copy-read guarantee holds such a buffer (no lane may receive
into it again) until the copy that reads it has finished. Where this torch cannot page-lock,
each batch is copied from the lanes' buffer into the ring's entry instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Set, Tuple

import numpy as np
import torch
import zmq

from wire import protocol as P

from client.batch import Batch
from client.buffers import HostBuffers
from client.config import LoaderConfig
from client.errors import LoaderError
from client.lanes import Lanes, LanesLost
from client.local import CAN_LEND, Borrowed, Mapping, Mappings
from client.transform import Normalize

log = logging.getLogger("client")


Outputs = List[Tuple[str, Tuple[int, ...]]]  # (name, per-sample shape) of each frame, in order


def legacy_outputs(config: LoaderConfig) -> Outputs:
    """The one image output of a job that names no pipeline."""
    return [("image", (config.spec.image_size, config.spec.image_size, 3))]


def make_sink(config: LoaderConfig, held: int, outputs: Optional[Outputs] = None):
    """The sink for ``config.device`` (already ``"cpu"`` or an explicit ``"cuda:N"``: see
    :func:`client.config.resolve_device`); ``held``: the most received batches the loader holds
    before pushing them (its flow-control window); ``outputs``: what each batch carries (by
    default the built-in recipe's one image)."""
    outputs = outputs or legacy_outputs(config)
    return CudaSink(config, held, outputs) if config.device.startswith("cuda") else HostSink(config, held, outputs)


def can_register() -> bool:
    """Whether CUDA can page-lock memory this process mapped (``cudaHostRegister``)."""
    try:
        return torch.cuda.is_available() and hasattr(torch.cuda.cudart(), "cudaHostRegister")
    except (AssertionError, RuntimeError):  # a build without CUDA, or CUDA unusable here
        return False


def lends_in_place(config: LoaderConfig) -> bool:
    """Whether a co-located loader on ``config.device`` takes its batches in the service's slots
    (lent until the trainer, or the GPU's copy, is done with them) rather than copying them out."""
    if config.device.startswith("cuda"):
        return CudaSink.register and can_register()
    return CAN_LEND


def _normalizers(config: LoaderConfig, outputs: Outputs) -> Dict[str, "_PerOutput"]:
    """Output name -> its normalize, for the outputs ``config.normalize`` selects: True: every
    RGB output (last dimension 3); a list of names: those."""
    if config.normalize is False:
        return {}
    rgb = [name for name, shape in outputs if len(shape) >= 3 and shape[-1] == 3]
    chosen = rgb if config.normalize is True else list(config.normalize)
    bad = [n for n in chosen if n not in rgb]
    if bad:
        raise LoaderError(P.ErrorCode.BAD_JOB, f"normalize names {bad}, which are not RGB outputs (... x H x W x 3) "
                          f"of this pipeline; its outputs are {dict(outputs)}")
    norm = Normalize(config.mean, config.std, config.dtype)
    return {n: _PerOutput(norm) for n in chosen}


class _PerOutput:
    """Normalize for (N, ..., H, W, 3): leading dimensions folded into the batch one and back."""

    def __init__(self, norm: Normalize):
        self.norm = norm

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        if raw.dim() == 4:
            return self.norm(raw)
        lead, (h, w, c) = raw.shape[:-3], raw.shape[-3:]
        y = self.norm(raw.reshape(-1, h, w, c))
        return y.view(*lead, c, h, w)


def _check_outputs(msg: P.Batch, outputs: Outputs) -> List[Tuple[str, Tuple[int, ...]]]:
    """The batch's (name, frame shape) list, if it is what the loader expects."""
    got = msg.output_shapes()
    if [(n, s[1:]) for n, s in got] != outputs:  # (each shape a tuple on both sides: _as_declared)
        raise LoaderError(P.ErrorCode.BAD_MESSAGE, f"batch outputs {[(n, list(s[1:])) for n, s in got]} differ from "
                          f"the pipeline's declaration {[(n, list(s)) for n, s in outputs]}")
    return got


def _as_declared(outputs: Outputs) -> Outputs:
    """``outputs`` as :func:`_check_outputs` compares a batch's with: a list of (name, tuple)."""
    return [(name, tuple(shape)) for name, shape in outputs]


def _build(msg: P.Batch, names: List[str], raw: List[torch.Tensor], labels: torch.Tensor,
           normalize: Dict[str, "_PerOutput"]) -> Batch:
    outs = {n: (normalize[n](r) if n in normalize else r) for n, r in zip(names, raw)}
    return Batch(outs[names[0]], labels, list(msg.indices), msg.epoch, msg.index, raw[0], msg.padding, _skipped(msg),
                 outs, dict(zip(names, raw)))


def _recv_frames(sock: zmq.Socket, msg: P.Batch, outputs: List[torch.Tensor], labels: torch.Tensor) -> None:
    """Receive a Batch's data frames into ``outputs`` and ``labels`` (exact sizes; an output sent
    in several frames, ``msg.chunk`` bytes each, fills its buffer piece by piece)."""
    sizes = []
    for buf in (*outputs, labels):
        if buf.numel() == 0:
            sizes.append(_recv_size(sock, None))
            continue
        flat, at = buf.view(-1).view(torch.uint8).numpy(), 0
        for size in P.frame_sizes(flat.nbytes, msg.chunk if buf is not labels else 0):
            sizes.append(_recv_size(sock, flat[at:at + size]))
            at += size
    _check_rest(sock, msg, sizes)


def _check_rest(sock: zmq.Socket, msg: P.Batch, sizes: List[int]) -> None:
    """Read what is left of this message (a peer's extra frames), then check the sizes of all
    its data frames (``sizes``: those received so far)."""
    while sock.getsockopt(zmq.RCVMORE):
        sizes.append(len(sock.recv()))
    _check_sizes(msg, sizes)


_MISSING_FRAMES = "Batch message is missing data frames"


def _recv_size(sock: zmq.Socket, into: Optional[np.ndarray]) -> int:
    """The next frame of this message, into ``into`` (None: an empty buffer); its size."""
    if not sock.getsockopt(zmq.RCVMORE):
        raise LoaderError(P.ErrorCode.BAD_MESSAGE, _MISSING_FRAMES)
    return len(sock.recv()) if into is None else sock.recv_into(into)


def _from_lanes(lanes: Optional[Lanes], msg: P.Batch, timeout: float) -> np.ndarray:
    """The bytes of a batch sent on bulk lanes, once they are all here (LanesLost: they will not be)."""
    if lanes is None or lanes.number != msg.lane_set:  # sent on a set this connection let go of
        raise LanesLost(f"batch {msg.index} was sent on bulk lanes this connection no longer has", stale=True)
    return lanes.take(msg.stream, msg.index, msg.image_bytes, timeout)


def _split(data: np.ndarray, shapes: Outputs) -> List[torch.Tensor]:
    """One tensor per output over ``data``, the outputs' bytes one after another (no copy)."""
    raw, at = [], 0
    for _, shape in shapes:
        nbytes = math.prod(shape)
        raw.append(torch.from_numpy(data[at:at + nbytes]).view(shape) if nbytes  # from_numpy refuses no bytes
                   else torch.empty(shape, dtype=torch.uint8))
        at += nbytes
    return raw


def _copy_in_place(mappings: Mappings, msg: P.Batch, outputs: List[np.ndarray]) -> None:
    """A batch handed over in place (co-located, ``msg.local``): each output's block of the service's slot copied
    once into ``outputs`` (the Release that follows gives the slot back). The decode checked that
    each block is its output's size (``wire.protocol._check_local``), and the sink that the outputs
    are the loader's."""
    name, blocks = msg.local
    for dst, (offset, nbytes) in zip(outputs, blocks):
        if nbytes:
            np.copyto(dst.reshape(-1), mappings.block(name, offset, nbytes))


def _recv_labels(sock: zmq.Socket, msg: P.Batch) -> torch.Tensor:
    """The labels frame of a batch handed over in place (its only data frame), as a new tensor; a
    frame of another size, a missing or an extra one is refused (the message read to its end).
    Once per batch, on the co-located path whose trainer CPU is the point: the plain receive and
    two reads of RCVMORE, not the general ``_recv_frames`` (a third of the time)."""
    if not sock.getsockopt(zmq.RCVMORE):
        raise LoaderError(P.ErrorCode.BAD_MESSAGE, _MISSING_FRAMES)
    data = sock.recv()
    if not sock.getsockopt(zmq.RCVMORE) and len(data) == 8 * len(msg.indices):
        return torch.frombuffer(bytearray(data), dtype=torch.int64) if data else torch.empty(0, dtype=torch.int64)
    _check_rest(sock, msg, [len(data)])
    raise AssertionError("unreachable: the sizes were those of one labels frame")


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
    """CPU: every batch's tensors are its own; nothing is pinned. An output that came in one frame
    is that zmq message (no copy); one that came in several (``Batch.chunk``) is gathered into a
    host buffer that :class:`HostBuffers` reuses once the trainer has let go of it."""

    def __init__(self, config: LoaderConfig, held: int = 0, outputs: Optional[Outputs] = None):
        self.config = config
        self.outputs = _as_declared(outputs or legacy_outputs(config))
        self.normalize = _normalizers(config, self.outputs)
        self.buffers = HostBuffers(held + 2)  # the window, the batch the trainer holds, the one arriving
        # the service's segments, read-write where allowed: batches lent in place (co-located)
        self.mappings = Mappings(writable=True)
        self.h2d_s = 0.0

    def receive(self, sock: zmq.Socket, msg: P.Batch, borrowed: Optional[Borrowed] = None,
                lanes: Optional[Lanes] = None):
        """The batch's (outputs, labels). ``borrowed``: the connection's batches held in place,
        where a co-located batch's outputs are lent as views of the service's slot if it takes
        them (see client/local.py); otherwise they are copied out. ``lanes``: the connection's
        bulk lanes, where a batch sent on them (``msg.lanes``) lies: its outputs are views of the
        buffer the lanes received it into."""
        if msg.lanes:
            shapes = _check_outputs(msg, self.outputs)
            return _split(_from_lanes(lanes, msg, self.config.timeout), shapes), _recv_labels(sock, msg)
        if msg.local:
            shapes = _check_outputs(msg, self.outputs)
            name, blocks = msg.local  # one block per output, each its size (the protocol checked them)
            views = borrowed.lend(msg.stream, msg.index, name, self.mappings.mapping(name), blocks) \
                if borrowed is not None else None
            if views is not None:
                raw = [torch.from_numpy(v.reshape(shape)) for v, (_, shape) in zip(views, shapes)]  # numpy's reshape: a third of torch's view
                return raw, _recv_labels(sock, msg)
            raw = [self.buffers.take(math.prod(shape)).reshape(shape) for _, shape in shapes]
            _copy_in_place(self.mappings, msg, raw)
            return [torch.from_numpy(r) for r in raw], _recv_labels(sock, msg)
        *frames, label_frame = _recv_data_frames(sock, msg)
        raw, at = [], 0
        for _, shape in _check_outputs(msg, self.outputs):
            nbytes = math.prod(shape)
            parts = frames[at:at + P.frame_count(nbytes, msg.chunk)]
            at += len(parts)
            if not nbytes:
                raw.append(torch.empty(shape, dtype=torch.uint8))  # frombuffer refuses an empty buffer
            elif len(parts) == 1:
                raw.append(torch.frombuffer(parts[0].buffer, dtype=torch.uint8).view(shape))
            else:
                raw.append(torch.from_numpy(self.buffers.gather(parts, nbytes)).view(shape))
        labels = torch.from_numpy(np.frombuffer(label_frame.bytes, dtype=np.int64).copy())  # small; aligned copy
        return raw, labels

    def push(self, msg: P.Batch, payload) -> Batch:
        raw, labels = payload
        return _build(msg, [n for n, _ in self.outputs], raw, labels, self.normalize)

    def drop(self, payload) -> None:
        """A received batch that will not be pushed (a late copy): its tensors go with the payload."""

    def hand_over(self, batch: Batch) -> Batch:
        return batch  # host tensors need no ordering

    def end(self) -> None:
        pass

    def close(self) -> None:
        self.mappings.close()


class _Pinned:
    """One entry of the pinned ring: a batch's outputs and labels in page-locked host memory."""

    def __init__(self, nbytes: List[int], nlabels: int):
        # pinned while the loader's device is current (portable to every device under UVA)
        self.outputs = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in nbytes]
        self.labels = torch.empty(nlabels, dtype=torch.int64, pin_memory=True)
        self.copied: Optional[torch.cuda.Event] = None  # recorded after the H2D copy that read it


class CudaSink:
    """CUDA: pinned ring -> side-stream H2D copy -> normalize on the GPU -> hand-over."""

    register = True  # co-located: copy from the service's slot page-locked in place (where CUDA can)

    def __init__(self, config: LoaderConfig, held: int, outputs: Optional[Outputs] = None):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.index is None:
            raise ValueError(f"CudaSink needs an explicit device index, got {config.device!r}")
        self.outputs = _as_declared(outputs or legacy_outputs(config))
        self.normalize = _normalizers(config, self.outputs)
        self._output_bytes = [config.spec.batch_size * math.prod(shape) for _, shape in self.outputs]
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(device=self.device)
            # one entry per batch the loader may hold before pushing it, plus one to receive into
            self._ring = [_Pinned(self._output_bytes, config.spec.batch_size) for _ in range(held + 1)]
        self._free: Deque[_Pinned] = deque(self._ring)  # oldest copy first: most likely finished
        self._done: Dict[int, torch.cuda.Event] = {}  # batch index -> its copy + normalize finished
        self._handed: Optional[Tuple[int, torch.cuda.Event]] = None  # the last batch handed over (echo)
        # the service's segments, for batches handed over in place (co-located): read-write, so that
        # CUDA can page-lock them; unregistered before they are unmapped
        self.mappings = Mappings(writable=True, unmapping=self._unmapping)
        self.register = self.register and can_register()  # read lent slots straight from the service's memory
        self._pinned: Set[Mapping] = set()  # the mappings page-locked for the GPU
        # host memory not the ring's that a copy may still read (lent batches in the service's slot,
        # batches in the lanes' page-locked buffers): (that copy's event, their tensors)
        self._reading: Deque[Tuple[torch.cuda.Event, List[torch.Tensor]]] = deque()
        self.lent = 0  # co-located batches copied to the GPU straight from the service's slot
        self.lanes_in_place = 0  # batches copied to the GPU straight from the lanes' buffer
        self.pinned, self.pinning_s = 0, 0.0  # mappings page-locked; seconds in cudaHostRegister / Unregister
        self.settled, self.settle_s = 0, 0.0  # waits for copies from lent slots (a detach, an unmapping)
        self.h2d_s = 0.0

    def receive(self, sock: zmq.Socket, msg: P.Batch, borrowed: Optional[Borrowed] = None,
                lanes: Optional[Lanes] = None):
        """Into a free entry of the pinned ring. A batch sent on bulk lanes stays in the page-locked
        buffer the lanes received it into, kept until the copy that reads it is done (copied into
        the ring's entry where the lanes' buffers are not page-locked). A co-located batch: its
        outputs stay in the service's slot, lent (``borrowed``) until the copy that reads them is
        done, where the mapping can be registered; else copied from there into the ring's entry
        and handed back at once."""
        self._let_go_copied()
        shapes = _check_outputs(msg, self.outputs)
        if len(msg.indices) > self.config.spec.batch_size:
            raise LoaderError(P.ErrorCode.BAD_MESSAGE, f"batch of {len(msg.indices)} samples exceeds the loader's "
                              f"batch size ({self.config.spec.batch_size})")
        pinned = self._take_pinned()
        n = len(msg.indices)
        labels = pinned.labels[:n]
        try:
            lent = self._lend(msg, shapes, borrowed) if msg.local else None
            on_lanes = _from_lanes(lanes, msg, self.config.timeout) if msg.lanes else None
            kept = lent or (_split(on_lanes, shapes) if on_lanes is not None and lanes.pinned else None)
            host = kept or [buf[: math.prod(shape)].view(shape) for buf, (_, shape) in zip(pinned.outputs, shapes)]
            if msg.local and lent is None:  # one copy from the service's slot into the ring's entry
                _copy_in_place(self.mappings, msg, [h.numpy() for h in host])
            elif on_lanes is not None and kept is None:  # one copy from the lanes' buffer into the ring's entry
                for h, part in zip(host, _split(on_lanes, shapes)):
                    np.copyto(h.numpy(), part.numpy())
            _recv_frames(sock, msg, [] if msg.local or msg.lanes else host, labels)
        except BaseException:
            self._free.append(pinned)
            raise
        self.lent += lent is not None
        self.lanes_in_place += kept is not None and lent is None
        return pinned, host, labels, kept is not None

    def _lend(self, msg: P.Batch, shapes, borrowed: Optional[Borrowed]) -> Optional[List[torch.Tensor]]:
        """The batch's outputs as tensors over the service's slot, page-locked for the copy engine;
        None where it is to be copied out (no registration here, or ``borrowed`` declines)."""
        if borrowed is None or not self.register:
            return None
        name, blocks = msg.local
        m = self.mappings.mapping(name)
        if not self._registered(m):
            return None
        views = borrowed.lend(msg.stream, msg.index, name, m, blocks)
        if views is None:
            return None
        borrowed.settle = self.settle
        return [torch.from_numpy(v).view(shape) for v, (_, shape) in zip(views, shapes)]

    def _registered(self, m: Mapping) -> bool:
        """Page-lock mapping ``m`` for the GPU once (``cudaHostRegister``, portable to every
        device); False, and no more tries by this sink, where CUDA refuses."""
        if m in self._pinned:
            return True
        if not m.writable:
            return False
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            err = int(torch.cuda.cudart().cudaHostRegister(m.address, len(m.mm), 1))  # 1: cudaHostRegisterPortable
        self.pinning_s += time.perf_counter() - t0
        if err:
            log.warning("cannot page-lock the service's shared memory for the GPU (cudaError %d): co-located "
                        "batches are copied into the pinned ring instead", err)
            self.register = False
            return False
        self._pinned.add(m)
        self.pinned += 1
        return True

    def _unmapping(self, m: Mapping) -> None:
        """Before ``m`` is unmapped: no copy may read it any more, and CUDA forgets it."""
        if m in self._pinned:
            self._pinned.discard(m)
            self.settle()
            t0 = time.perf_counter()
            torch.cuda.cudart().cudaHostUnregister(m.address)
            self.pinning_s += time.perf_counter() - t0

    def _let_go_copied(self) -> None:
        """Let go of the batches held for a copy that has finished (a lent batch's Release is
        queued; a lanes' buffer may be received into again)."""
        while self._reading and self._copy_has_read(self._reading[0][0]):
            self._reading.popleft()

    def settle(self) -> None:
        """Wait for every copy from memory held for it, and let go of it all (before the
        connection moves on, or a mapping is unmapped)."""
        if self._reading:
            t0 = time.perf_counter()
            self.stream.synchronize()
            self._reading.clear()
            self.settled += 1
            self.settle_s += time.perf_counter() - t0

    def _take_pinned(self) -> _Pinned:
        if not self._free:
            raise LoaderError(P.ErrorCode.INTERNAL, "more batches received than the loader's window allows")
        pinned = self._free.popleft()
        if pinned.copied is not None:
            t0 = time.perf_counter()
            self._wait_pinned_free(pinned)
            self.h2d_s += time.perf_counter() - t0
        return pinned

    def push(self, msg: P.Batch, payload) -> Batch:
        pinned, host_outputs, host_labels, kept = payload
        t0 = time.perf_counter()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            raw = [h.to(self.device, non_blocking=True) for h in host_outputs]
            labels = host_labels.to(self.device, non_blocking=True)
            pinned.copied = torch.cuda.Event()
            pinned.copied.record(self.stream)
            batch = _build(msg, [n for n, _ in self.outputs], raw, labels, self.normalize)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._free.append(pinned)  # reusable once ``copied`` has fired (the ring wait checks)
        if kept:  # the service's slot, or the lanes' buffer, is held until this copy has read it
            self._reading.append((pinned.copied, host_outputs))
        del payload, host_outputs
        self._let_go_copied()
        self.h2d_s += time.perf_counter() - t0
        self._done[msg.index] = done
        return batch

    def drop(self, payload) -> None:
        """A received batch that will not be pushed (a late copy): its ring entry is free again (no
        copy read it), and what it kept (a lent slot, a lanes' buffer) goes with the payload."""
        self._free.appendleft(payload[0])

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
        self._keep_alive(batch.tensors(), current)
        return batch

    # The three guarantees, one small method each (tests/cuda replaces each with a no-op in
    # its mutant runs and expects a race test to fail).
    def _wait_pinned_free(self, pinned: _Pinned) -> None:
        pinned.copied.synchronize()  # the copy that last read this entry has finished

    @staticmethod
    def _order_after_copy(stream: torch.cuda.Stream, done: torch.cuda.Event) -> None:
        stream.wait_event(done)

    @staticmethod
    def _keep_alive(tensors, stream: torch.cuda.Stream) -> None:
        for t in tensors:
            t.record_stream(stream)

    @staticmethod
    def _copy_has_read(copied: torch.cuda.Event) -> bool:
        return copied.query()

    def end(self) -> None:
        self._done.clear()
        self._handed = None
        self.stream.synchronize()
        self._reading.clear()
        self._free = deque(self._ring)  # every copy has finished; batches not pushed are dropped

    def close(self) -> None:
        self.end()
        self._ring, self._free = [], deque()
        self.mappings.close()
