"""A packed dataset in object storage: ``s3://bucket/prefix/`` (or gs://, or an https:// folder
with an HTML listing) holding what ``loader-service pack`` writes (``meta.json``, ``data.bin`` and
the ``.npy`` offset, label and name arrays; :mod:`loader_service.sources.packed`). A ``meta.json``
right under the prefix is what :meth:`~loader_service.sources.remote.store.Store.kind` takes for
this format. The samples, labels and order are the local
:class:`~loader_service.sources.packed.PackedSource`'s of the same pack.

**The index.** At start the prefix's first level is listed once (names, sizes, ETags; over
HTTP a HEAD of each file, an HTML listing carrying neither). The small index files are downloaded
once, each checked against that listing (size, ETag, MD5 where the ETag is one), and saved beside
the shard cache (``<cache>/packed-index/remote-<url>-<listing>/``, memory-mapped by every decode
process, one copy in the page cache) with the listing itself (``listing.json``). The listing
(the names, sizes and ETags of the index files and of ``data.bin``) is the dataset's fingerprint,
so a restart on an unchanged prefix reuses the saved index without downloading it again, and a
new ``data.bin`` (another ETag) is a new identity: a stream or a resume made on the old one is
refused, never mixed. The index is read by
:func:`~loader_service.sources.packed.read_index`, the local source's own reader.

**A read** is one HTTP Range GET of the sample's byte span of ``data.bin``, in the decode process
that needs it (:meth:`~loader_service.sources.remote.store.Store.read_range`): the listed ETag
is sent as ``If-Match`` (S3 and GCS refuse the GET of a changed object themselves), the
response's size and ETag are compared with the listing where the store sends them (a plain HTTP
server may ignore ``If-Match``; one that sends no ETag on a range is then checked by size only),
and the bytes must be exactly the span asked for. A sample larger than the service's
``--max-sample-bytes`` is refused before any request; a ``data.bin`` changed, deleted or cut
short since the listing fails the sample with a
:class:`~loader_service.sources.remote.store.RemoteError` naming the object and the cause, judged
by ``--on-error`` like any bad sample. Not through the shard cache (nothing of ``data.bin`` is
kept on disk): the plan reads each sample once per epoch in a shuffled order, so only a cache that
holds the whole ``data.bin`` would save GETs (not built: see the loose images' units in
:mod:`loader_service.sources.remote.imagefolder` for how that would look).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional

from loader_service.sources.base import Source, SourceSpec, register
from loader_service.sources.files import DEFAULT_MAX_SAMPLE_BYTES
from loader_service.sources.packed import INDEX_FILES, closed_index, read_index
from loader_service.sources.remote.store import Location, ObjectInfo, RemoteError, RemoteSettings, Store, read_retries
from loader_service.sources.webdataset import save_folder

INDEX_FOLDER = "packed-index"  # beside the cache's shards/, wds-index/ and folder-index/
LISTING = "listing.json"
DATA = "data.bin"


@register("packed-remote")
class RemotePackedSource(Source):
    """A packed dataset under an object-store prefix (see the module docstring)."""

    def __init__(self, index_dir: str, name: str, origin: str, url: str, settings: RemoteSettings,
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES):
        with open(os.path.join(index_dir, LISTING)) as f:
            self.listing: dict = json.load(f)
        self.location = Location.parse(url)
        data = self.listing["objects"][DATA]
        self.data = ObjectInfo(DATA, int(data["size"]), data["etag"])
        self.meta, self.offsets, self.labels, self.names = read_index(
            index_dir, lambda: self.data.size, self.location.where())
        self.index_dir, self.name, self.index_origin = index_dir, name, origin
        self.url, self.settings, self.max_sample_bytes = url, settings, max_sample_bytes
        self.classes: list = list(self.meta.get("classes", []))
        self._store: Optional[Store] = None

    @classmethod
    def open_url(cls, url: str, settings: RemoteSettings, name: str = "",
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES,
                 store: Optional[Store] = None) -> "RemotePackedSource":
        """List the prefix and open the index saved for that listing, downloading it first if there is none."""
        loc = Location.parse(url)
        store = store or Store(loc, settings)
        infos: Dict[str, ObjectInfo] = {n: store.listed(n) for n in INDEX_FILES + (DATA,)}
        listing = {"v": 1, "url": loc.where(),
                   "objects": {n: {"size": i.size, "etag": i.etag} for n, i in sorted(infos.items())}}
        index_dir, fp = settings.saved_index(INDEX_FOLDER, loc, listing)
        settings.note_listing(INDEX_FOLDER, loc, {n: (i.size, i.etag) for n, i in infos.items()})
        listing["fingerprint"] = fp
        args = (name or loc.default_name(), url, settings, max_sample_bytes)
        if os.path.isfile(os.path.join(index_dir, LISTING)):
            try:
                src = cls(index_dir, args[0], "loaded", *args[1:])
                if src.listing == listing:
                    return src
                src.close()
            except (OSError, ValueError, KeyError):
                pass  # damaged: downloaded again below
            shutil.rmtree(index_dir, ignore_errors=True)

        def fill(tmp: str) -> None:
            for n in INDEX_FILES:
                fd = os.open(os.path.join(tmp, n), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    store.download(infos[n], fd)
                finally:
                    os.close(fd)
            with open(os.path.join(tmp, LISTING), "w") as f:
                json.dump(listing, f)

        save_folder(index_dir, fill)
        return cls(index_dir, args[0], "listed", *args[1:])

    @classmethod
    def from_spec(cls, spec: SourceSpec) -> "RemotePackedSource":
        return cls(spec.index, spec.name, "loaded", spec.path, RemoteSettings.from_options(dict(spec.options)),
                   spec.option("max_sample_bytes", DEFAULT_MAX_SAMPLE_BYTES))

    def spec(self) -> SourceSpec:
        return SourceSpec(self.name, "packed-remote", self.url, self.index_dir,
                          options=(("max_sample_bytes", self.max_sample_bytes),) + self.settings.options())

    def index_parts(self):
        return json.dumps(self.listing["objects"], sort_keys=True), self.names.blob, self.names.offsets, \
            self.offsets, self.labels

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, i: int) -> bytes:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if end - start > self.max_sample_bytes:
            raise RemoteError(f"{self.location.where(DATA)}: sample {i} ({self.names[i]}) is {end - start} bytes, "
                              f"over the sample cap of {self.max_sample_bytes} bytes (max_sample_bytes); not read")
        if start == end:
            return b""
        if self._store is None:  # made in the process that reads: a decode process builds its own
            self._store = Store(self.location, self.settings)
        return self._store.read_range(self.data, start, end)

    def cache_status(self) -> dict:
        """No cache: the retries alone (for /v1/status and /metrics' loader_remote_retries_total)."""
        return {"retries": read_retries(self.settings, self.location)}

    def describe(self, i: int) -> str:
        return f"{self.location.where(DATA)}:{self.names[i]}"

    def close(self) -> None:
        self._store = None  # its pooled connections close with it
        self.offsets, self.labels, self.names = closed_index()  # the index's mappings go now
