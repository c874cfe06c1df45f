"""Loose files read safely: only regular files, at most a byte cap, and a folder walk that
enters each real directory once.

A dataset folder is input like any other: a FIFO named ``x.jpg`` would block ``open()`` or
``read()`` forever, a symlink to ``/dev/zero`` reads until memory runs out, and a directory
symlink loop makes a naive walk revisit the same files without end. Every refusal here names
the path, so ``on_error`` reports say which file to fix.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from typing import Callable, Iterator, List, Optional, Tuple

log = logging.getLogger("loader_service.sources")

DEFAULT_MAX_SAMPLE_BYTES = 64 << 20  # well above any real photo (a 100 MP JPEG is ~30 MiB)
PROGRESS_EVERY_S = 5.0  # a long scan logs how far it got this often

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_regular(path: str, max_bytes: int, expect: Optional[Tuple[int, int]] = None) -> bytes:
    """The bytes of the regular file ``path``, refusing anything else and anything over ``max_bytes``.

    ``O_NONBLOCK`` so that opening a FIFO returns at once (it then fails the regular-file
    check); ``fstat`` on the open descriptor, so a file swapped after a check cannot slip in;
    at most ``max_bytes + 1`` bytes are ever read, whatever ``st_size`` claims (procfs and
    sysfs files say 0; a file can grow while it is read). ``expect``: the (size, mtime in ns)
    the file had when the dataset was scanned; a file changed since is refused, never served
    with other bytes than the epoch's plan was made for.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is {_kind(st.st_mode)}, not a regular file; refusing to read it")
        if st.st_size > max_bytes:
            raise ValueError(f"{path} is {st.st_size} bytes, over the sample cap of {max_bytes} bytes "
                             "(max_sample_bytes)")
        if expect is not None and (st.st_size, st.st_mtime_ns) != expect:
            raise ValueError(f"{path} changed since the service scanned the dataset ({_changed(expect, st)}); "
                             "restart the service to serve the folder as it is now")
        chunks, got = [], 0
        while got <= max_bytes:
            chunk = os.read(fd, min(max_bytes + 1 - got, 1 << 20) or 1)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > max_bytes:
            raise ValueError(f"{path} grew past the sample cap of {max_bytes} bytes while it was read "
                             "(max_sample_bytes)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _changed(expect: Tuple[int, int], st: os.stat_result) -> str:
    if st.st_size != expect[0]:
        return f"{expect[0]} bytes then, {st.st_size} now"
    return f"modified {(st.st_mtime_ns - expect[1]) / 1e9:+.3f}s after the scan's time stamp"


def walk_once(top: str, seen: set, skipped: List[Tuple[str, str]],
              progress: Callable[[int], None] = lambda n: None) -> Iterator[Tuple[str, List[str], int]]:
    """Like ``os.walk(top, followlinks=True)`` top-down with sorted names, yielding
    ``(dirpath, filenames, mtime_ns)``, but each real directory (device, inode) is entered once.
    ``mtime_ns`` is the directory's, taken before it is listed: an entry added or removed after
    that moves it (what :meth:`ImageFolderSource.changes_on_disk` looks for).

    ``seen`` holds the (st_dev, st_ino) of directories already walked (share it across calls
    so two class folders that are one real directory count once). A directory reached again,
    through a symlink loop or a second link, is appended to ``skipped`` as (path, why) and not
    entered: the walk is bounded by the number of real directories. ``progress(n)`` is called
    once per directory with the number of files in it.
    """
    stack = [top]
    while stack:
        path = stack.pop()
        try:
            st = os.stat(path)
        except OSError as exc:
            skipped.append((path, f"cannot stat: {exc.strerror}"))
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            skipped.append((path, "directory already scanned (a symlink loop or a second link to it)"))
            continue
        seen.add(key)
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError as exc:
            skipped.append((path, f"cannot list: {exc.strerror}"))
            continue
        dirs, files = [], []
        for e in entries:
            try:
                is_dir = e.is_dir()  # follows symlinks, as os.walk(followlinks=True) does
            except OSError:
                is_dir = False
            (dirs if is_dir else files).append(e.name)
        files.sort()
        progress(len(files))
        yield path, files, st.st_mtime_ns
        stack.extend(os.path.join(path, d) for d in sorted(dirs, reverse=True))


class ScanProgress:
    """Counts the files of a scan; logs ``scanning ROOT: N files so far`` every
    :data:`PROGRESS_EVERY_S` of a long one."""

    def __init__(self, root: str):
        self.root, self.start, self.files = root, time.monotonic(), 0
        self.next = self.start + PROGRESS_EVERY_S

    def __call__(self, n: int) -> None:
        self.files += n
        now = time.monotonic()
        if now >= self.next:
            self.next = now + PROGRESS_EVERY_S
            log.info("scanning %s: %d files so far (%.0fs)", self.root, self.files, now - self.start)
