"""The loader's counters: what :meth:`RemoteLoader.stats` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoaderStats:
    batches: int = 0
    samples: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # time the trainer spent blocked in next() waiting for data
    h2d_s: float = 0.0  # time spent issuing/waiting for host-to-device copies
    restarts: int = 0  # streams started again after the service forgot this loader's stream
    quarantined: int = 0  # replicas refused for serving other data (each replica and dataset once)
    local_batches: int = 0  # batches read from a co-located service's shared memory, not the socket (local=True)
