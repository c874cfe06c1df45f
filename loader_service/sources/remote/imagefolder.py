"""An ImageFolder in object storage: ``s3://bucket/prefix/<class>/<image>`` (or gs://), loose objects.

The classes, the images and their order are the local
:class:`~loader_service.sources.imagefolder.ImageFolderSource`'s for the same files (one rule:
:func:`~loader_service.sources.imagefolder.layout`), so a folder copied to a bucket is the same
samples with the same labels in the same order.

**The listing.** At start the service lists the prefix once, recursively (names, sizes, ETags:
one request per 1,000 objects). That listing is the index: it is saved beside the shard cache
(``<cache>/folder-index/remote-<url>-<listing>/``, ``.npy`` files that every decode process
memory-maps, one copy in the page cache) and digested into the dataset's fingerprint, with the
ETags, so a restart on an unchanged prefix finds and reuses it, and a changed object (another
ETag or size) is a new identity: a stream or a resume made on the old one is refused, never mixed.

**The cache.** When ``--cache-max-gb`` holds the whole dataset, the images are cached on the CPU
node in *units*: runs of consecutive objects of the index (:data:`UNIT_BYTES` or
:data:`UNIT_OBJECTS`, whichever comes first), each one file of the shard cache
(:mod:`~loader_service.sources.remote.cache`), its objects at fixed offsets (their listed sizes).
A unit is downloaded whole at its first read (its objects fetched by :data:`UNIT_THREADS` checked
GETs at once: the same size, ETag and MD5 checks as any read) or ahead of it by the plan-aware
prefetch (:mod:`.prefetch`, the unit being the "shard"), and then serves each of its images by
one ``pread``. Everything the shard cache gives a shard a unit has: one download per unit across
the decode processes, nothing read from a download in progress (a decode process killed
mid-write leaves a ``.part`` that is deleted, never used), a SHA-1 of its bytes kept beside it and
checked when a restart finds it (:meth:`~loader_service.sources.remote.cache.ShardCache.verify`),
the unit's ETag a digest of its objects' names, sizes and ETags (a changed object: another unit,
downloaded again). A unit costs the cache one file, so a miss costs one lookup by name and no
folder scan while the cap has room (measured: docs/benchmarks.md section 13.1): the reason the
images were not cached before was a miss costing O(files cached), 210 ms with 20,000 images in the
folder. So epoch 1 GETs each image once, and every later epoch none.

With a cap below the dataset the images are read straight from the store, one checked GET per read
(:meth:`~loader_service.sources.remote.store.Store.read_object`; logged at start with the number
the cap would need): the plan reads every sample once per epoch in a shuffled order, so a partial
cache would keep only cap / dataset of the reads and cost a whole unit's GETs per miss. A unit
whose download fails (an object deleted or changed since the listing) is not cached by that
process: its images are read straight, so the one object fails alone, naming itself. An object
listed larger than ``--max-sample-bytes`` is refused before any byte is fetched (and left out
of its unit's download); one changed, deleted or cut short since the listing fails its sample
with a :class:`~loader_service.sources.remote.store.RemoteError` naming the object and the
cause, judged by ``--on-error`` like any bad sample.

Left out: the service's watch thread does not list the prefix again (each look would cost a full
listing); objects added later are not served, and ones changed are refused at their read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import numpy as np

from loader_service.sources.base import Source, SourceSpec, register
from loader_service.sources.files import DEFAULT_MAX_SAMPLE_BYTES
from loader_service.sources.imagefolder import layout, no_images
from loader_service.sources.index import PackedStrings
from loader_service.sources.remote.cache import ShardCache, cache_status
from loader_service.sources.remote.prefetch import ShardPrefetcher
from loader_service.sources.remote.store import Location, ObjectInfo, RemoteError, RemoteSettings, Store, read_retries
from loader_service.sources.remote.webdataset import OPEN_SHARDS
from loader_service.sources.webdataset import _write_index

INDEX_FORMAT = "loader-remote-folder-index"
INDEX_VERSION = 2  # 2: the cache units
INDEX_FOLDER = "folder-index"  # beside the cache's shards/ and wds-index/
_ARRAYS = ("names_blob", "names_offsets", "sizes", "labels", "etags_blob", "etags_offsets", "cum", "unit_starts",
           "unit_of", "unit_tags")
UNIT_BYTES = 8 << 20  # a cache unit's objects add up to at most this (one object alone may be larger)
UNIT_OBJECTS = 256  # and are at most this many
UNIT_THREADS = 8  # GETs at once while a unit downloads
log = logging.getLogger("loader_service.sources.remote")


def units(sizes: np.ndarray) -> np.ndarray:
    """The first object of each cache unit, and ``len(sizes)`` last: runs of consecutive objects
    of at most :data:`UNIT_BYTES` (one larger object alone) and :data:`UNIT_OBJECTS`."""
    starts, run, n = [0], 0, 0
    for i, size in enumerate(sizes.tolist()):
        if n and (run + size > UNIT_BYTES or n == UNIT_OBJECTS):
            starts.append(i)
            run, n = 0, 0
        run, n = run + size, n + 1
    return np.array(starts + [len(sizes)], np.int64)


@register("imagefolder-remote")
class RemoteImageFolderSource(Source):
    """Loose images under an object-store prefix (see the module docstring)."""

    def __init__(self, index_dir: str, name: str, origin: str, url: str, settings: RemoteSettings,
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES):
        with open(os.path.join(index_dir, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("format") != INDEX_FORMAT or meta.get("version") != INDEX_VERSION:
            raise ValueError(f"{index_dir}: not a remote folder index of version {INDEX_VERSION}")
        a = {k: np.load(os.path.join(index_dir, f"{k}.npy"), mmap_mode="r") for k in _ARRAYS}
        n = int(meta["length"])
        if not (len(a["sizes"]) == len(a["labels"]) == n and len(a["names_offsets"]) == len(a["etags_offsets"]) == n + 1):
            raise ValueError(f"{index_dir}: remote folder index is inconsistent (damaged?)")
        self.index_dir, self.meta, self.name, self.index_origin = index_dir, meta, name, origin
        self.url, self.settings, self.max_sample_bytes = url, settings, max_sample_bytes
        self.location = Location.parse(url)
        self.classes: list = list(meta["classes"])
        self.paths = PackedStrings(a["names_blob"], a["names_offsets"])
        self.etags = PackedStrings(a["etags_blob"], a["etags_offsets"])
        self.sizes, self.labels = a["sizes"], a["labels"]
        self._cum, self._unit_starts, self._unit_of, self._unit_tags = a["cum"], a["unit_starts"], a["unit_of"], \
            a["unit_tags"]
        self.cached = settings.cache_max_bytes >= int(self._cum[-1])  # the cap holds the whole dataset
        self._store: Optional[Store] = None
        self._cache: Optional[ShardCache] = None
        self._fds: "OrderedDict[int, int]" = OrderedDict()
        self._uncached: set = set()  # units whose download failed in this process: read straight
        self._prefetcher: Optional[ShardPrefetcher] = None

    @classmethod
    def open_url(cls, url: str, settings: RemoteSettings, name: str = "",
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES,
                 store: Optional[Store] = None) -> "RemoteImageFolderSource":
        """List the prefix and open the index saved for that listing, saving it first if there is none."""
        loc = Location.parse(url)
        objects = (store or Store(loc, settings)).list_tree()
        classes, picked, labels = layout([o.name for o in objects])
        if not picked:
            raise no_images(loc.where())
        infos = [objects[i] for i in picked]
        h = hashlib.sha256()
        for info, label in zip(infos, labels):
            h.update(json.dumps([info.name, info.size, info.etag, label]).encode())
        listing = {"v": INDEX_VERSION, "url": loc.where(), "objects": h.hexdigest(), "classes": classes}
        index_dir, fp = settings.saved_index(INDEX_FOLDER, loc, listing)
        args = (name or loc.default_name(), url, settings, max_sample_bytes)
        if os.path.isfile(os.path.join(index_dir, "meta.json")):
            try:
                src = cls(index_dir, args[0], "loaded", *args[1:])
                if src.meta.get("fingerprint") == fp:
                    return src.opened(store)
                src.close()
            except (OSError, ValueError, KeyError):
                pass  # damaged: saved again below, over it
        names = PackedStrings.from_strings([i.name for i in infos])
        etags = PackedStrings.from_strings([i.etag for i in infos])
        sizes = np.array([i.size for i in infos], np.int64)
        starts = units(sizes)
        tags = [hashlib.sha1(json.dumps([[i.name, i.size, i.etag] for i in infos[a:b]]).encode()).hexdigest()
                for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]
        arrays = {"names_blob": names.blob, "names_offsets": names.offsets, "sizes": sizes,
                  "labels": np.array(labels, np.int64), "etags_blob": etags.blob, "etags_offsets": etags.offsets,
                  "cum": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), "unit_starts": starts,
                  "unit_of": np.repeat(np.arange(len(starts) - 1, dtype=np.int32), np.diff(starts)),
                  "unit_tags": np.array(tags, "S40")}
        meta = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "fingerprint": fp, "length": len(infos),
                "url": loc.where(), "classes": classes}
        _write_index(index_dir, arrays, meta)
        return cls(index_dir, args[0], "listed", *args[1:]).opened(store)

    def opened(self, store: Optional[Store]) -> "RemoteImageFolderSource":
        """At a service's start: say where the images are read from, and check the units of the
        cache a restart finds (see :meth:`ShardCache.verify`)."""
        total = int(self._cum[-1])
        if not self.cached:
            log.warning("%s: %d images, %d bytes, more than the cache's cap of %d bytes: read straight from the "
                        "store every epoch (--cache-max-gb %g or more caches them)", self.location.where(), len(self),
                        total, self.settings.cache_max_bytes, -(-total // 10**6) / 1000)
            return self
        with contextlib.closing(self._new_cache(store)) as cache:
            cache.verify(list(zip(self._unit_infos(), self._unit_locals())), self._unit_where)
        return self

    @classmethod
    def from_spec(cls, spec: SourceSpec) -> "RemoteImageFolderSource":
        return cls(spec.index, spec.name, "loaded", spec.path, RemoteSettings.from_options(dict(spec.options)),
                   spec.option("max_sample_bytes", DEFAULT_MAX_SAMPLE_BYTES))

    def spec(self) -> SourceSpec:
        return SourceSpec(self.name, "imagefolder-remote", self.url, self.index_dir,
                          options=(("max_sample_bytes", self.max_sample_bytes),) + self.settings.options())

    def index_parts(self):
        return self.paths.blob, self.paths.offsets, self.sizes, self.labels, self.etags.blob, self.etags.offsets

    def __len__(self) -> int:
        return len(self.sizes)

    def object(self, i: int) -> ObjectInfo:
        """Sample ``i``'s object as the listing saw it."""
        return ObjectInfo(self.paths[i], int(self.sizes[i]), self.etags[i])

    def read(self, i: int) -> bytes:
        info = self.object(i)
        if info.size > self.max_sample_bytes:
            raise RemoteError(f"{self.location.where(info.name)}: {info.size} bytes as listed, over the sample cap "
                              f"of {self.max_sample_bytes} bytes (max_sample_bytes); not read")
        u = int(self._unit_of[i])
        if self.cached and u not in self._uncached:
            try:
                fd = self._fd(u)
            except RemoteError as exc:  # an object of the unit changed or gone: each read names its own
                self._uncached.add(u)
                log.warning("%s; its images are read straight from the store", exc)
            else:
                return _pread(fd, info.size, int(self._cum[i] - self._cum[self._unit_starts[u]]), self.describe(i))
        return self.store().read_object(info)

    def store(self) -> Store:
        if self._store is None:  # made in the process that reads: a decode process builds its own
            self._store = Store(self.location, self.settings)
        return self._store

    # -------------------------------------------------------------- the cache units
    def _unit(self, u: int) -> ObjectInfo:
        """Unit ``u`` as the cache sees it: its size, and its ETag (a digest of its objects')."""
        c, st = self._cum, self._unit_starts
        return ObjectInfo(f"unit-{u:06d}", int(c[st[u + 1]] - c[st[u]]), self._unit_tags[u].decode())

    def _local(self, u: int) -> str:
        """Unit ``u``'s name in the cache folder (the URL's tag, the unit, its ETag: versions apart)."""
        return f"{self.location.tag()}-u{u:06d}-{self._unit_tags[u][:12].decode()}"

    def _unit_infos(self) -> List[ObjectInfo]:
        return [self._unit(u) for u in range(len(self._unit_tags))]

    def _unit_locals(self) -> List[str]:
        return [self._local(u) for u in range(len(self._unit_tags))]

    def _unit_where(self, info: ObjectInfo) -> str:
        """A unit in words: the URLs of its first and last objects."""
        u = int(info.name.split("-")[1])
        first, last = int(self._unit_starts[u]), int(self._unit_starts[u + 1]) - 1
        return f"{self.location.where(self.paths[first])} .. {self.paths[last]} (cache unit {u})"

    def _fetch_unit(self, store: Store, info: ObjectInfo, fd: int) -> None:
        """Write unit ``info``'s objects into ``fd`` at their offsets, each one checked GET
        (:data:`UNIT_THREADS` at once); one over the sample cap is left out (never read)."""
        u = int(info.name.split("-")[1])
        a, b = int(self._unit_starts[u]), int(self._unit_starts[u + 1])
        base = int(self._cum[a])

        def one(i: int) -> None:
            obj = self.object(i)
            if obj.size > self.max_sample_bytes or obj.size == 0:
                return
            data = store.read_object(obj)
            view, off = memoryview(data), int(self._cum[i]) - base
            while view:
                n = os.pwrite(fd, view, off)
                view, off = view[n:], off + n

        with ThreadPoolExecutor(min(UNIT_THREADS, b - a), thread_name_prefix="unit-get") as pool:
            for _ in pool.map(one, range(a, b)):
                pass

    def _new_cache(self, store: Optional[Store] = None) -> ShardCache:
        """A handle on the cache with its own store (its pooled connections close with it)."""
        store = store or Store(self.location, self.settings)
        return ShardCache(self.settings.shard_dir(), self.settings.cache_max_bytes,
                          lambda info, fd: self._fetch_unit(store, info, fd), self.settings.wait_s, self._unit_where)

    def _fd(self, u: int) -> int:
        fd = self._fds.get(u)
        if fd is not None:
            self._fds.move_to_end(u)
            return fd
        while len(self._fds) >= OPEN_SHARDS:
            os.close(self._fds.popitem(last=False)[1])
        if self._cache is None:
            self._cache = self._new_cache(self.store())
        fd = self._fds[u] = self._cache.open(self._unit(u), self._local(u))
        return fd

    def prefetch(self, plan, batch: int) -> None:
        """Download the units of ``plan``'s next batches ahead (see :mod:`.prefetch`)."""
        if not self.cached or self.settings.prefetch_batches <= 0:
            return
        if self._prefetcher is None:
            self._prefetcher = ShardPrefetcher(self._new_cache, self._unit_infos(), self._unit_locals(),
                                               self._unit_of, self.settings.prefetch_batches)
        self._prefetcher.hint(plan, batch)

    def idle(self) -> None:
        """Unpin this process's open units (see the WebDataset source's ``idle``)."""
        while self._fds:
            os.close(self._fds.popitem()[1])

    def cache_status(self) -> dict:
        """The cache's counters (units, for this source) and the retries (for /v1/status and /metrics)."""
        retries = read_retries(self.settings, self.location)
        if not self.cached:
            return {"retries": retries}
        return cache_status(self.settings.shard_dir(), self.settings.cache_max_bytes, retries)

    def describe(self, i: int) -> str:
        return self.location.where(self.paths[i])

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        self.idle()
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        self._store = None  # its pooled connections close with it


def _pread(fd: int, size: int, off: int, what: str) -> bytes:
    data = os.pread(fd, size, off)
    while len(data) < size:  # pread may return less; at EOF it returns b""
        more = os.pread(fd, size - len(data), off + len(data))
        if not more:
            raise OSError(f"{what}: the cached unit ends before the image ({len(data)} of {size} bytes)")
        data += more
    return data
