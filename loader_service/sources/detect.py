"""Pick the source kind for a dataset path, and open it.

* a folder with ``meta.json``: packed;
* a ``.tar`` file, a brace pattern such as ``train-{000..146}.tar``, or a folder holding
  ``.tar`` files (its top-level shards, sorted): webdataset;
* a ``.h5`` / ``.hdf5`` file: hdf5;
* any other folder: imagefolder (``root/<class>/<image>``);
* a URL (``s3://``, ``gs://``, ``http(s)://``): see :func:`open_url`.

Anything else (a missing path, an unreadable one, another kind of file, compressed tars, a
folder with no images) is an error that says which path and why.
"""

from __future__ import annotations

import os
from typing import Optional

from loader_service.sources.base import Source

HDF5_EXTS = (".h5", ".hdf5")
COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")


def detect_kind(path: str) -> str:
    """The source kind for ``path`` (no data is read beyond a folder listing)."""
    from loader_service.sources.webdataset import is_pattern

    if is_pattern(path):
        return "webdataset"
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path} does not exist")
    if not os.access(path, os.R_OK) or (os.path.isdir(path) and not os.access(path, os.X_OK)):
        raise PermissionError(f"cannot read dataset {path}: permission denied")
    lower = path.lower()
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "meta.json")):
            return "packed"
        with os.scandir(path) as entries:
            if any(e.name.endswith(".tar") and not e.name.startswith(".") and e.is_file() for e in entries):
                return "webdataset"
        return "imagefolder"
    if lower.endswith(COMPRESSED_TAR):
        raise ValueError(f"{path}: compressed tar shards cannot be read by offset; repack them as plain .tar")
    if lower.endswith(".tar"):
        return "webdataset"
    if lower.endswith(HDF5_EXTS):
        return "hdf5"
    raise ValueError(f"{path}: unsupported dataset file; expected a folder (ImageFolder or packed), "
                     "a .tar shard (or a folder or {000..009} pattern of them) or an .h5/.hdf5 file")


def open_path(path: str, max_sample_bytes: Optional[int] = None, remote=None, **options) -> Source:
    """Open the dataset at ``path`` as whichever source :func:`detect_kind` picks; a URL
    (``s3://``, ``gs://``, ``http(s)://``) as :func:`open_url` does, reached and cached as
    ``remote`` (a :class:`~loader_service.sources.remote.store.RemoteSettings`) says.

    ``options`` go to that source (``name`` for any; ``label_map`` for webdataset;
    ``rdcc_nbytes``, ``rdcc_nslots``, ``rdcc_w0``, ``images``, ``labels`` for hdf5).
    ``max_sample_bytes`` caps a loose file's read (imagefolder, local or remote); the other kinds read sizes
    from their own index, bounded by the shard or file they were scanned from.
    """
    from loader_service.sources.remote.store import RemoteSettings, is_url

    if is_url(path):
        return open_url(path, remote or RemoteSettings(), options.get("name", ""), max_sample_bytes)
    kind = detect_kind(path)
    if kind == "packed":
        from loader_service.sources.packed import PackedSource

        return PackedSource(path, **options)
    if kind == "webdataset":
        from loader_service.sources.webdataset import WebDatasetSource

        return WebDatasetSource.open(path, **options)
    if kind == "hdf5":
        from loader_service.sources.hdf5 import HDF5Source

        if os.path.getsize(path) == 0:
            raise ValueError(f"{path}: empty file, not an HDF5 dataset")
        return HDF5Source(path, **options)
    from loader_service.sources.imagefolder import ImageFolderSource

    if max_sample_bytes is not None:
        options["max_sample_bytes"] = max_sample_bytes
    return ImageFolderSource.scan(path, **options)


def open_url(url: str, remote, name: str = "", max_sample_bytes: Optional[int] = None) -> Source:
    """A dataset in object storage: a packed dataset when the prefix has a ``meta.json`` right
    under it; WebDataset shards when the URL is a ``.tar``, a pattern, or a
    prefix with ``.tar`` objects right under it; else an ImageFolder of loose objects when the
    prefix has class folders (``<prefix>/<class>/<image>``); else an error naming the URL. One
    listing of the prefix's first level decides, and the source opened reuses it."""
    from loader_service.sources.remote.store import Location, Store

    store = Store(Location.parse(url), remote)
    kind = store.kind()
    cap = {} if max_sample_bytes is None else {"max_sample_bytes": max_sample_bytes}
    if kind == "packed":
        from loader_service.sources.remote.packed import RemotePackedSource

        return RemotePackedSource.open_url(url, remote, name=name, store=store, **cap)
    if kind == "webdataset":
        from loader_service.sources.remote.webdataset import RemoteWebDatasetSource

        return RemoteWebDatasetSource.open_url(url, remote, name=name, store=store)
    from loader_service.sources.remote.imagefolder import RemoteImageFolderSource

    return RemoteImageFolderSource.open_url(url, remote, name=name, store=store, **cap)
