"""ImageFolder layout: ``root/<class>/<file>.{jpg,jpeg,png}``, classes sorted by name.

The scan happens once, in the service process; the index (relative paths packed into one
buffer + offsets, and labels) is placed in a shared-memory segment that workers map
read-only, so their memory stays flat however many files there are.

Files added or removed later are not served: the index is the dataset's identity for the
service's life. The directories' modification times are kept from the scan, so the service's
watch thread notices such a change with one ``stat`` per directory and says what it is
(:meth:`ImageFolderSource.changes_on_disk`); a file replaced in place is refused at its read.

Hostile trees cost bounded work: the scan enters each real directory once (symlink loops are
reported, not followed again), and a read takes only a regular file of at most
``max_sample_bytes`` (see files.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from loader_service.shm import Segment
from loader_service.sources.base import IMAGE_EXTENSIONS, DiskChange, Source, SourceSpec, register
from loader_service.sources.files import DEFAULT_MAX_SAMPLE_BYTES, ScanProgress, log, read_regular, walk_once
from loader_service.sources.index import PackedStrings, printable

EXTENSIONS = IMAGE_EXTENSIONS
EXAMPLES = 3  # paths a DiskChange names
# A directory changed this close to its listing may show the same mtime after a further change
# (coarse kernel timestamps, NFS): it is listed again at the next look ("racy git").
RACY_NS = 2_000_000_000


@dataclass
class _Listing:
    """One walk of a folder: its images (relative paths, labels) and each directory's mtime."""

    classes: List[str]
    at_ns: int = 0  # wall clock when the listing began
    rel: List[str] = field(default_factory=list)
    labels: List[int] = field(default_factory=list)
    stats: List[Tuple[int, int]] = field(default_factory=list)  # only when asked for (the scan)
    mtimes: Dict[str, int] = field(default_factory=dict)  # directory -> mtime_ns before it was listed
    skipped: list = field(default_factory=list)


def is_class(name: str) -> bool:
    """A folder under the root that is a class (hidden ones are not)."""
    return bool(name) and not name.startswith(".")


def is_image(name: str) -> bool:
    return name.lower().endswith(EXTENSIONS)


def no_images(where: str) -> ValueError:
    return ValueError(f"no images found in {where}: expected ImageFolder layout root/<class>/<image>"
                      f" with extensions {', '.join(EXTENSIONS)}")


def layout(names: Sequence[str]) -> Tuple[List[str], List[int], List[int]]:
    """The ImageFolder of files named ``names`` ("/"-separated, relative to the root: an object
    store's keys under a prefix): its classes, and its images as (indices into ``names``, labels)
    in the order :meth:`ImageFolderSource.scan` lists the same tree (classes sorted; in each folder
    its files by name, then its subfolders), so the same files make the same samples in the same
    order. A class is a first-level folder holding anything (an object store has no empty folders)."""
    parts = [n.split("/") for n in names]
    classes = sorted({p[0] for p in parts if len(p) > 1 and is_class(p[0])})
    label = {c: i for i, c in enumerate(classes)}

    def order(i: int):  # a folder's files (0, name) before its subfolders (1, name): the local walk's order
        p = parts[i]
        return (label[p[0]],) + tuple((1, d) for d in p[1:-1]) + ((0, p[-1]),)

    picked = sorted((i for i, p in enumerate(parts)
                     if len(p) > 1 and p[0] in label and all(p[1:]) and is_image(p[-1])), key=order)
    return classes, picked, [label[parts[i][0]] for i in picked]


def _list(root: str, with_stats: bool, progress=lambda n: None) -> _Listing:
    root_mtime = os.stat(root).st_mtime_ns  # before the classes are listed: a class folder added moves it
    at_ns = time.time_ns()
    listing = _Listing(sorted(e.name for e in os.scandir(root) if e.is_dir() and is_class(e.name)), at_ns)
    listing.mtimes[root] = root_mtime
    seen: set = {(os.stat(root).st_dev, os.stat(root).st_ino)}  # a link back to the root is a loop too
    for label, cls_name in enumerate(listing.classes):
        for dirpath, filenames, mtime_ns in walk_once(os.path.join(root, cls_name), seen, listing.skipped, progress):
            listing.mtimes[dirpath] = mtime_ns
            for fn in filenames:
                if is_image(fn):
                    path = os.path.join(dirpath, fn)
                    listing.rel.append(os.path.relpath(path, root))
                    listing.labels.append(label)
                    if with_stats:
                        listing.stats.append(_stat(path))
    return listing


@register("imagefolder")
class ImageFolderSource(Source):
    def __init__(self, root: str, name: str, paths: PackedStrings, labels: np.ndarray, stats: np.ndarray,
                 classes: list, segment: Optional[Segment] = None,
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES):
        self.root, self.name, self.paths, self.labels = root, name, paths, labels
        self.stats = stats  # int64 (n, 2): each file's size and mtime (ns) at the scan; -1 where stat failed
        self.classes, self._segment, self.max_sample_bytes = classes, segment, max_sample_bytes
        self.scan_skipped: list = []  # (path, why) of folders the scan did not enter
        # the service's only (a worker's copy watches nothing): the last listing (the scan's, or a
        # later look's that found directories moved), and what that look found
        self._last_listing: Optional[_Listing] = None
        self._change: Optional[DiskChange] = None

    @classmethod
    def scan(cls, root: str, name: str = "", max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> "ImageFolderSource":
        """Walk ``root`` and build the index in shared memory. Raises if nothing is found.

        Directory symlinks are followed, each real directory once; the ones skipped are
        logged and kept in ``scan_skipped``."""
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"dataset folder {root} does not exist")
        listing = _list(root, with_stats=True, progress=ScanProgress(root))
        rel, labels, stats, skipped = listing.rel, listing.labels, listing.stats, listing.skipped
        if skipped:
            log.warning("scan of %s: %d folders not entered (each real folder is scanned once): %s%s", root,
                        len(skipped), "; ".join(f"{p}: {why}" for p, why in skipped[:5]),
                        " ..." if len(skipped) > 5 else "")
        if not rel:
            raise no_images(root)
        packed = PackedStrings.from_strings(rel)
        src = cls._into_shared(root, name or os.path.basename(root), packed, np.asarray(labels, np.int64),
                               np.asarray(stats, np.int64).reshape(-1, 2), listing.classes, max_sample_bytes)
        src.scan_skipped = skipped
        src._last_listing = listing
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
        return printable(os.path.join(self.root, self.paths[i]))

    def spec(self) -> SourceSpec:
        return SourceSpec(self.name, "imagefolder", self.root, self._segment.name if self._segment else "",
                          (("max_sample_bytes", self.max_sample_bytes),))

    def changes_on_disk(self) -> Optional[DiskChange]:
        """One ``stat`` per directory of the scan; the folder is walked again only when one moved
        since the last look."""
        last = self._last_listing
        if last is None:
            return None
        racy = any(m >= last.at_ns - RACY_NS for m in last.mtimes.values())
        if not racy and _mtimes_now(last.mtimes) == last.mtimes:
            return self._change
        self._last_listing = listing = _list(self.root, with_stats=False)
        self._change = self._compare(listing)
        return self._change

    def _compare(self, listing: _Listing) -> Optional[DiskChange]:
        old = {self.paths[i]: int(self.labels[i]) for i in range(len(self))}
        new = dict(zip(listing.rel, listing.labels))
        added = sorted(set(new) - set(old))
        removed = sorted(set(old) - set(new))
        relabelled = sum(1 for p, label in new.items() if p in old and old[p] != label)
        if not (added or removed or relabelled):
            return None  # folders touched, the images the same
        return DiskChange(len(added), len(removed), relabelled,
                          tuple([f"+ {printable(p)}" for p in added[:EXAMPLES]]
                                + [f"- {printable(p)}" for p in removed[:EXAMPLES]]))

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


def _mtimes_now(mtimes: Dict[str, int]) -> Dict[str, int]:
    """The same directories' mtimes now (-1: gone)."""
    out = {}
    for path in mtimes:
        try:
            out[path] = os.stat(path).st_mtime_ns
        except OSError:
            out[path] = -1
    return out


def _stat(path: str) -> tuple:
    """(size, mtime in ns) of the file a sample is read from (through a link, as a read sees it)."""
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1  # a broken link: the read fails and names it
    return st.st_size, st.st_mtime_ns
