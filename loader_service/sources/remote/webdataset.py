"""WebDataset shards in object storage, read through the shard cache.

At start the service lists the shards once (names, sizes, ETags); that listing is the index's
fingerprint, so a restart on an unchanged bucket reuses the saved index and reads no shard, and a
changed object (new ETag or size) makes a new index, i.e. a new dataset identity. A scan fetches
each shard into the cache (bounded by the cap, evicting as it goes) and reads its tar headers.
Decode processes open shards through the same cache: a read of a shard not cached downloads it
once for all of them; a shard stays pinned while a process keeps it open (at most
:data:`OPEN_SHARDS` per process).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import OrderedDict
from typing import Optional, Sequence

from loader_service.sources.base import SourceSpec, register
from loader_service.sources.remote.cache import ShardCache, cache_status
from loader_service.sources.remote.prefetch import ShardPrefetcher
from loader_service.sources.remote.store import Location, ObjectInfo, RemoteSettings, Store, read_retries
from loader_service.sources.webdataset import INDEX_VERSION, WebDatasetSource, _build_index, _scan_shard

OPEN_SHARDS = 2  # per process: what a cap must leave room for (x decode processes)
MAX_LABEL_MAP_BYTES = 16 << 20


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
        listing = {"v": INDEX_VERSION, "url": loc.where(), "files": [[i.name, i.size, i.etag] for i in infos],
                   "map": [label_info.size, label_info.etag] if label_info else None}
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
        cache = ShardCache(root, settings.cache_max_bytes, store.download, settings.wait_s, where)

        def scan(path: str):
            info, local = by_path[path]
            fd = cache.open(info, local)  # pinned while scanned
            try:
                return _scan_shard(path)
            finally:
                os.close(fd)

        try:
            _build_index(root, list(by_path), label_map, fp, [index_dir], scan=scan)
        finally:
            cache.close()
        return cls(root, index_dir, name, "scanned", *args)

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
        fd = self._fds[s] = self.cache.open(self.objects[s], os.path.basename(self.shards[s]))
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
