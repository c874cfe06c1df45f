"""The client's half of the co-located mode (issue 41; the service's half: loader_service/dispatch/local.py).

A loader made with ``local=True`` checks each replica's probe (``DatasetInfo.probe``: a segment of
the service's shared memory holding its own name): one it can read shares this host's /dev/shm,
and its streams ask for ``Hello.local``. Their batches then name blocks of the service's slots
(``Batch.local``). A replica whose probe cannot be read (another host, a container without the
shared /dev/shm, another user) is served over the socket as usual.

Two ways to take a batch out of a slot:

* **in place** (the CPU sink, where the segment can be mapped read-write): the batch's tensors
  *are* views of the service's slot, no byte is copied. The slot stays borrowed while anything
  refers to them; once the trainer lets the batch go, :class:`Borrowed` queues its ``Release``.
  The trainer may write into them (the slot is its own until then). Two rules keep the service
  going and the tensors true:

  - the trainer never holds more than ``limit`` batches of a connection in place (its stream's
    slots but one): a batch received beyond that is copied out and handed back at once, so a
    trainer that keeps every batch (a list of them) costs a copy each, never a stalled stream;
  - before the connection moves on (its next Hello, its Bye: the service then takes back every
    slot the connection borrowed, see dispatch/local.py), every batch still held in place is
    **detached** (:func:`privatize`): its pages are replaced, at the same addresses, by a private
    copy (``mremap``), so the tensors the trainer holds keep their bytes and their addresses.

* **read by the GPU in place** (the CUDA sink, where CUDA can page-lock the mapping,
  ``cudaHostRegister``): the sink is the batch's only holder; its host-to-device copy reads the
  service's slot, and the slot is let go of once that copy is done (client/sinks.py).

* **copied** (the CUDA sink's pinned ring where the mapping cannot be registered; a read-only
  segment; a batch past the limit): one copy (:meth:`Mappings.block`), then the ``Release`` at once.

Mappings are cached by segment name (a stream's slots are one segment, reused by the connection's
next streams) and bounded (:data:`MAX_MAPPINGS`): the client creates no segment, so a client
killed at any point leaves nothing in /dev/shm.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import threading
import weakref
from collections import OrderedDict, deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from wire import protocol as P
from wire.segments import PREFIX, SHM_DIR

from client.errors import LoaderError

MAX_MAPPINGS = 4  # segments mapped at once; the least recently used is unmapped past it


def _path(name: str) -> str:
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"not a service segment: {name!r}")
    return os.path.join(SHM_DIR, name)


def _open(name: str, writable: bool) -> int:
    """A descriptor of segment ``name``: a regular file, reached by no symbolic link. /dev/shm is
    anyone's to write in: a FIFO under a segment's name would block a plain open for good, and a
    link would let a peer's name point the trainer's writes into batches at a file of its own."""
    fd = os.open(_path(name), (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{name} is not a regular file")
    return fd


def reachable(probe: str) -> bool:
    """Whether the service's probe segment is readable here and holds its own name: this process
    shares the service's shared memory."""
    if not probe:
        return False
    try:
        fd = _open(probe, writable=False)
    except (OSError, ValueError):
        return False
    with open(fd, "rb") as f:
        try:
            return f.read(len(probe.encode())) == probe.encode()
        except OSError:
            return False


class Mapping:
    """One segment mapped: ``writable`` (shared, read-write: batches may be lent in place) or not."""

    __slots__ = ("mm", "address", "writable", "stale")

    def __init__(self, mm: mmap.mmap, writable: bool):
        self.mm, self.writable = mm, writable
        self.stale = False  # some of its pages were detached: map the segment afresh for new batches
        if writable:
            probe = ctypes.c_char.from_buffer(mm)
            self.address = ctypes.addressof(probe)
            del probe  # an exported buffer would keep ``close`` from unmapping
        else:
            self.address = 0


class Mappings:
    """Mappings of the service's segments, by name (least recently used unmapped first).
    ``writable``: map read-write where the segment's mode allows (batches lent in place);
    read-only otherwise."""

    def __init__(self, keep: int = MAX_MAPPINGS, writable: bool = False,
                 unmapping: Optional[Callable[[Mapping], None]] = None):
        self.keep, self.writable = keep, writable
        self.unmapping = unmapping  # called before a mapping is closed (the CUDA sink unregisters it)
        self._maps: "OrderedDict[str, Mapping]" = OrderedDict()

    def block(self, name: str, offset: int, nbytes: int) -> np.ndarray:
        """A view of ``nbytes`` at ``offset`` of segment ``name`` (copy it before the Release: the
        slot is the service's again after that)."""
        m = self.mapping(name)
        check_block(name, m, offset, nbytes)
        return np.frombuffer(m.mm, dtype=np.uint8, count=nbytes, offset=offset)

    def mapping(self, name: str) -> Mapping:
        m = self._maps.get(name)
        if m is not None and not m.stale:
            self._maps.move_to_end(name)
            return m
        if m is not None:  # goes once the batches viewing it do
            del self._maps[name]
            self._close(m)
        m = _map(name, self.writable)
        self._maps[name] = m
        while len(self._maps) > self.keep:
            _, old = self._maps.popitem(last=False)
            self._close(old)
        return m

    def _close(self, m: Mapping) -> None:
        if self.unmapping is not None:
            self.unmapping(m)
        _close(m.mm)

    def close(self) -> None:
        maps, self._maps = list(self._maps.values()), OrderedDict()
        for m in maps:
            self._close(m)


def check_block(name: str, m: Mapping, offset: int, nbytes: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > len(m.mm):
        raise LoaderError(P.ErrorCode.BAD_MESSAGE, f"a batch handed over in place names bytes "
                          f"{offset}..{offset + nbytes} of segment {name}, which holds {len(m.mm)}")


class SlotsGone(LoaderError):
    """A batch handed over in place names a segment that no longer exists: its service stopped or
    restarted (and unlinked it, or a new service swept it) after sending the batch and before
    this loader first mapped it. The batch is still owed: it is asked for again on a new stream."""

    def __init__(self, name: str):
        super().__init__(P.ErrorCode.BAD_MESSAGE, (
            f"the service's shared memory {name!r} named by a batch handed over in place no longer exists "
            "(its service stopped or restarted since it sent the batch)"))
        self.name = name


def _map(name: str, writable: bool) -> Mapping:
    try:
        if writable:
            try:
                with open(_open(name, writable=True), "r+b") as f:
                    return Mapping(mmap.mmap(f.fileno(), 0), True)
            except PermissionError:  # another user's segment we may only read: batches are copied out
                pass
        with open(_open(name, writable=False), "rb") as f:
            return Mapping(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), False)
    except FileNotFoundError:
        raise SlotsGone(name) from None
    except (OSError, ValueError) as exc:
        raise LoaderError(P.ErrorCode.BAD_MESSAGE, (
            f"cannot map the service's shared memory {name!r} for a batch handed over in place: {exc}; is the service "
            f"on this host with the same /dev/shm? (RemoteLoader(local=False) receives over the socket)")) from None


class _Lent:
    """One batch held in place: where its bytes lie, and a weak reference to the array every tensor of it views."""

    __slots__ = ("mapping", "address", "nbytes", "view")

    def __init__(self, mapping: Mapping, address: int, nbytes: int, view: np.ndarray, let_go: Callable):
        self.mapping, self.address, self.nbytes = mapping, address, nbytes
        # ``let_go`` runs when the view dies, while this entry is held (a detach drops it first)
        self.view = weakref.ref(view, let_go)


class Borrowed:
    """The batches of one connection that the trainer holds in place, and the Releases of those it
    let go of (see the module doc). ``limit``: the most held at once (0: none, every batch copied)."""

    def __init__(self, limit: int = 0):
        self.limit = limit
        self._held: Dict[Tuple[int, int], _Lent] = {}  # (stream, batch) -> where it lies
        # let go of, Release not yet sent: read without the lock (a deque's truth is atomic) by
        # the checks that run several times per batch and mostly find nothing
        self.back: Deque[Tuple[int, int]] = deque()
        self._lock = threading.RLock()  # the trainer may drop a batch in another thread, or the GC inside a locked part
        self.detached = 0  # batches detached so far (a copy each)
        # what holds lent batches only until a copy of them is done (the CUDA sink) lets go of them
        # here, first thing in a detach: none of them is worth a private copy
        self.settle: Optional[Callable[[], None]] = None

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, stream: int, batch: int) -> bool:
        return (stream, batch) in self._held

    def lend(self, stream: int, batch: int, name: str, m: Mapping, blocks) -> Optional[List[np.ndarray]]:
        """Views of ``blocks`` ([offset, nbytes] each) of segment ``name``, held in place; None
        when this batch must be copied out instead (a read-only mapping, or ``limit`` reached)."""
        if not m.writable or len(self._held) >= self.limit or not blocks:
            return None
        if len(blocks) == 1:  # one output, the common case: no generators
            (lo, nbytes), = blocks
            check_block(name, m, lo, nbytes)
            hi = lo + nbytes
        else:
            for offset, nbytes in blocks:
                check_block(name, m, offset, nbytes)
            lo = min(o for o, _ in blocks)
            hi = max(o + n for o, n in blocks)
        # every output is a slice of this one array, so it lives exactly as long as the batch's tensors
        whole = np.frombuffer(m.mm, dtype=np.uint8, count=hi - lo, offset=lo)
        key = (stream, batch)
        with self._lock:
            self._held[key] = _Lent(m, m.address + lo, hi - lo, whole, lambda _: self._let_go(key))
        return [whole[o - lo:o - lo + n] for o, n in blocks]

    def _let_go(self, key: Tuple[int, int]) -> None:
        with self._lock:
            if self._held.pop(key, None) is not None:
                self.back.append(key)

    def releases(self, keep: Optional[int] = None) -> Dict[int, List[int]]:
        """Stream -> the batches let go of since the last call (their Releases to send); those of
        stream ``keep`` stay for a later call."""
        out: Dict[int, List[int]] = {}
        if not self.back:  # the common case: no lock to take
            return out
        with self._lock:
            kept = []
            while self.back:
                key = self.back.popleft()
                if key[0] == keep:
                    kept.append(key)
                else:
                    out.setdefault(key[0], []).append(key[1])
            self.back.extend(kept)
        return out

    def room_without_releases(self, stream: int, slots: int, owed: int) -> bool:
        """Whether the ``slots`` of ``stream`` hold every batch this connection keeps of it in
        place (let go of or not: what a Release would free) and the ``owed`` ones (asked for, not
        received: each has a slot, or takes one) together. Then the service needs no Release of
        this stream to go on with what it was asked."""
        with self._lock:
            kept = sum(1 for s, _ in self._held if s == stream) + sum(1 for s, _ in self.back if s == stream)
        return kept + owed <= slots

    def detach(self) -> None:
        """Give every batch still held its own private copy, in place: the connection moves on and
        the service takes back its slots once it reads what follows. They are no longer borrowed,
        and their mappings are not used for new batches (the pages around them changed too)."""
        if self.settle is not None:
            self.settle()
        with self._lock:
            held, self._held = list(self._held.values()), {}
            self.back.clear()
        for lent in held:
            view = lent.view()  # keeps the mapping mapped while its pages are replaced
            if view is None:
                continue
            lent.mapping.stale = True
            privatize(lent.address, lent.nbytes)
            self.detached += 1
            del view


# ------------------------------------------------------------------ detaching a batch held in place
PAGE = mmap.PAGESIZE
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)
# lending in place needs mremap (Linux) to detach; elsewhere every co-located batch is copied out
CAN_LEND = hasattr(_libc, "mremap")
if CAN_LEND:
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    _libc.mremap.restype = ctypes.c_void_p
    _libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def privatize(address: int, nbytes: int) -> None:
    """Replace the pages holding ``nbytes`` at ``address`` by a private copy of them, at the same
    addresses: what views them keeps its bytes, and the shared memory below is no longer read. The
    first and last pages are shared with the neighbouring slots' bytes: those are copied too, which
    is why the mapping is not used for new views afterwards (``Mapping.stale``)."""
    start = address - address % PAGE
    length = -(-(address + nbytes - start) // PAGE) * PAGE
    tmp = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if tmp in (None, _MAP_FAILED):
        raise _os_error("mmap")
    ctypes.memmove(tmp, start, length)
    moved = _libc.mremap(tmp, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, ctypes.c_void_p(start))
    if moved in (None, _MAP_FAILED):
        err = _os_error("mremap")
        _libc.munmap(tmp, length)
        raise err


def _os_error(call: str) -> LoaderError:
    e = ctypes.get_errno()
    return LoaderError(P.ErrorCode.INTERNAL, f"cannot detach a batch held in place from the service's shared memory "
                       f"({call}: {os.strerror(e)}); RemoteLoader(local=False) receives over the socket")


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view still exported (a copy in progress elsewhere): unmapped when it goes
        pass


__all__ = ["CAN_LEND", "Borrowed", "Mappings", "SlotsGone", "privatize", "reachable"]
