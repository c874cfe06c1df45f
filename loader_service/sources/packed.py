"""A packed dataset: every sample's bytes in one file, indexed by numpy arrays.

Layout of a packed directory (written atomically by :func:`write_packed`)::

    meta.json         {"format": "loader-packed", "version": 1, "length": n, "classes": [...]}
    data.bin          all encoded samples back to back
    offsets.npy       int64[n + 1]; sample i is data.bin[offsets[i]:offsets[i+1]]
    labels.npy        int64[n]
    names_blob.npy    uint8, sample names (UTF-8) back to back
    names_offsets.npy int64[n + 1]

Every array is memory-mapped read-only, so worker processes share the page cache and hold no
private copy of the index, whatever its size.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Callable, Iterable, Sequence, Tuple

import numpy as np

from loader_service.sources.base import Source, SourceSpec, register
from loader_service.sources.index import PackedStrings

FORMAT = "loader-packed"
VERSION = 1
INDEX_FILES = ("meta.json", "offsets.npy", "labels.npy", "names_blob.npy", "names_offsets.npy")


def read_index(folder: str, data_size: Callable[[], int], where: str = "") -> Tuple[dict, np.ndarray, np.ndarray,
                                                                                   PackedStrings]:
    """A packed index in ``folder`` (``meta.json`` and the ``.npy`` arrays, memory-mapped): its meta,
    offsets, labels and names, checked against each other and ``data_size()``, data.bin's size
    (called once meta.json has been read). ``where`` names the dataset in errors (default ``folder``)."""
    where = where or folder
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{where} is not a packed dataset (no meta.json)") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{where}: unsupported packed format {meta.get('format')!r} v{meta.get('version')}")
    load = lambda f: np.load(os.path.join(folder, f), mmap_mode="r")  # noqa: E731
    offsets, labels = load("offsets.npy"), load("labels.npy")
    names = PackedStrings(load("names_blob.npy"), load("names_offsets.npy"))
    size = data_size()
    if len(offsets) != meta["length"] + 1 or len(labels) != meta["length"] or offsets[-1] != size:
        raise ValueError(f"{where}: packed dataset is inconsistent (truncated copy?)")
    return meta, offsets, labels, names


def closed_index() -> Tuple[np.ndarray, np.ndarray, PackedStrings]:
    """The offsets, labels and names a closed source keeps in place of its index: empty ones. The
    index's arrays map their files, and numpy keeps a descriptor with each mapping (five of them
    for a packed source) until the last array over it goes: a source that only dropped them at
    garbage collection held those open meanwhile (a test making a source per example reached
    1,024)."""
    return np.zeros(1, np.int64), np.zeros(0, np.int64), PackedStrings(np.zeros(0, np.uint8), np.zeros(1, np.int64))


@register("packed")
class PackedSource(Source):
    def __init__(self, path: str, name: str = ""):
        self.path, self.name = path, name or os.path.basename(os.path.normpath(path))
        data = os.path.join(path, "data.bin")
        self.meta, self.offsets, self.labels, self.names = read_index(path, lambda: os.path.getsize(data))
        self.classes: list = list(self.meta.get("classes", []))
        size = int(self.offsets[-1])
        # a plain ndarray over the mapping: slicing a np.memmap runs its Python __getitem__ and
        # __array_finalize__ on every read (~2 us of a ~7 us read hot, more cold); the view keeps
        # the memmap, and so the mapping, alive through its base
        self._data = np.memmap(data, dtype=np.uint8, mode="r").view(np.ndarray) if size else np.zeros(0, np.uint8)

    @classmethod
    def from_spec(cls, spec: SourceSpec) -> "PackedSource":
        return cls(spec.path, spec.name)

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, i: int) -> bytes:
        return self._data[self.offsets[i] : self.offsets[i + 1]].tobytes()

    def describe(self, i: int) -> str:
        return f"{self.path}:{self.names[i]}"

    def spec(self) -> SourceSpec:
        return SourceSpec(self.name, "packed", self.path)

    def index_parts(self):
        return self.names.blob, self.names.offsets, self.offsets, self.labels

    def close(self) -> None:
        """Unmap the dataset now (the index and data.bin, and the descriptors kept with them); the
        source is empty from then on. Idempotent."""
        self.offsets, self.labels, self.names = closed_index()
        self._data = np.zeros(0, np.uint8)


def write_packed(
    path: str,
    samples: Iterable[Tuple[str, bytes, int]],
    classes: Sequence[str] = (),
) -> int:
    """Write ``(name, bytes, label)`` samples as a packed dataset at ``path``. Returns n.

    Written into a temporary sibling directory and renamed, so a reader never sees a half
    written dataset and an interrupted write leaves nothing at ``path``.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        sizes, labels, names = [], [], []
        with open(os.path.join(tmp, "data.bin"), "wb") as data:
            for name, blob, label in samples:
                data.write(blob)
                sizes.append(len(blob))
                labels.append(label)
                names.append(name)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        packed_names = PackedStrings.from_strings(names)
        np.save(os.path.join(tmp, "offsets.npy"), offsets)
        np.save(os.path.join(tmp, "labels.npy"), np.asarray(labels, dtype=np.int64))
        np.save(os.path.join(tmp, "names_blob.npy"), packed_names.blob)
        np.save(os.path.join(tmp, "names_offsets.npy"), packed_names.offsets)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"format": FORMAT, "version": VERSION, "length": len(sizes), "classes": list(classes)}, f)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(sizes)
