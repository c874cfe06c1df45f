"""client: the trainer-side library. ``from client import RemoteLoader``."""

from .batch import Batch
from .config import LoaderConfig
from .errors import LoaderError, LoaderTimeout
from .loader import LoaderStats, RemoteLoader, resolve_endpoints

__all__ = ["RemoteLoader", "resolve_endpoints", "Batch", "LoaderConfig", "LoaderError", "LoaderTimeout", "LoaderStats"]
