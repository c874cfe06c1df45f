"""Named shared-memory segments for batch slots and dataset indexes.

Plain files in /dev/shm mapped with mmap, instead of ``multiprocessing.shared_memory``: on
Python < 3.13 every process that attaches to a SharedMemory registers it with the resource
tracker, which then warns about or unlinks segments it does not own. Here the creator owns
the name and unlinks it (in ``finally`` blocks); attachers only map it. Names carry the
creator's pid so :func:`sweep_stale` can remove what a SIGKILLed service left behind.

A segment holds no file descriptor once mapped: Python's ``mmap`` (before 3.13's ``trackfd``)
keeps a duplicate of the file's descriptor for its lifetime, one per segment, so 10,000 streams
(a connection flood, issue 32) took 10,000 descriptors besides their connections, and the
dispatcher ran out (``EMFILE``) within its limit. Segments are mapped with libc's ``mmap``
instead, and unmapped only once no view of them is left (:meth:`Segment.close`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import uuid
from typing import Optional

import numpy as np

from wire.segments import PREFIX, SHM_DIR


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """A shared mapping of a file that keeps no descriptor. Every view of it is made from
    :attr:`view`, and each one keeps :attr:`_memory` referenced, so :meth:`close` knows
    whether one is left before it unmaps."""

    def __init__(self, fd: int, size: int, writable: bool = True):
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        addr = _libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
        self._addr, self._size = addr, size
        self._memory = (ctypes.c_char * size).from_address(addr)
        view = memoryview(self._memory).cast("B")
        self.view: Optional[memoryview] = view if writable else view.toreadonly()
        self._views = sys.getrefcount(self._memory)  # the references made above: no view beyond ``view``
        self.closed = False

    def close(self) -> None:
        """Unmap; raises BufferError while a view (a slice, a numpy array, a zmq frame) is left."""
        if self.closed:
            return
        if self.view is not None:
            self.view.release()  # BufferError while a numpy array or a zmq frame holds it
            self.view = None
        if sys.getrefcount(self._memory) > self._views - 1:  # a slice of ``view`` outlives it
            raise BufferError("cannot unmap a segment while a view of it is in use")
        self.closed = True
        self._memory = None
        _libc.munmap(self._addr, self._size)


class NoSpace(OSError):
    """The shared-memory filesystem cannot hold a new segment (a container's small /dev/shm)."""


def free_bytes() -> int:
    """Bytes the shared-memory filesystem can still give this process."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _reserve(fd: int, size: int) -> None:
    """Give the file ``size`` bytes of real pages. A file that is only truncated to size maps
    fine on a full tmpfs, and the first write to a page that cannot be had kills the writer with
    SIGBUS: a decode worker that seems to crash on a sample, or the service itself."""
    if not hasattr(os, "posix_fallocate"):  # macOS: pages come on first write
        os.ftruncate(fd, size)
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        raise NoSpace(exc.errno, f"{SHM_DIR} has {free_bytes() / 2**20:.1f} MiB free, a segment of "
                      f"{size / 2**20:.1f} MiB does not fit (raise the container's shm_size or the "
                      f"emptyDir's sizeLimit, or lower --max-shm-mb below it)") from None


class Segment:
    """One mapped segment. ``create`` makes a new one; ``attach`` maps an existing one."""

    def __init__(self, name: str, size: int, mm: _Mapping, owner: bool):
        self.name, self.size, self._mm, self.owner = name, size, mm, owner
        self.buf: Optional[memoryview] = mm.view

    @classmethod
    def create(cls, size: int, tag: str = "seg") -> "Segment":
        """A new segment of ``size`` bytes, its pages reserved. Raises :class:`NoSpace` when the
        filesystem cannot hold it."""
        if size <= 0:
            raise ValueError(f"segment size must be > 0, got {size}")
        name = f"{PREFIX}{os.getpid()}-{tag}-{uuid.uuid4().hex[:12]}"
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            _reserve(fd, size)
            mm = _Mapping(fd, size)
        except BaseException:
            os.unlink(_path(name))
            raise
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> "Segment":
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"not a segment name: {name!r}")
        fd = os.open(_path(name), os.O_RDONLY if readonly else os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = _Mapping(fd, size, writable=not readonly)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def array(self, dtype, shape, offset: int = 0) -> np.ndarray:
        """A numpy view of part of the segment (no copy)."""
        assert self.buf is not None, "segment is closed"
        return np.ndarray(shape, dtype=dtype, buffer=self.buf, offset=offset)

    def close(self) -> None:
        """Unmap (and unlink, for the owner). Idempotent.

        Raises BufferError while a numpy view or a zmq frame still uses the memory; callers
        release those first (the dispatcher waits for zmq's send trackers).
        """
        self.buf = None
        self._mm.close()
        if self.owner:
            self.owner = False
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def list_segments(pid: Optional[int] = None) -> list:
    """Names of this package's segments (all, or those created by ``pid``)."""
    want = f"{PREFIX}{pid}-" if pid is not None else PREFIX
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(want))
    except FileNotFoundError:
        return []


def sweep_stale() -> list:
    """Unlink segments whose creating process no longer exists. Returns their names."""
    stale = []
    for name in list_segments():
        try:
            pid = int(name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if not _alive(pid):
            stale.append(name)
    return unlink(stale)


def unlink(names: list) -> list:
    """Unlink the segments named (a mapped one stays mapped until unmapped). Returns the names
    of those that were there."""
    removed = []
    for name in names:
        try:
            os.unlink(_path(name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
