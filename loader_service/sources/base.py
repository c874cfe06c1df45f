"""The one interface every dataset format implements."""

from __future__ import annotations

import abc
import hashlib
import importlib
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Tuple, Union

import numpy as np

from wire.plan import Blocks

Sample = Union[bytes, np.ndarray]

# The image files a folder or a shard member may be: torchvision's ImageFolder list, so a dataset
# has the same samples here as under a DataLoader (transforms.decode reads every one of them).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""What :meth:`Source.read` returns, and :func:`~loader_service.decode.transforms.process_sample` takes:

* ``bytes``: an encoded image file, JPEG, PNG, WebP, BMP, TIFF or PPM/PGM (the worker decodes it); or
* ``numpy.ndarray``: pixels already decoded, ``uint8``, shape ``(H, W, 3)`` (RGB) or ``(H, W)``
  (grey; it becomes RGB like a grey PNG does). Any strides. The worker crops, flips and resizes
  it with the same math and the same random draws as a decoded image of that size, so a
  raw array gives the very bytes its lossless (PNG) encoding would.

Nothing else: a source with other layouts (``H x W x 1``, BGR, ...) converts before returning.
"""


@dataclass(frozen=True)
class SourceSpec:
    """How a worker process reopens a source: small, msgpack/pickle friendly."""

    name: str
    kind: str  # "imagefolder" | "packed" | "webdataset" | "hdf5"
    path: str
    index: str = ""  # where the index lives, if apart from path: a shared-memory segment, a folder
    options: Tuple[Tuple[str, Any], ...] = ()  # kind-specific settings as (key, value) pairs

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"unknown source kind {self.kind!r}; known: {sorted(SOURCE_KINDS)}")


class Source(abc.ABC):
    """Random access to samples (see :data:`Sample`) and their integer labels."""

    name: str
    labels: np.ndarray  # int64, one per sample; the dispatcher sends these with each batch

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def read(self, i: int) -> Sample:
        """Sample ``i``: encoded bytes (an image file) or a decoded uint8 array; see :data:`Sample`."""

    @abc.abstractmethod
    def describe(self, i: int) -> str:
        """A human-readable locator of sample ``i`` (a path, a key) for error messages."""

    @abc.abstractmethod
    def spec(self) -> SourceSpec: ...

    def prefetch(self, plan, batch: int) -> None:
        """A hint from the dispatcher: ``plan``'s batch ``batch`` was just handed to a worker, the
        next ones follow. Must return at once; a source in object storage fetches ahead on it."""

    def idle(self) -> None:
        """The decode process has no task to run next: let go of what it holds only to be quick
        on its next read and that other processes may be waiting for (a source in object storage
        unpins its open shards, so a cache full of them has room for another process's)."""

    def blocks(self) -> Optional[Blocks]:
        """The dataset's units of reading, for a shuffle window (``JobSpec.shuffle_window``: the
        plan permutes blocks, then samples within windows of W blocks; see :mod:`wire.plan`).
        ``None`` (this default): every sample is its own block, as in a folder of files, a packed
        file or HDF5, where a window then changes nothing. A sharded format returns its shards'
        first samples. Called in the service's process, at a Hello with a window; cheap after the first call."""
        return None

    def close(self) -> None:
        """Release what the source holds. Idempotent."""

    def fingerprint(self) -> str:
        """The dataset's identity beside its length: a digest of its index (sample names, sizes
        and labels; never modification times, so two copies of one dataset on two replicas
        agree). Computed in the service, once; a stream or a resume made on another fingerprint
        is refused rather than mixed."""
        fp = getattr(self, "_fingerprint", None)
        if fp is None:
            fp = self._fingerprint = digest(type(self).__name__, *self.index_parts())
        return fp

    def changes_on_disk(self) -> Optional["DiskChange"]:
        """What differs between the dataset's files now and the index the service serves (taken
        when it started), or None when nothing does or this format is not watched. Called by the
        service's watch thread, never by a worker; cheap when nothing changed."""
        return None

    def index_parts(self) -> Tuple[Any, ...]:
        """What :meth:`fingerprint` digests: strings and buffers (numpy arrays) describing every sample."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its index")

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1 if len(self.labels) else 0


@dataclass(frozen=True)
class DiskChange:
    """Files added to or removed from a dataset since its index was taken: they are not served
    (the index is the dataset's identity for the service's life; see README "Resume")."""

    added: int
    removed: int
    relabelled: int  # samples still there whose class number moved (a class folder added or removed before theirs)
    examples: Tuple[str, ...]  # a few of the paths added ("+ a/b.jpg") or removed ("- a/c.jpg")

    def describe(self) -> str:
        parts = [f"{n} {what}" for n, what in ((self.added, "files added"), (self.removed, "removed"),
                                                (self.relabelled, "relabelled")) if n]
        return ", ".join(parts or ["folders changed, no image added or removed"]) + (
            f" (e.g. {'; '.join(self.examples)})" if self.examples else "")


def digest(*parts: Any) -> str:
    """A short hex digest of strings and buffers, each part delimited (24 hex characters)."""
    h = hashlib.blake2b(digest_size=12)
    for part in parts:
        data = part.encode() if isinstance(part, str) else memoryview(np.ascontiguousarray(part)).cast("B")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def open_source(spec: SourceSpec) -> Source:
    """Reopen a source in a worker from its spec (no index is copied)."""
    return SOURCE_KINDS[spec.kind].from_spec(spec)


SOURCE_KINDS: dict = {}


def register(kind: str):
    """Class decorator: ``@register("kind")`` makes a :class:`Source` subclass the one that
    :func:`open_source` reopens specs of that kind with. A kind registered outside this package
    (a format of one's own, a test double) works in the service's spawned workers too: the pool
    hands each worker :func:`kind_modules` of its specs, which it imports before opening them."""

    def deco(cls):
        SOURCE_KINDS[kind] = cls
        return cls

    return deco


def kind_modules(specs: Iterable[SourceSpec]) -> Tuple[str, ...]:
    """The modules that registered the kinds of ``specs`` in this process: what another process
    (a spawned worker starts with only the built-in kinds) imports before :func:`open_source`."""
    return tuple(sorted({SOURCE_KINDS[s.kind].__module__ for s in specs}))


def import_kind_modules(modules: Iterable[str]) -> None:
    """Import what :func:`kind_modules` named, so that their kinds are registered here too."""
    for name in modules:
        importlib.import_module(name)
