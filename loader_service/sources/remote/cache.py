"""The shard cache on the CPU node: one folder, shared by every decode process through file locks.

Layout: ``<name>`` a complete, verified shard; ``<name>.etag`` the ETag it was verified against
and, on its second line, a checksum of the bytes written (``sha1:<hex>``; written before the
shard is renamed into place); ``<name>.part`` a download in progress, held
with an exclusive ``flock`` by the process downloading it and sized to the shard up front (so
the space is counted before a byte arrives); ``.lock`` the folder's lock; ``.stats`` the
counters (:data:`STATS`, int64 each), which the service reads for ``/v1/status`` and ``/metrics``.

Rules, each kept under the folder lock:

* a reader holds a shared ``flock`` on the shard's open descriptor for as long as it keeps it
  open: that shard is *in use* and is never evicted (its bytes stay readable anyway: an
  unlinked file lives while it is open);
* one download per shard: a process that finds a live ``.part`` waits for it; a ``.part`` whose
  lock is free was left by a killed process and is deleted;
* before a download, least recently used shards not in use are evicted until the new one fits
  under the cap; when the shards in use leave no room, the reader waits (bounded) for room;
* a shard left by an earlier service is used when its size and ``.etag`` match the listing,
  else deleted and downloaded again; at a service's start :meth:`ShardCache.verify` reads each
  shard of its dataset already there and deletes one whose bytes no longer match the checksum
  kept beside it (or its MD5 ETag, for a shard an older version left without one), so a file
  damaged at the same size is downloaded again, never read. Nothing is read from a ``.part``;
* a prefetch (:meth:`ShardCache.prefetch`) downloads a shard ahead of its reads only into free
  room: it never evicts and never waits, so it cannot push out a shard that a read is about to
  use, and a read that comes while it runs waits for it like for any other download.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import time
from typing import Callable, Dict, Iterator, List, Tuple

import numpy as np

from loader_service.sources.remote.store import ObjectInfo, RemoteError

STATS = ("hits", "misses", "downloaded_bytes", "download_ns", "wait_ns", "evictions", "failures", "cached_bytes",
         "prefetches")
PART, ETAG = ".part", ".etag"
POLL_S = 0.05
SUM = "sha1"  # the checksum kept beside each shard (damage, not tampering: the fastest here, 1.4 GB/s)
log = logging.getLogger("loader_service.sources.remote")


def checksum(fd: int, algorithm: str = SUM) -> str:
    """``<algorithm>:<hex>`` of the whole file open as ``fd`` (read with pread: its offset is untouched)."""
    h = hashlib.new(algorithm)
    off = 0
    while True:
        chunk = os.pread(fd, 1 << 20, off)
        if not chunk:
            return f"{algorithm}:{h.hexdigest()}"
        h.update(chunk)
        off += len(chunk)


def _read_stats(mm) -> Dict[str, int]:
    arr = np.frombuffer(mm, dtype=np.int64, count=len(STATS))
    return {k: int(v) for k, v in zip(STATS, arr)}


def read_stats(folder: str) -> Dict[str, int]:
    """The counters of the cache in ``folder`` (zeros when it has none yet)."""
    try:
        with open(os.path.join(folder, ".stats"), "rb") as f:
            data = f.read(8 * len(STATS))
    except FileNotFoundError:
        data = b""
    data = data.ljust(8 * len(STATS), b"\0")
    return _read_stats(data)


def cache_status(folder: str, max_bytes: int, retries: int) -> dict:
    """The counters of the cache in ``folder``, its cap and a dataset's ``retries``, as /v1/status
    shows them (seconds, and the download rate)."""
    st = read_stats(folder)
    download_s, wait_s = st.pop("download_ns") / 1e9, st.pop("wait_ns") / 1e9
    return dict(st, max_bytes=max_bytes, retries=retries, download_s=round(download_s, 3), wait_s=round(wait_s, 3),
                download_bytes_per_s=round(st["downloaded_bytes"] / download_s) if download_s else 0)


class ShardCache:
    """This process's handle on the cache folder. ``fetch(info, fd)`` downloads one object into
    ``fd`` (raising :class:`RemoteError`); ``max_bytes`` bounds every file in the folder."""

    def __init__(self, folder: str, max_bytes: int, fetch: Callable[[ObjectInfo, int], None], wait_s: float,
                 where: Callable[[ObjectInfo], str] = lambda info: info.name):
        self.folder, self.max_bytes, self.fetch, self.wait_s = folder, max_bytes, fetch, wait_s
        self.where = where  # an object's URL, for messages
        os.makedirs(folder, exist_ok=True)
        self._lock_fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        stats_fd = os.open(os.path.join(folder, ".stats"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(stats_fd).st_size < 8 * len(STATS):
                os.ftruncate(stats_fd, 8 * len(STATS))
            self._mm = mmap.mmap(stats_fd, 8 * len(STATS))
        finally:
            os.close(stats_fd)
        self._stats = np.frombuffer(self._mm, dtype=np.int64, count=len(STATS))
        with self._locked():
            self._stats[STATS.index("cached_bytes")] = self._used()[0]  # and stale downloads swept

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
            del self._stats
            self._mm.close()

    def stats(self) -> Dict[str, int]:
        return _read_stats(self._mm)

    def _add(self, key: str, n: int) -> None:  # under the folder lock
        self._stats[STATS.index(key)] += n

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held for directory work only, never across a download
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    # ------------------------------------------------------------------ the one entry point
    def open(self, info: ObjectInfo, local: str) -> int:
        """A read-only descriptor of the verified shard ``info`` cached as ``local`` (a name in
        the folder), downloading it first if needed; the caller closes it when done (which
        releases the shard for eviction). Raises :class:`RemoteError`."""
        if info.size > self.max_bytes:
            raise RemoteError(f"{self.where(info)}: a shard of {info.size} bytes cannot fit a cache of "
                              f"{self.max_bytes} bytes (--cache-max-gb)")
        deadline = time.monotonic() + self.wait_s
        waited_since = None
        try:
            while True:
                with self._locked():
                    fd = self._open_cached(info, local)
                    if fd is not None:
                        self._add("hits", 1)  # after a wait for another process's download too
                        return fd
                    state, part_fd, in_use = self._claim(info, local)
                if state == "claimed":
                    self._add_locked("misses", 1)
                    return self._download(info, local, part_fd)
                if time.monotonic() > deadline:
                    why = ("another process's download of it" if state == "busy" else
                           f"room in the cache: {in_use} bytes of shards in use, the cap is {self.max_bytes} bytes "
                           "(raise --cache-max-gb above decode processes x 2 x the largest shard)")
                    raise RemoteError(f"{self.where(info)}: waited {self.wait_s:.0f}s for {why}")
                waited_since = waited_since or time.monotonic()
                time.sleep(POLL_S)
        finally:
            if waited_since is not None:
                self._add_locked("wait_ns", int((time.monotonic() - waited_since) * 1e9))

    def prefetch(self, info: ObjectInfo, local: str) -> str:
        """Download ``info`` as ``local`` ahead of its reads if it fits in the free room, never
        evicting and never waiting: ``"cached"``, ``"busy"`` (another process downloads it),
        ``"no room"`` or ``"fetched"``. Raises :class:`RemoteError` when the download fails."""
        if info.size > self.max_bytes:
            return "no room"
        with self._locked():
            fd = self._open_cached(info, local)
            if fd is not None:
                os.close(fd)
                return "cached"
            if self._stats[STATS.index("cached_bytes")] + info.size > self.max_bytes:
                return "no room"  # the counter is kept under this lock: no folder scan per hint while full
            state, part_fd, _ = self._claim(info, local, evict=False)
            if state == "claimed":
                self._add("prefetches", 1)
        if state != "claimed":
            return "no room" if state == "full" else state
        os.close(self._download(info, local, part_fd))
        return "fetched"

    def verify(self, pairs: List[Tuple[ObjectInfo, str]], where: Callable[[ObjectInfo], str]) -> List[str]:
        """Read each shard of ``pairs`` ((info, local name)) already in the folder and delete one
        whose content does not match the checksum kept beside it (or, without one, its MD5 ETag;
        with neither, it cannot be checked and is deleted). Returns the URLs (``where``) of those
        deleted, each logged. For a service's start: a shard a process holds open is skipped."""
        bad = []
        for info, local in pairs:
            path = self.path(local)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # pinned while read: not evicted under us
                except OSError:
                    continue
                try:
                    with open(path + ETAG) as f:
                        etag, _, kept = f.read().partition("\n")
                except OSError:
                    etag, kept = None, ""
                if etag != info.etag or os.fstat(fd).st_size != info.size:
                    continue  # another version: _open_cached deletes it at its first open
                if kept:
                    ok = checksum(fd, kept.split(":", 1)[0]) == kept
                elif info.md5():
                    ok = checksum(fd, "md5") == f"md5:{info.md5()}"
                else:
                    ok = False
                if ok:
                    continue
                with self._locked():
                    if os.path.exists(path) and os.path.samestat(os.stat(path), os.fstat(fd)):
                        self._remove(local)
                        self._stats[STATS.index("cached_bytes")] = self._used()[0]
                bad.append(where(info))
                log.warning("%s: the cached copy %s %s; deleted, it is downloaded again at its first read",
                            where(info), path, "does not match its checksum (damaged on disk)" if kept or info.md5()
                            else "has no checksum to verify it by (left by an older version)")
            finally:
                os.close(fd)
        return bad

    def _add_locked(self, key: str, n: int) -> None:
        with self._locked():
            self._add(key, n)

    def _open_cached(self, info: ObjectInfo, local: str):
        """A descriptor of a complete shard that matches ``info`` (touched: most recently used),
        or None; a mismatching one is deleted."""
        path = self.path(local)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            with open(path + ETAG) as f:
                etag = f.read().split("\n", 1)[0]
        except OSError:
            etag = None
        size = os.fstat(fd).st_size
        if size != info.size or etag != info.etag:
            os.close(fd)
            self._remove(local)  # a different version (or damaged): never read, fetched again
            self._add("cached_bytes", -size)
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # never blocks here: evictors take LOCK_EX under the folder lock only
        os.utime(path)
        return fd

    def _claim(self, info: ObjectInfo, local: str, evict: bool = True) -> Tuple[str, int, int]:
        """("claimed", fd of a new .part, 0), ("busy", -1, 0): another live process downloads it,
        or ("full", -1, bytes in use, or in the folder when not ``evict``)."""
        part = self.path(local + PART)
        if os.path.exists(part):
            if not self._stale(part):
                return "busy", -1, 0
        if evict:
            in_use = self._make_room(info.size, local)
        else:
            used = int(self._stats[STATS.index("cached_bytes")])
            in_use = 0 if used + info.size <= self.max_bytes else used
        if in_use:
            return "full", -1, in_use
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, info.size)  # counted now; written in place by the download
        self._add("cached_bytes", info.size)
        return "claimed", fd, 0

    def _stale(self, part: str) -> bool:
        """Delete ``part`` if no live process holds it (a killed download); True if deleted."""
        try:
            fd = os.open(part, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
        return True

    def _used(self) -> Tuple[int, List[Tuple[float, str, int]]]:
        """Bytes of shards and downloads in the folder, and the complete shards as (mtime, name, size);
        downloads a killed process left are deleted on the way."""
        total, shards = 0, []
        with os.scandir(self.folder) as it:
            for e in it:
                if e.name.startswith(".") or not e.is_file(follow_symlinks=False):
                    continue
                if e.name.endswith(PART) and self._stale(e.path):
                    continue
                if e.name.endswith(ETAG):
                    continue  # a few bytes per shard: the cap is on shard bytes
                st = e.stat(follow_symlinks=False)
                total += st.st_size
                if not e.name.endswith(PART):
                    shards.append((st.st_mtime, e.name, st.st_size))
        return total, shards

    def _make_room(self, size: int, keep: str) -> int:
        """Evict least recently used shards not in use until ``size`` more bytes fit; 0 when they
        do, else the bytes held by shards in use (and downloads under way). While the counter says
        they fit, no scan: it never counts less than the folder holds (every change is added under
        the folder lock; a killed download's ``.part`` stays counted until a scan sweeps it), so a
        miss costs O(1), not O(files cached), until the cache is full."""
        if self._stats[STATS.index("cached_bytes")] + size <= self.max_bytes:
            return 0
        used, shards = self._used()
        for _, name, n in sorted(shards):
            if used + size <= self.max_bytes:
                break
            if name != keep and self._evict(name):
                used -= n
        self._stats[STATS.index("cached_bytes")] = used
        return 0 if used + size <= self.max_bytes else used

    def _evict(self, name: str) -> bool:
        try:
            fd = os.open(self.path(name), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a reader holds it
        finally:
            os.close(fd)
        self._remove(name)
        self._add("evictions", 1)
        return True

    def _remove(self, name: str) -> None:  # the shard and its .etag
        for p in (self.path(name), self.path(name) + ETAG):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def _download(self, info: ObjectInfo, local: str, part_fd: int) -> int:
        path, part = self.path(local), self.path(local + PART)
        t0 = time.monotonic()
        try:
            self.fetch(info, part_fd)
            os.fdatasync(part_fd)
            kept = checksum(part_fd)  # of the bytes on disk (in the page cache still): what verify() compares
            with self._locked():
                with open(path + ETAG + PART, "w") as f:
                    f.write(f"{info.etag}\n{kept}")
                os.replace(path + ETAG + PART, path + ETAG)
                os.rename(part, path)
                fcntl.flock(part_fd, fcntl.LOCK_UN)  # now a complete shard: the reader's shared lock takes over
                self._add("downloaded_bytes", info.size)
                self._add("download_ns", int((time.monotonic() - t0) * 1e9))
                fd = self._open_cached(info, local)
            if fd is None:
                raise RemoteError(f"{self.where(info)}: the downloaded shard vanished before it was opened")
            return fd
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)  # nothing half-written stays
            with self._locked():
                self._add("failures", 1)
                self._stats[STATS.index("cached_bytes")] = self._used()[0]
            raise
        finally:
            os.close(part_fd)
