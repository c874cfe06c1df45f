"""Giving freed heap back to the system after many connections have gone (issue 32).

A flood of connections leaves the service's heap large after every session is gone: libzmq's
per-connection buffers and the dispatcher's per-session records are freed into glibc's arenas
(one per I/O thread as well as the main one), which keep the memory, fragmented, instead of
returning it (2 GB of RSS with 0 sessions, 92 MB at start). ``malloc_trim(0)`` walks every
arena and returns its free pages. It costs milliseconds per hundred MB of heap, so it runs only
after many connections have closed (:class:`TrimRule` decides, :func:`trim` does it).

Python's own object allocator would keep most of the rest: it returns a 1 MiB arena only once
every object in it is gone, and a few objects made during a flood that live on (a rate window's
floats, a lazily imported module) sit in every arena the flood filled. So ``loader-service serve``
runs the interpreter with ``PYTHONMALLOC=malloc`` (``loader_service.cli.main``), whose free
pages :func:`trim` can return one by one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
from typing import Callable, Optional

log = logging.getLogger("loader_service.dispatch.heap")

MIN_GONE = 256  # connections closed since the last trim: fewer are not worth its pause
# A trim's follow-up, this long after the last trim: libzmq frees a closed connection's pipes
# after its disconnect is reported (once the socket has answered the I/O thread), so the trim
# at a drain's end can come before the last connections' buffers are free (+20 MB after 3,000).
SETTLE_S = 1.0


class TrimRule:
    """When to trim: told the count of open connections at every change, says yes once at least
    ``min_gone`` connections have closed since the last trim and at least as many as are still
    open, so a flood that drains is trimmed as it halves, and one client's coming and going once
    in ``min_gone`` departures. A drain goes on being trimmed as it halves below ``min_gone``, down
    to its end, while no connection opens above the count of the last trim: its last sessions' heap
    is given back too, not only the first ones'. The last trim it asks for has one follow-up,
    ``settle_s`` later (:meth:`trimmed`, :meth:`settle_due`), for the buffers libzmq frees after
    it reports a connection gone. Pure."""

    def __init__(self, min_gone: int = MIN_GONE, settle_s: float = SETTLE_S) -> None:
        self.min_gone, self.settle_s = min_gone, settle_s
        self.open = 0
        self.gone = 0  # connections closed since the last trim
        self.draining = False  # a trim was made and the count has not risen above it since
        self.floor = 0  # the count at the last trim
        self.settle_at: Optional[float] = None  # the follow-up of the last trim (None: none due)

    def connections(self, n: int) -> bool:
        """``n`` connections are open now: True when the heap should be trimmed now."""
        self.gone += max(0, self.open - n)
        self.open = n
        if n > self.floor:
            self.draining = False
        if self.gone >= n and (self.gone >= self.min_gone or (self.draining and self.gone > 0)):
            self.gone, self.draining, self.floor = 0, True, n
            return True
        return False

    def trimmed(self, now: float) -> None:
        """A trim the rule asked for was made at ``now``: one follow-up is due ``settle_s`` later
        (the last of a drain's trims sets it)."""
        self.settle_at = now + self.settle_s

    def settle_due(self, now: float) -> bool:
        """True once, when the follow-up trim is due."""
        if self.settle_at is None or now < self.settle_at:
            return False
        self.settle_at = None
        return True


def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim``, or None (musl, macOS: nothing to call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def rss_bytes() -> int:
    """This process's resident memory (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def shrink(owner: object) -> None:
    """Give ``owner``'s private dicts, sets and lists storage sized to what they hold now. Python's
    containers keep the size of their largest moment: an index that held 10,000 sessions keeps a
    table for them (hundreds of KB, each) after they are gone. For an owner's own ``compact()``:
    its underscore attributes are its own, no other object holds them, so a copy changes nothing
    else."""
    for name, value in list(vars(owner).items()):
        if name.startswith("_") and type(value) in (dict, set, list):
            setattr(owner, name, type(value)(value))


def trim() -> bool:
    """Free what only a full collection frees, then return the free pages of every malloc arena to
    the system; False where there is no ``malloc_trim``. The collection matters: departed
    sessions left cycles that only the oldest generation's collection finds, and the
    interpreter's free lists (thousands of tuples, dicts) keep blocks of the flood in use until
    a full collection empties them. (``serve`` freezes what start-up made, so the collection
    passes over it: a millisecond, not 60.)"""
    gc.collect()
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
