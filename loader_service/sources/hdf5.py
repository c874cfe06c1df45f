"""HDF5 files (h5py): one dataset of images and one of integer labels.

Images are either

* encoded: a 1-D variable-length uint8 dataset (``h5py.vlen_dtype(np.uint8)``), one JPEG or
  PNG per element, which is what ``loader-service pack --format hdf5`` writes; or
* raw: a uint8 array ``N x H x W x 3`` (RGB), ``N x H x W`` or ``N x H x W x 1`` (grey).
  ``read`` hands such an image to the worker as the array itself (``H x W x 3`` or ``H x W``,
  see :data:`~loader_service.sources.base.Sample`): no encode, no decode, and the worker's
  crop/flip/resize gives the same bytes as it would for a PNG of the same pixels.

Dataset names: ``images`` (else ``image``, ``imgs``, ``data``, ``x``) and ``labels`` (else
``label``, ``targets``, ``y``), or given explicitly. Class names come from the file's
``classes`` attribute (a JSON list) when it has one.

HDF5 handles must never cross fork or spawn: every worker opens the file itself (from the
spec: path, dataset names and chunk-cache settings), and the service process closes its own
handle once it has read the labels, reopening lazily (and after a fork) if it ever reads.

The chunk cache is per open file, so per worker: ``rdcc_nbytes`` (bytes; HDF5's default is
1 MiB), ``rdcc_nslots`` (hash slots; a prime about 100x the chunks that fit) and ``rdcc_w0``
(must be < 1: at 1, HDF5 2.0 keeps every chunk a random read touched, whatever
``rdcc_nbytes`` says). Unset, HDF5's defaults apply. Set them as keyword arguments or with
``LOADER_HDF5_RDCC_NBYTES`` / ``LOADER_HDF5_RDCC_NSLOTS`` / ``LOADER_HDF5_RDCC_W0``.
What ``python -m bench.index_memory hdf5-cache`` measured (random reads, one shuffled epoch):

* encoded images (what ``pack`` writes): chunks hold only references, the bytes live in
  HDF5's global heap, so the cache size makes no difference that the noise does not hide;
* raw arrays in compressed chunks of k images: every cache miss decompresses k images for one,
  and under a shuffled order a cache hits only in proportion to the fraction of the
  (uncompressed) dataset it holds: 4096 64x64 images in gzip chunks of 32 read at 360-850
  reads/s with caches of 0 to 16 MiB and ~13,600 with 64 MiB (all 48 MiB of it, per worker);
  chunks of one image read at 11,000-15,000/s whatever the cache. So store raw arrays one
  image per chunk (or uncompressed) unless every worker can afford to cache all of it.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from loader_service.sources.base import Sample, Source, SourceSpec, register

IMAGE_KEYS = ("images", "image", "imgs", "data", "x")
LABEL_KEYS = ("labels", "label", "targets", "y")
HDF5_FORMAT = "loader-hdf5"
ENV = {"rdcc_nbytes": "LOADER_HDF5_RDCC_NBYTES", "rdcc_nslots": "LOADER_HDF5_RDCC_NSLOTS",
       "rdcc_w0": "LOADER_HDF5_RDCC_W0"}


def _h5py():
    try:
        import h5py
    except ImportError:  # pragma: no cover - h5py is a service dependency
        raise ImportError("reading HDF5 datasets needs h5py: pip install h5py") from None
    return h5py


def cache_options(rdcc_nbytes: Optional[int] = None, rdcc_nslots: Optional[int] = None,
                  rdcc_w0: Optional[float] = None) -> dict:
    """Chunk-cache settings: the arguments, else the environment, else HDF5's defaults (None)."""
    given = {"rdcc_nbytes": rdcc_nbytes, "rdcc_nslots": rdcc_nslots, "rdcc_w0": rdcc_w0}
    out = {}
    for key, value in given.items():
        if value is None and os.environ.get(ENV[key]):
            raw = os.environ[ENV[key]]
            try:
                value = float(raw) if key == "rdcc_w0" else int(raw)
            except ValueError:
                raise ValueError(f"{ENV[key]}={raw!r} is not a number") from None
        if value is not None:
            if value < 0:
                raise ValueError(f"{key} must be >= 0, got {value}")
            if key == "rdcc_w0" and value >= 1:
                raise ValueError(f"rdcc_w0 must be < 1, got {value}: with 1, HDF5 keeps every chunk a random "
                                 "read touched, past rdcc_nbytes (measured: 48 MiB held with a 1 MiB cache)")
            out[key] = value
    return out


@register("hdf5")
class HDF5Source(Source):
    def __init__(self, path: str, name: str = "", images: Optional[str] = None, labels: Optional[str] = None,
                 load_labels: bool = True, **cache):
        self.path = os.path.abspath(path)
        self.name = name or os.path.splitext(os.path.basename(path))[0]
        self.cache = cache_options(**cache)
        self._file = self._ds = None
        self._pid = 0
        self._labels: Optional[np.ndarray] = None
        f = self._open()
        try:
            self.images_key = _pick(f, images, IMAGE_KEYS, "images", self.path)
            self.labels_key = _pick(f, labels, LABEL_KEYS, "labels", self.path)
            ds, lab = f[self.images_key], f[self.labels_key]
            h5py = _h5py()
            if ds.ndim == 1 and h5py.check_vlen_dtype(ds.dtype) == np.dtype(np.uint8):
                self.raw = False
            elif ds.dtype == np.uint8 and (ds.ndim == 3 or (ds.ndim == 4 and ds.shape[-1] in (1, 3))):
                self.raw = True
            else:
                raise ValueError(f"{self.path}: dataset {self.images_key!r} ({ds.dtype}, shape {ds.shape}) is neither "
                                 "variable-length uint8 (encoded images) nor uint8 N x H x W [x 3] (raw images)")
            if lab.ndim != 1 or lab.dtype.kind not in "iu":
                raise ValueError(f"{self.path}: labels {self.labels_key!r} must be 1-D integers, "
                                 f"got {lab.dtype} shape {lab.shape}")
            if len(lab) != len(ds):
                raise ValueError(f"{self.path}: {len(ds)} images but {len(lab)} labels")
            if len(ds) == 0:
                raise ValueError(f"{self.path}: the dataset {self.images_key!r} is empty")
            self._len = len(ds)
            classes = f.attrs.get("classes")
            self.classes: list = json.loads(classes) if isinstance(classes, (str, bytes)) else []
            if load_labels:
                self._labels = np.asarray(lab[:], dtype=np.int64)
                if self._labels.min() < 0:
                    raise ValueError(f"{self.path}: negative labels in {self.labels_key!r}")
        except BaseException:
            self.close()
            raise
        # No handle stays open in the service process: workers may be forked from it.
        self.close()

    def _open(self):
        if self._file is None or self._pid != os.getpid():
            h5py = _h5py()
            self._file, self._ds = None, None  # a handle from before a fork is never touched again
            try:
                self._file = h5py.File(self.path, "r", **self.cache)
            except OSError as exc:
                raise OSError(f"cannot open {self.path} as HDF5: {exc}") from None
            self._pid = os.getpid()
        return self._file

    @classmethod
    def from_spec(cls, spec: SourceSpec) -> "HDF5Source":
        opts = dict(spec.options)
        return cls(spec.path, spec.name, opts.pop("images", None), opts.pop("labels", None), load_labels=False, **opts)

    def spec(self) -> SourceSpec:
        opts = {"images": self.images_key, "labels": self.labels_key, **self.cache}
        return SourceSpec(self.name, "hdf5", self.path, options=tuple(sorted(opts.items())))

    def index_parts(self):
        return self.images_key, str(self._len), str(os.path.getsize(self.path)), self.labels

    @property
    def labels(self) -> np.ndarray:  # type: ignore[override]
        if self._labels is None:  # only a worker gets here; it never needs them for serving
            self._labels = np.asarray(self._open()[self.labels_key][:], dtype=np.int64)
        return self._labels

    def __len__(self) -> int:
        return self._len

    def read(self, i: int) -> Sample:
        """The encoded bytes, or for a raw dataset the pixels: ``H x W x 3`` RGB or ``H x W`` grey."""
        if self._ds is None or self._pid != os.getpid():
            self._ds = self._open()[self.images_key]
        value = self._ds[i]
        if not self.raw:
            return value.tobytes()
        if value.ndim == 3 and value.shape[-1] == 1:
            return value[:, :, 0]  # H x W x 1 -> H x W: the grey layout a Sample allows
        return value

    def describe(self, i: int) -> str:
        return f"{self.path}:/{self.images_key}[{i}]"

    def close(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            try:
                self._file.close()
            except Exception:  # pragma: no cover - closing a dead handle
                pass
        self._file = self._ds = None


def _pick(f, given: Optional[str], candidates, what: str, path: str) -> str:
    if given:
        if given not in f:
            raise ValueError(f"{path}: no dataset {given!r}; it has {sorted(f.keys())}")
        return given
    for key in candidates:
        if key in f:
            return key
    raise ValueError(f"{path}: no {what} dataset (looked for {', '.join(candidates)}); it has {sorted(f.keys())}")


def write_hdf5(path: str, samples, n: int, classes=(), chunk: int = 256, progress=None) -> int:
    """Write ``(name, bytes, label)`` samples (``n`` of them) as encoded images at ``path``.

    ``chunk``: samples per chunk of the image (and name) datasets. No compression filter: on a
    variable-length dataset it would compress only the references, and JPEGs do not shrink.
    The caller makes the write atomic.
    """
    h5py = _h5py()
    if n < 1:
        raise ValueError("nothing to write: no samples")
    chunk = max(1, min(int(chunk), n))
    labels = np.zeros(n, dtype=np.int64)
    count = 0
    with h5py.File(path, "w") as f:
        f.attrs["format"] = HDF5_FORMAT
        f.attrs["version"] = 1
        f.attrs["classes"] = json.dumps(list(classes))
        images = f.create_dataset("images", shape=(n,), dtype=h5py.vlen_dtype(np.uint8), chunks=(chunk,))
        names = f.create_dataset("names", shape=(n,), dtype=h5py.string_dtype(), chunks=(chunk,))
        block_img: list = []
        block_names: list = []
        for name, blob, label in samples:
            if count >= n:
                raise ValueError(f"more samples than the {n} announced")
            block_img.append(np.frombuffer(blob, dtype=np.uint8))
            block_names.append(name)
            labels[count] = label
            count += 1
            if len(block_img) == chunk or count == n:
                start = count - len(block_img)
                if len({len(b) for b in block_img}) > 1:
                    arr = np.empty(len(block_img), dtype=object)
                    for k, img in enumerate(block_img):
                        arr[k] = img
                    images[start:count] = arr
                else:  # h5py would take equal-length elements as one 2-D array: write them one by one
                    for k, img in enumerate(block_img):
                        images[start + k] = img
                names[start:count] = block_names
                block_img, block_names = [], []
            if progress is not None:
                progress(len(blob))
        if count != n:
            raise ValueError(f"{count} samples written but {n} announced")
        f.create_dataset("labels", data=labels, chunks=(min(n, 65536),))
    return count
