"""A dataset index in flat numpy arrays: one bytes buffer plus offsets.

A Python list of str costs ~50+ bytes of refcounted objects per entry; a forked worker that
merely reads them touches refcounts and copies every page (pytorch/pytorch#13246). Here the
index is two arrays, mapped from shared memory or a file, so N workers share one copy.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def printable(name: str) -> str:
    """``name`` for a message: a file name's bytes that are not UTF-8 (kept as surrogates, as
    Python's file system functions do) shown as ``\\xff`` escapes."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class PackedStrings:
    """Immutable sequence of str stored as ``blob[offsets[i]:offsets[i+1]]`` (UTF-8).

    A name whose bytes are not UTF-8 (a file named on an old Latin-1 file system) is kept
    byte for byte (``surrogateescape``, as ``os.fsencode`` does), so it can still be opened;
    :func:`printable` shows it in messages."""

    __slots__ = ("blob", "offsets")

    def __init__(self, blob: np.ndarray, offsets: np.ndarray):
        if blob.dtype != np.uint8 or offsets.dtype != np.int64 or offsets.ndim != 1 or len(offsets) < 1:
            raise ValueError("PackedStrings needs a uint8 blob and int64 offsets of length n+1")
        self.blob, self.offsets = blob, offsets

    @classmethod
    def from_strings(cls, items: Iterable[str]) -> "PackedStrings":
        encoded = [s.encode("utf-8", "surrogateescape") for s in items]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        blob = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        return cls(blob, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.blob[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")

    def tolist(self) -> Sequence[str]:
        return [self[i] for i in range(len(self))]
