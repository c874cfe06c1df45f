"""ImageFolder layout: ``root/<class>/<file>.{jpg,jpeg,png}``, classes sorted by name.

The scan happens once, in the service process; the index (relative paths packed into one
buffer + offsets, and labels) is placed in a shared-memory segment that workers map
read-only, so their memory stays flat however many files there are.

Hostile trees cost bounded work: the scan enters each real directory once (symlink loops are
reported, not followed again), and a read takes only a regular file of at most
``max_sample_bytes`` (see files.py).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from loader_service.shm import Segment
from loader_service.sources.base import IMAGE_EXTENSIONS, Source, SourceSpec, register
from loader_service.sources.files import DEFAULT_MAX_SAMPLE_BYTES, ScanProgress, log, read_regular, walk_once
from loader_service.sources.index import PackedStrings

EXTENSIONS = IMAGE_EXTENSIONS


@register("imagefolder")
class ImageFolderSource(Source):
    def __init__(self, root: str, name: str, paths: PackedStrings, labels: np.ndarray, stats: np.ndarray,
                 classes: list, segment: Optional[Segment] = None,
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES):
        self.root, self.name, self.paths, self.labels = root, name, paths, labels
        self.stats = stats  # int64 (n, 2): each file's size and mtime (ns) at the scan; -1 where stat failed
        self.classes, self._segment, self.max_sample_bytes = classes, segment, max_sample_bytes
        self.scan_skipped: list = []  # (path, why) of folders the scan did not enter

    @classmethod
    def scan(cls, root: str, name: str = "", max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> "ImageFolderSource":
        """Walk ``root`` and build the index in shared memory. Raises if nothing is found.

        Directory symlinks are followed, each real directory once; the ones skipped are
        logged and kept in ``scan_skipped``."""
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"dataset folder {root} does not exist")
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        rel, labels, stats = [], [], []
        seen: set = {(os.stat(root).st_dev, os.stat(root).st_ino)}  # a link back to the root is a loop too
        skipped: list = []
        progress = ScanProgress(root)
        for label, cls_name in enumerate(classes):
            for dirpath, filenames in walk_once(os.path.join(root, cls_name), seen, skipped, progress):
                for fn in filenames:
                    if fn.lower().endswith(EXTENSIONS):
                        path = os.path.join(dirpath, fn)
                        rel.append(os.path.relpath(path, root))
                        labels.append(label)
                        stats.append(_stat(path))
        if skipped:
            log.warning("scan of %s: %d folders not entered (each real folder is scanned once): %s%s", root,
                        len(skipped), "; ".join(f"{p}: {why}" for p, why in skipped[:5]),
                        " ..." if len(skipped) > 5 else "")
        if not rel:
            raise ValueError(
                f"no images found in {root}: expected ImageFolder layout root/<class>/<image>"
                f" with extensions {', '.join(EXTENSIONS)}"
            )
        packed = PackedStrings.from_strings(rel)
        src = cls._into_shared(root, name or os.path.basename(root), packed, np.asarray(labels, np.int64),
                               np.asarray(stats, np.int64).reshape(-1, 2), classes, max_sample_bytes)
        src.scan_skipped = skipped
        return src

    @classmethod
    def _into_shared(cls, root, name, packed, labels, stats, classes, max_sample_bytes) -> "ImageFolderSource":
        n, blob_len = len(labels), len(packed.blob)
        seg = Segment.create(16 + 8 * (n + 1) + 8 * n + 16 * n + max(blob_len, 1), tag="index")
        try:
            seg.array(np.int64, (2,))[:] = (n, blob_len)
            offsets, shared_labels, shared_stats, blob = _views(seg, n, blob_len)
            offsets[:], shared_labels[:], shared_stats[:], blob[:] = packed.offsets, labels, stats, packed.blob
        except BaseException:
            seg.close()
            raise
        return cls(root, name, PackedStrings(blob, offsets), shared_labels, shared_stats, classes, seg,
                   max_sample_bytes)

    @classmethod
    def from_spec(cls, spec: SourceSpec) -> "ImageFolderSource":
        seg = Segment.attach(spec.index, readonly=True)
        n, blob_len = (int(x) for x in seg.array(np.int64, (2,)))
        offsets, labels, stats, blob = _views(seg, n, blob_len)
        return cls(spec.path, spec.name, PackedStrings(blob, offsets), labels, stats, [], seg,
                   spec.option("max_sample_bytes", DEFAULT_MAX_SAMPLE_BYTES))

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, i: int) -> bytes:
        size, mtime_ns = (int(x) for x in self.stats[i])
        return read_regular(os.path.join(self.root, self.paths[i]), self.max_sample_bytes,
                            expect=(size, mtime_ns) if size >= 0 else None)

    def describe(self, i: int) -> str:
        return os.path.join(self.root, self.paths[i])

    def spec(self) -> SourceSpec:
        return SourceSpec(self.name, "imagefolder", self.root, self._segment.name if self._segment else "",
                          (("max_sample_bytes", self.max_sample_bytes),))

    def index_parts(self):
        return self.paths.blob, self.paths.offsets, self.stats[:, 0], self.labels

    def close(self) -> None:
        if self._segment is not None:
            # drop our views first, or the mapping cannot be closed
            self.paths = self.labels = self.stats = None  # type: ignore[assignment]
            self._segment.close()
            self._segment = None


def _views(seg: Segment, n: int, blob_len: int):
    off = 16
    offsets = seg.array(np.int64, (n + 1,), off)
    off += 8 * (n + 1)
    labels = seg.array(np.int64, (n,), off)
    off += 8 * n
    stats = seg.array(np.int64, (n, 2), off)
    off += 16 * n
    blob = seg.array(np.uint8, (blob_len,), off)
    return offsets, labels, stats, blob


def _stat(path: str) -> tuple:
    """(size, mtime in ns) of the file a sample is read from (through a link, as a read sees it)."""
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1  # a broken link: the read fails and names it
    return st.st_size, st.st_mtime_ns
