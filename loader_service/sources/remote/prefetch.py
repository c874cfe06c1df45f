"""Plan-aware prefetch: the dispatcher knows which batches a stream asks for next, so the shards
they need are downloaded ahead, on threads of the service process, into the cache's free room.

The dispatch loop only hands over a hint, ``(plan, batch)``, to a bounded queue (it never blocks
nor computes); a thread turns the hints it has into the shards of the next ``ahead`` batches, in
the order they will be read, and :data:`FETCHERS` threads ask the cache for each, each shard
queued at most once (:meth:`ShardCache.prefetch`: never evicting, never waiting, so the cap and
the shards in use are kept exactly as a read keeps them).
A failed prefetch is logged once per shard; the read that needs the shard then downloads it
itself and fails loudly, by ``--on-error``, if the store still fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, List, Sequence, Set

import numpy as np

from loader_service.sources.remote.cache import ShardCache
from loader_service.sources.remote.store import ObjectInfo, RemoteError

log = logging.getLogger("loader_service.sources.remote.prefetch")

HINTS = 256  # pending hints; more are dropped (a later hint covers the same batches and more)
STOP_S = 5.0  # how long close() waits for the threads (a download under way ends at its own timeout)
IDLE_S = 1.0  # a thread's wait for work, so it sees a stop between hints
FETCHERS = 4  # downloads at once


def shards_ahead(plan, batch: int, ahead: int, shard_of: np.ndarray) -> List[int]:
    """The shards of ``plan``'s batches ``batch + 1 .. batch + ahead``, in the order of their
    first sample."""
    b = plan.spec.batch_size
    idx = plan.indices[(batch + 1) * b: (batch + 1 + ahead) * b]
    shards = shard_of[idx]
    _, first = np.unique(shards, return_index=True)
    return [int(shards[i]) for i in sorted(first)]


class ShardPrefetcher:
    """A planning thread that turns hints into shards, and ``threads`` threads that download them
    (a store serves several connections faster than one). ``open_cache`` makes a thread's own
    cache handle (its own folder lock: a lock shared between threads excludes none of them)."""

    def __init__(self, open_cache: Callable[[], ShardCache], objects: Sequence[ObjectInfo], locals_: Sequence[str],
                 shard_of: np.ndarray, ahead: int, threads: int = FETCHERS):
        self.open_cache, self.objects, self.locals = open_cache, objects, locals_
        self.shard_of, self.ahead, self.threads = shard_of, ahead, threads
        self._hints: "queue.Queue[tuple]" = queue.Queue(HINTS)
        self._work: "queue.Queue[int]" = queue.Queue()  # shards to fetch, in plan order; each at most once queued
        self._queued: Set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failed: Set[int] = set()
        self.counts = {"fetched": 0, "cached": 0, "busy": 0, "no room": 0, "failed": 0, "dropped": 0}
        self._threads: List[threading.Thread] = []

    def hint(self, plan, batch: int) -> None:
        """``plan``'s batch ``batch`` was just dispatched (from the dispatch loop: O(1), never blocks)."""
        if self._stop.is_set():
            return
        if not self._threads:
            self._threads = [threading.Thread(target=self._plan, name="shard-prefetch-plan", daemon=True)]
            self._threads += [threading.Thread(target=self._fetch_loop, name=f"shard-prefetch-{k}", daemon=True)
                              for k in range(self.threads)]
            for t in self._threads:
                t.start()
        try:
            self._hints.put_nowait((plan, batch))
        except queue.Full:
            self.counts["dropped"] += 1

    def _pending(self, first: tuple) -> List[int]:
        """The shards of ``first`` and every hint queued behind it, each once, in order."""
        hints = [first]
        while True:
            try:
                hints.append(self._hints.get_nowait())
            except queue.Empty:
                break
        out, seen = [], set()
        for plan, batch in hints:
            for s in shards_ahead(plan, batch, self.ahead, self.shard_of):
                if s not in seen:
                    seen.add(s)
                    out.append(s)
        return out

    def _plan(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._hints.get(timeout=IDLE_S)
            except queue.Empty:
                continue
            for s in self._pending(first):
                with self._lock:
                    if s in self._queued:
                        continue
                    self._queued.add(s)
                self._work.put(s)

    def _fetch_loop(self) -> None:
        cache = self.open_cache()
        try:
            while not self._stop.is_set():
                try:
                    s = self._work.get(timeout=IDLE_S)
                except queue.Empty:
                    continue
                try:
                    self._fetch(cache, s)
                finally:
                    with self._lock:
                        self._queued.discard(s)
        finally:
            cache.close()

    def _fetch(self, cache: ShardCache, s: int) -> None:
        try:
            got = cache.prefetch(self.objects[s], self.locals[s])
        except RemoteError as exc:
            got = "failed"
            with self._lock:
                first = s not in self._failed
                self._failed.add(s)
            if first:
                log.warning("prefetch of a shard failed (its reads will try again): %s", exc)
        except Exception:  # never let the thread die silently: the reads still work without it
            got = "failed"
            log.exception("prefetch of shard %d failed", s)
        with self._lock:
            self.counts[got] += 1

    def close(self) -> None:
        """Stop the threads (idempotent); a download under way is left to finish or time out."""
        self._stop.set()
        deadline = time.monotonic() + STOP_S  # one deadline for all of them
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
