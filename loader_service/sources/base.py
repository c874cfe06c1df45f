"""The one interface every dataset format implements."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np


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
    """Random access to encoded samples and their integer labels."""

    name: str
    labels: np.ndarray  # int64, one per sample; the dispatcher sends these with each batch

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def read(self, i: int) -> bytes:
        """The encoded bytes of sample ``i`` (JPEG or PNG)."""

    @abc.abstractmethod
    def describe(self, i: int) -> str:
        """A human-readable locator of sample ``i`` (a path, a key) for error messages."""

    @abc.abstractmethod
    def spec(self) -> SourceSpec: ...

    def close(self) -> None:
        """Release what the source holds. Idempotent."""

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1 if len(self.labels) else 0


def open_source(spec: SourceSpec) -> Source:
    """Reopen a source in a worker from its spec (no index is copied)."""
    return SOURCE_KINDS[spec.kind].from_spec(spec)


SOURCE_KINDS: dict = {}


def register(kind: str):
    def deco(cls):
        SOURCE_KINDS[kind] = cls
        return cls

    return deco
