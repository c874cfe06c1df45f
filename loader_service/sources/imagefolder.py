"""ImageFolder layout: ``root/<class>/<file>.{jpg,jpeg,png}``, classes sorted by name.

The scan happens once, in the service process; the index (relative paths packed into one
buffer + offsets, and labels) is placed in a shared-memory segment that workers map
read-only, so their memory stays flat however many files there are.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from ..shm import Segment
from .base import Source, SourceSpec, register
from .index import PackedStrings

EXTENSIONS = (".jpg", ".jpeg", ".png")


@register("imagefolder")
class ImageFolderSource(Source):
    def __init__(self, root: str, name: str, paths: PackedStrings, labels: np.ndarray,
                 classes: list, segment: Optional[Segment] = None):
        self.root, self.name, self.paths, self.labels = root, name, paths, labels
        self.classes, self._segment = classes, segment

    @classmethod
    def scan(cls, root: str, name: str = "") -> "ImageFolderSource":
        """Walk ``root`` and build the index in shared memory. Raises if nothing is found."""
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"dataset folder {root} does not exist")
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        rel, labels = [], []
        for label, cls_name in enumerate(classes):
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls_name), followlinks=True):
                dirnames.sort()
                for fn in sorted(filenames):
                    if fn.lower().endswith(EXTENSIONS):
                        rel.append(os.path.relpath(os.path.join(dirpath, fn), root))
                        labels.append(label)
        if not rel:
            raise ValueError(
                f"no images found in {root}: expected ImageFolder layout root/<class>/<image>"
                f" with extensions {', '.join(EXTENSIONS)}"
            )
        packed = PackedStrings.from_strings(rel)
        return cls._into_shared(root, name or os.path.basename(root), packed, np.asarray(labels, np.int64), classes)

    @classmethod
    def _into_shared(cls, root, name, packed, labels, classes) -> "ImageFolderSource":
        n, blob_len = len(labels), len(packed.blob)
        seg = Segment.create(16 + 8 * (n + 1) + 8 * n + max(blob_len, 1), tag="index")
        try:
            seg.array(np.int64, (2,))[:] = (n, blob_len)
            views = _views(seg, n, blob_len)
            views[0][:], views[1][:], views[2][:] = packed.offsets, labels, packed.blob
        except BaseException:
            seg.close()
            raise
        return cls(root, name, PackedStrings(views[2], views[0]), views[1], classes, seg)

    @classmethod
    def from_spec(cls, spec: SourceSpec) -> "ImageFolderSource":
        seg = Segment.attach(spec.index, readonly=True)
        n, blob_len = (int(x) for x in seg.array(np.int64, (2,)))
        offsets, labels, blob = _views(seg, n, blob_len)
        return cls(spec.path, spec.name, PackedStrings(blob, offsets), labels, [], seg)

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, i: int) -> bytes:
        with open(os.path.join(self.root, self.paths[i]), "rb") as f:
            return f.read()

    def describe(self, i: int) -> str:
        return os.path.join(self.root, self.paths[i])

    def spec(self) -> SourceSpec:
        return SourceSpec(self.name, "imagefolder", self.root, self._segment.name if self._segment else "")

    def close(self) -> None:
        if self._segment is not None:
            # drop our views first, or the mapping cannot be closed
            self.paths = self.labels = None  # type: ignore[assignment]
            self._segment.close()
            self._segment = None


def _views(seg: Segment, n: int, blob_len: int):
    off = 16
    offsets = seg.array(np.int64, (n + 1,), off)
    off += 8 * (n + 1)
    labels = seg.array(np.int64, (n,), off)
    off += 8 * n
    blob = seg.array(np.uint8, (blob_len,), off)
    return offsets, labels, blob
