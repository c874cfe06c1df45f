"""WebDataset shards in object storage, read through the shard cache.

At start the service lists the shards once (names, sizes, ETags); that listing is the index's
fingerprint, so a restart on an unchanged bucket reuses the saved index and reads no shard, and a
changed object (new ETag or size) makes a new index, i.e. a new dataset identity.

**The index at a first start.** The plan needs the number of samples before the first batch, so
the index is whole at start; it comes from one of two places:

* an index file beside the shards, :data:`INDEX_FILE` (``python -m
  loader_service.sources.remote.webdataset index FOLDER`` writes it next to shards on disk, before
  they are uploaded): each shard's name and size and its samples' keys, offsets, sizes and
  ``.cls`` labels. One GET at start, however many shards. It is taken only when it names every
  listed shard with its listed size, and trusted no further than that: the first time a process
  opens a shard (downloaded through the cache, checked against its ETag), its tar headers are read
  and compared with the index file's rows; a shard that differs fails its samples with a
  :class:`RemoteError` that names it and the index file (write it again). Its ETag is part of the
  listing, so a new index file is a new dataset.
* without one (or a stale one, logged), every shard is downloaded into the cache and its tar
  headers read, :data:`SCAN_THREADS` shards at once (bounded by the cap, evicting as it goes): the
  whole dataset crosses the network once before the first batch (measured: docs/benchmarks.md
  section 13.1). Reading only the headers by ranged GETs would cost a request per member.

Decode processes open shards through the same cache: a read of a shard not cached downloads it
once for all of them; a shard stays pinned while a process keeps it open (at most
:data:`OPEN_SHARDS` per process).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from loader_service.sources.base import SourceSpec, register
from loader_service.sources.remote.cache import ShardCache, cache_status
from loader_service.sources.remote.prefetch import ShardPrefetcher
from loader_service.sources.remote.store import (Location, ObjectInfo, RemoteError, RemoteSettings, Store,
                                                  read_retries)
from loader_service.sources.webdataset import INDEX_VERSION, WebDatasetSource, _build_index, _scan_shard, \
    resolve_shards

OPEN_SHARDS = 2  # per process: what a cap must leave room for (x decode processes)
MAX_LABEL_MAP_BYTES = 16 << 20
INDEX_FILE = "wds-index.json"  # beside the shards: their samples, so a start downloads no shard
INDEX_FILE_FORMAT = "loader-wds-shard-index"
MAX_INDEX_FILE_BYTES = 1 << 30
SCAN_THREADS = 8  # shards downloaded and scanned at once at a first start without an index file
log = logging.getLogger("loader_service.sources.remote")
Rows = Tuple[List[str], Sequence[int], Sequence[int], Sequence[int]]  # keys, offsets, sizes, labels (-1: none)


def write_index_file(folder: str) -> str:
    """Write :data:`INDEX_FILE` for the ``.tar`` shards in ``folder`` (on disk, before upload):
    each shard's name and size, and its samples as :func:`_scan_shard` reads them. Returns its path."""
    shards = []
    for path in resolve_shards(folder):
        keys, offsets, sizes, labels = _scan_shard(path)
        shards.append({"name": os.path.relpath(path, folder), "size": os.path.getsize(path), "keys": keys,
                       "offsets": list(offsets), "sizes": list(sizes), "labels": list(labels)})
    out = os.path.join(folder, INDEX_FILE)
    with open(out + ".tmp", "w") as f:
        json.dump({"format": INDEX_FILE_FORMAT, "version": 1, "shards": shards}, f, separators=(",", ":"))
    os.replace(out + ".tmp", out)
    return out


def read_index_file(data: bytes, infos: Sequence[ObjectInfo], where: str) -> Optional[Dict[str, Rows]]:
    """The rows of each listed shard from an index file's bytes, or None (logged) when it does not
    name every shard with its listed size: a stale index file is not used."""
    try:
        doc = json.loads(data)
        if doc.get("format") != INDEX_FILE_FORMAT or doc.get("version") != 1:
            raise ValueError(f"not a {INDEX_FILE_FORMAT} of version 1")
        entries = {e["name"]: e for e in doc["shards"]}
        rows = {}
        for info in infos:
            e = entries.get(info.name)
            if e is None or int(e["size"]) != info.size:
                raise ValueError(f"{info.name} is listed with {info.size} bytes, the index file says "
                                 f"{'nothing of it' if e is None else e['size']}")
            if not len(e["keys"]) == len(e["offsets"]) == len(e["sizes"]) == len(e["labels"]):
                raise ValueError(f"{info.name}: its rows are of different lengths")
            rows[info.name] = (list(e["keys"]), e["offsets"], e["sizes"], e["labels"])
        return rows
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("%s: not used (%s); every shard is read to index them (write the index file again: python -m "
                    "loader_service.sources.remote.webdataset index FOLDER)", where, exc)
        return None


def check_cap(settings: RemoteSettings, loc: Location, infos: Sequence[ObjectInfo]) -> None:
    """Refuse a cache cap below what the decode processes may hold open at once (each keeps up
    to :data:`OPEN_SHARDS` shards pinned): with less, a read could wait for room that never comes."""
    largest = max(infos, key=lambda i: i.size)
    need = OPEN_SHARDS * settings.decode_processes * largest.size
    if settings.cache_max_bytes < need:
        raise ValueError(
            f"{loc.where()}: the shard cache's cap of {settings.cache_max_bytes} bytes (--cache-max-gb "
            f"{settings.cache_max_bytes / 1e9:g}) is below what {settings.decode_processes} decode processes may hold "
            f"open at once: {OPEN_SHARDS} x {settings.decode_processes} x the largest shard ({loc.where(largest.name)}, "
            f"{largest.size} bytes) = {need} bytes; give --cache-max-gb {-(-need // 10**6) / 1000:g} or more, or "
            "fewer --workers")


@register("webdataset-remote")
class RemoteWebDatasetSource(WebDatasetSource):
    """A :class:`WebDatasetSource` whose shards live in object storage (see the module docstring)."""

    def __init__(self, root: str, index_dir: str, name: str, origin: str, url: str, settings: RemoteSettings,
                 objects: Sequence[ObjectInfo]):
        super().__init__(root, index_dir, name, origin)
        self.url, self.settings, self.objects = url, settings, tuple(objects)
        self.location = Location.parse(url)
        self._cache: Optional[ShardCache] = None
        self._fds: "OrderedDict[int, int]" = OrderedDict()
        self._prefetcher: Optional[ShardPrefetcher] = None
        self._checked: set = set()  # shards whose rows this process compared with their tar headers

    @property
    def cache(self) -> ShardCache:
        if self._cache is None:  # made in the process that reads (a decode process makes its own)
            self._cache = self._new_cache()
        return self._cache

    def _new_cache(self) -> ShardCache:
        """A handle on the cache with its own store (its pooled connections close with it)."""
        return ShardCache(self.root, self.settings.cache_max_bytes, Store(self.location, self.settings).download,
                          self.settings.wait_s, lambda i: self.location.where(i.name))

    def prefetch(self, plan, batch: int) -> None:
        """Download the shards of ``plan``'s next batches ahead (see :mod:`.prefetch`)."""
        if self.settings.prefetch_batches <= 0:
            return
        if self._prefetcher is None:
            locals_ = [os.path.basename(p) for p in self.shards]
            self._prefetcher = ShardPrefetcher(self._new_cache, self.objects, locals_, self._shard,
                                               self.settings.prefetch_batches)
        self._prefetcher.hint(plan, batch)

    @classmethod
    def open_url(cls, url: str, settings: RemoteSettings, name: str = "",
                 store: Optional[Store] = None) -> "RemoteWebDatasetSource":
        """List the shards and open the index made for that listing (scanning them if none is saved);
        ``store``: one made for ``url`` already (its listing is reused)."""
        loc = Location.parse(url)
        store = store or Store(loc, settings)
        infos, label_info = store.list_shards()
        check_cap(settings, loc, infos)
        where = lambda i: loc.where(i.name)  # noqa: E731
        root = settings.shard_dir()
        index_info = store.optional(INDEX_FILE)
        listing = {"v": INDEX_VERSION, "url": loc.where(), "files": [[i.name, i.size, i.etag] for i in infos],
                   "map": [label_info.size, label_info.etag] if label_info else None}
        if index_info is not None:
            listing["index"] = [index_info.size, index_info.etag]
        index_dir, fp = settings.saved_index("wds-index", loc, listing)
        settings.note_listing("wds-index", loc, {i.name: (i.size, i.etag) for i in
                                                 infos + ([label_info] if label_info else [])})
        name = name or loc.default_name()
        args = (url, settings, infos)
        locals_ = [f"{loc.tag()}-{i.name}" for i in infos]
        with contextlib.closing(ShardCache(root, settings.cache_max_bytes, store.download, settings.wait_s, where)) as cache:
            cache.verify(list(zip(infos, locals_)), where)  # what a restart finds there
        if os.path.isfile(os.path.join(index_dir, "meta.json")):
            try:
                src = cls(root, index_dir, name, "loaded", *args)
                if src.meta.get("fingerprint") == fp:
                    return src
                src.close()
            except (OSError, ValueError, KeyError):
                pass  # damaged: scanned again below, and saved over it
        label_map = None
        if label_info is not None:
            os.makedirs(os.path.dirname(index_dir), exist_ok=True)
            label_map = index_dir + ".classes.json"
            with open(label_map, "wb") as f:
                f.write(store.read_small(label_info, MAX_LABEL_MAP_BYTES))
        by_path = {os.path.join(root, n): (i, n) for i, n in zip(infos, locals_)}
        rows = None
        if index_info is not None:
            rows = read_index_file(store.read_small(index_info, MAX_INDEX_FILE_BYTES), infos, loc.where(INDEX_FILE))
        if rows is not None:
            found = {p: rows[i.name] for p, (i, _) in by_path.items()}
            origin = "index file"
        else:
            threads = min(SCAN_THREADS, settings.cache_max_bytes // max(i.size for i in infos))  # none waits for room
            found = scan_shards(by_path, lambda: ShardCache(root, settings.cache_max_bytes, Store(loc, settings).download,
                                                            settings.wait_s, where), max(1, threads))
            origin = "scanned"
        _build_index(root, list(by_path), label_map, fp, [index_dir], scan=found.__getitem__)
        return cls(root, index_dir, name, origin, *args)

    def _check_rows(self, s: int, fd: int) -> None:
        """The first open of shard ``s`` in this process: its tar headers must say what the index
        says (the shard's bytes were checked against its ETag by the download; rows that came from
        an index file, written apart from them, are checked here; a header walk, ~1 ms a shard)."""
        a, b = np.searchsorted(self._shard, [s, s + 1])
        keys, offsets, sizes, labels = _scan_shard(f"/dev/fd/{fd}")
        saved = self.labels[a:b]
        same = (list(keys) == [self.keys[i] for i in range(a, b)] and list(offsets) == self._offset[a:b].tolist()
                and list(sizes) == self._size[a:b].tolist()
                and all(lab < 0 or lab == int(saved[k]) for k, lab in enumerate(labels)))
        if not same:
            raise RemoteError(f"{self.location.where(self.objects[s].name)}: its samples differ from what "
                              f"{self.location.where(INDEX_FILE)} says of it ({len(keys)} samples read, {b - a} in "
                              "the index file): the index file is stale; write it again for these shards")

    @classmethod
    def from_spec(cls, spec: SourceSpec) -> "RemoteWebDatasetSource":
        objects = [ObjectInfo(*o) for o in spec.option("objects")]
        return cls(spec.path, spec.index, spec.name, "loaded", spec.option("url"),
                   RemoteSettings.from_options(dict(spec.options)), objects)

    def spec(self) -> SourceSpec:
        objects = tuple((o.name, o.size, o.etag) for o in self.objects)
        return SourceSpec(self.name, "webdataset-remote", self.root, self.index_dir,
                          options=(("url", self.url), ("objects", objects)) + self.settings.options())

    def index_parts(self):
        """The samples (keys, sizes, labels) and every shard's name, size and ETag: a change to any
        byte of a shard (a member replaced by one of the same length) is a new dataset."""
        objects = json.dumps([[o.name, o.size, o.etag] for o in self.objects])
        return (objects,) + super().index_parts()

    def _fd(self, s: int) -> int:
        fd = self._fds.get(s)
        if fd is not None:
            self._fds.move_to_end(s)
            return fd
        while len(self._fds) >= OPEN_SHARDS:  # unpinned before the next is fetched, so it may be evicted for it
            os.close(self._fds.popitem(last=False)[1])
        fd = self.cache.open(self.objects[s], os.path.basename(self.shards[s]))
        if s not in self._checked:
            try:
                self._check_rows(s, fd)
            except BaseException:
                os.close(fd)
                raise
            self._checked.add(s)
        self._fds[s] = fd
        return fd

    def idle(self) -> None:
        """Unpin this process's open shards: an idle process holding them could keep a cache that
        is full of pinned shards from ever having room for another process's next one."""
        while self._fds:
            os.close(self._fds.popitem()[1])

    def describe(self, i: int) -> str:
        return f"{self.location.where(self.objects[int(self._shard[i])].name)}:{self.keys[i]}"

    def cache_status(self) -> dict:
        """The shard cache's counters and its cap (for /v1/status and /metrics)."""
        return cache_status(self.root, self.settings.cache_max_bytes, read_retries(self.settings, self.location))

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        super().close()
        if self._cache is not None:
            self._cache.close()
            self._cache = None


def scan_shards(by_path: Dict[str, Tuple[ObjectInfo, str]], open_cache, threads: int) -> Dict[str, Rows]:
    """Download each shard of ``by_path`` (cache path -> (info, local name)) into the cache and
    read its tar headers, ``threads`` at once (each thread its own cache handle: a folder lock
    shared by threads excludes none of them). Returns path -> rows."""
    import threading

    mine = threading.local()
    caches = []

    def scan(path: str) -> Rows:
        if not hasattr(mine, "cache"):
            mine.cache = open_cache()
            caches.append(mine.cache)
        info, local = by_path[path]
        fd = mine.cache.open(info, local)  # pinned while scanned
        try:
            return _scan_shard(path)
        finally:
            os.close(fd)

    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="shard-scan") as pool:
            return dict(zip(by_path, pool.map(scan, list(by_path))))
    finally:
        for c in caches:
            c.close()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "index":
        sys.exit("usage: python -m loader_service.sources.remote.webdataset index FOLDER  (writes FOLDER/"
                 f"{INDEX_FILE} for the .tar shards in it, to upload beside them)")
    print(write_index_file(sys.argv[2]))
