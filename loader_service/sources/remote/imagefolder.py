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

**A read** is one GET of one object, in the decode process that needs it, checked against the
listing (:meth:`~loader_service.sources.remote.store.Store.read_object`: the same size, the same
ETag, the MD5 where the ETag is one). An object listed larger than the service's
``--max-sample-bytes`` is refused before any byte is fetched; one changed, deleted or cut short
since the listing fails its sample with a :class:`~loader_service.sources.remote.store.RemoteError`
naming the object and the cause, judged by ``--on-error`` like any bad sample.

**Why straight from the store, not through the shard cache.** The cache is built for a few large
shards: each miss scans the cache folder under its lock (to count the bytes, evict and sweep
stale downloads), then writes, syncs (``fdatasync``) and renames a file, so with one file per image a
miss costs O(files cached), serialised across every decode process. Measured briefly on the dev
box (2 cores, busy; a 3.7 kB JPEG, the download itself a local write): a miss took 3.5 ms with the
folder empty, 10 ms with 1,000 objects cached, 47 ms with 5,000 and 210 ms with 20,000, against
2.0 ms for a checked GET of the same object from moto on loopback. And it would buy little: the
plan reads every sample exactly once per epoch, so a cache helps only from the next epoch, and
only when it holds the whole dataset. So loose objects are read straight from the store (one
object, at most the sample cap, in memory per read; no disk), and ``--cache-max-gb`` does not
apply to them. A dataset read for many epochs over a slow link is better packed into ``.tar``
shards (``loader-service pack``), which the cache serves.

Left out: the service's watch thread does not list the prefix again (each look would cost a full
listing); objects added later are not served, and ones changed are refused at their read.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np

from loader_service.sources.base import Source, SourceSpec, register
from loader_service.sources.files import DEFAULT_MAX_SAMPLE_BYTES
from loader_service.sources.imagefolder import layout, no_images
from loader_service.sources.index import PackedStrings
from loader_service.sources.remote.store import Location, ObjectInfo, RemoteError, RemoteSettings, Store
from loader_service.sources.webdataset import _write_index

INDEX_FORMAT = "loader-remote-folder-index"
INDEX_VERSION = 1
INDEX_FOLDER = "folder-index"  # beside the cache's shards/ and wds-index/
_ARRAYS = ("names_blob", "names_offsets", "sizes", "labels", "etags_blob", "etags_offsets")


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
        self._store: Optional[Store] = None

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
                    return src
                src.close()
            except (OSError, ValueError, KeyError):
                pass  # damaged: saved again below, over it
        names = PackedStrings.from_strings([i.name for i in infos])
        etags = PackedStrings.from_strings([i.etag for i in infos])
        arrays = {"names_blob": names.blob, "names_offsets": names.offsets,
                  "sizes": np.array([i.size for i in infos], np.int64), "labels": np.array(labels, np.int64),
                  "etags_blob": etags.blob, "etags_offsets": etags.offsets}
        meta = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "fingerprint": fp, "length": len(infos),
                "url": loc.where(), "classes": classes}
        _write_index(index_dir, arrays, meta)
        return cls(index_dir, args[0], "listed", *args[1:])

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
        if self._store is None:  # made in the process that reads: a decode process builds its own
            self._store = Store(self.location, self.settings)
        return self._store.read_object(info)

    def describe(self, i: int) -> str:
        return self.location.where(self.paths[i])

    def close(self) -> None:
        self._store = None  # its pooled connections close with it
