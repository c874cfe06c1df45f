"""The client's half of the co-located mode (issue 41; the service's half: loader_service/dispatch/local.py).

A loader made with ``local=True`` checks each replica's probe (``DatasetInfo.probe``: a segment of
the service's shared memory holding its own name): one it can read shares this host's /dev/shm,
and its streams ask for ``Hello.local``. Their batches then name blocks of the service's slots
(``Batch.local``); the sink copies each block once into its own buffer (:meth:`Mappings.block`)
and the connection hands the batch back (``Release``). A replica whose probe cannot be read (another
host, a container without the shared /dev/shm, another user) is served over the socket as usual.

Mappings are read-only, cached by segment name (a stream's slots are one segment, reused by the
connection's next streams) and bounded (:data:`MAX_MAPPINGS`): the client creates no segment, so
a client killed at any point leaves nothing in /dev/shm.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict

import numpy as np

from wire import protocol as P

from client.errors import LoaderError

SHM_DIR = "/dev/shm"
PREFIX = "loader_service-"  # the service's segment names (loader_service/shm.py)
MAX_MAPPINGS = 4  # segments mapped at once; the least recently used is unmapped past it


def _path(name: str) -> str:
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"not a service segment: {name!r}")
    return os.path.join(SHM_DIR, name)


def reachable(probe: str) -> bool:
    """Whether the service's probe segment is readable here and holds its own name: this process
    shares the service's shared memory."""
    if not probe:
        return False
    try:
        with open(_path(probe), "rb") as f:
            return f.read(len(probe.encode())) == probe.encode()
    except (OSError, ValueError):
        return False


class Mappings:
    """Read-only mappings of the service's segments, by name (least recently used unmapped first)."""

    def __init__(self, keep: int = MAX_MAPPINGS):
        self.keep = keep
        self._maps: "OrderedDict[str, mmap.mmap]" = OrderedDict()

    def block(self, name: str, offset: int, nbytes: int) -> np.ndarray:
        """A read-only view of ``nbytes`` at ``offset`` of segment ``name`` (copy it before the
        Release: the slot is the service's again after that)."""
        mm = self._map(name)
        if offset + nbytes > len(mm):
            raise LoaderError(P.ErrorCode.BAD_MESSAGE, f"a batch handed over in place names bytes {offset}..{offset + nbytes} of "
                              f"segment {name}, which holds {len(mm)}")
        return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset)

    def _map(self, name: str) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is not None:
            self._maps.move_to_end(name)
            return mm
        try:
            with open(_path(name), "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise LoaderError(P.ErrorCode.BAD_MESSAGE, (
                f"cannot map the service's shared memory {name!r} for a batch handed over in place: {exc}; is the service on this "
                f"host with the same /dev/shm? (RemoteLoader(local=False) receives over the socket)")) from None
        self._maps[name] = mm
        while len(self._maps) > self.keep:
            _, old = self._maps.popitem(last=False)
            _close(old)
        return mm

    def close(self) -> None:
        for mm in self._maps.values():
            _close(mm)
        self._maps.clear()


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view still exported (a copy in progress elsewhere): unmapped when it goes
        pass


__all__ = ["Mappings", "reachable"]
