"""Service configuration: one frozen dataclass, validated on construction.

Every field can come from the command line or from a ``LOADER_<FIELD>`` environment variable
(the command line wins), which is how containers configure the service.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional, Tuple

from .jpeg import DEFAULT_MAX_PIXELS, DecodeOptions
from .sources.demo import DEFAULT_COUNT

ON_ERROR = ("raise", "skip")
START_METHODS = ("spawn", "forkserver", "fork")


@dataclass(frozen=True)
class ServiceConfig:
    data: Tuple[str, ...] = ()  # datasets: ImageFolder, packed, WebDataset shards, HDF5 (sources/detect.py)
    demo: bool = False  # serve the embedded demo dataset
    demo_size: int = DEFAULT_COUNT
    workers: int = -1  # -1: the CPUs this process may use (affinity and cgroup quota, as in a container)
    max_workers: int = 256
    host: str = "127.0.0.1"
    data_port: int = 5555  # 0: pick a free port
    http_port: int = 8080  # 0: pick a free port
    max_shm_mb: int = 4096  # cap on batch slots in shared memory, all clients together
    on_error: str = "raise"  # a sample that fails to decode: fail the stream, or skip it
    heartbeat_s: float = 2.0  # ZMTP heartbeat; silent peers are dropped after 3 intervals
    stop_timeout_s: float = 5.0  # per stage of the worker stop ladder
    drain_s: float = 2.0  # on stop, let tasks in flight finish and go out for up to this long
    task_deadline_s: float = 0.0  # a task running longer has its worker killed and is redone; 0: from measured times
    task_deadline_floor_s: float = 10.0  # the least a task gets when the deadline is derived (deadlines.py)
    max_sample_bytes: int = 64 << 20  # a loose image file larger than this is refused (on_error names it)
    max_skipped: int = 1000  # on_error=skip: samples one stream may skip before it fails with the list; 0: no cap
    start_method: str = "spawn"
    io_threads: int = 1
    log_level: str = "info"
    autoscale: str = ""  # "MIN:MAX" turns the autoscaler on
    autoscale_interval_s: float = 2.0
    status_log_s: float = 30.0  # log a throughput line this often while clients are served; 0: never
    max_http_connections: int = 64  # REST connections at once; more are answered 503 and closed at accept
    http_receipt_s: float = 10.0  # a REST request must arrive whole (headers and body) within this
    max_http_body_bytes: int = 65536  # a larger REST body is answered 413 before it is read
    api_token: str = ""  # guards mutating REST calls; see auth.py for the fallbacks
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # larger images are refused from their header (decode bombs)
    jpeg_fast_dct: bool = False  # libjpeg's IFAST DCT (docs/benchmarks.md: speed vs PSNR)
    jpeg_fast_upsample: bool = False  # plain chroma upsampling instead of the smooth ("fancy") one
    api_token_file: str = ""
    curve_keys: str = ""  # a keys directory (loader-service keys): CURVE on the data port, known clients only

    def __post_init__(self) -> None:
        if self.workers == -1:
            object.__setattr__(self, "workers", available_cpus())
        if not self.data and not self.demo:
            raise ValueError("no dataset: give --data PATH (ImageFolder, packed, WebDataset shards or HDF5) "
                             "or --demo")
        if not 0 <= self.workers <= self.max_workers:
            raise ValueError(f"workers must be in [0, {self.max_workers}], got {self.workers}")
        for name in ("data_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {self.start_method!r}")
        if self.autoscale:
            from .autoscale import AutoscalePolicy

            AutoscalePolicy.parse(self.autoscale, self.autoscale_interval_s)  # raises if malformed
        if self.max_shm_mb < 1 or self.demo_size < 1 or self.heartbeat_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("max_shm_mb, demo_size, heartbeat_s and stop_timeout_s must be positive")
        if self.task_deadline_s < 0 or self.task_deadline_floor_s <= 0:
            raise ValueError("task_deadline_s must be >= 0 (0: derived from measured task times) and "
                             f"task_deadline_floor_s > 0, got {self.task_deadline_s} and {self.task_deadline_floor_s}")
        if min(self.max_sample_bytes, self.max_http_connections, self.max_http_body_bytes) < 1 or self.http_receipt_s <= 0:
            raise ValueError("max_sample_bytes, max_http_connections, max_http_body_bytes and http_receipt_s must be "
                             f"positive, got {self.max_sample_bytes}, {self.max_http_connections}, "
                             f"{self.max_http_body_bytes} and {self.http_receipt_s}")
        if self.max_skipped < 0:
            raise ValueError(f"max_skipped must be >= 0 (0: no cap), got {self.max_skipped}")
        DecodeOptions(self.max_image_pixels)  # raises if the limit is out of range
        if self.status_log_s < 0:
            raise ValueError(f"status_log_s must be >= 0 (0 turns the log line off), got {self.status_log_s}")

    @property
    def decode_options(self) -> DecodeOptions:
        return DecodeOptions(self.max_image_pixels, self.jpeg_fast_dct, self.jpeg_fast_upsample)

    @property
    def max_shm_bytes(self) -> int:
        return self.max_shm_mb << 20

    @classmethod
    def from_env(cls, environ: Optional[dict] = None, **overrides) -> "ServiceConfig":
        """Defaults, then ``LOADER_*`` variables, then ``overrides`` (those not None)."""
        env = os.environ if environ is None else environ
        values: dict = {}
        for f in fields(cls):
            raw = env.get(f"LOADER_{f.name.upper()}")
            if raw is not None and raw != "":
                values[f.name] = _parse(f.name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (the
    limit of a container or pod, which os.cpu_count() does not see)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _parse(name: str, typ, raw: str):
    typ = str(typ)
    try:
        if "Tuple" in typ:
            return tuple(p for p in raw.split(os.pathsep) if p)
        if typ == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typ == "int":
            return int(raw)
        if typ == "float":
            return float(raw)
    except ValueError:
        raise ValueError(f"LOADER_{name.upper()}={raw!r} is not a valid {typ}") from None
    return raw
