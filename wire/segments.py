"""Where the service's shared-memory segments live and how they are named: the service makes them
(loader_service/shm.py), a co-located client maps them (client/local.py)."""

from __future__ import annotations

import os
import tempfile

PREFIX = "loader_service-"  # then the creator's pid, a tag and a random id: loader_service-<pid>-<tag>-<id>
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

__all__ = ["PREFIX", "SHM_DIR"]
