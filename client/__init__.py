"""client: the trainer-side library. ``from client import RemoteLoader``."""

from client.batch import Batch
from client.config import LoaderConfig
from client.errors import LoaderError, LoaderTimeout
from client.loader import LoaderStats, RemoteLoader, resolve_endpoints

__all__ = ["RemoteLoader", "resolve_endpoints", "Batch", "LoaderConfig", "LoaderError", "LoaderTimeout", "LoaderStats"]
