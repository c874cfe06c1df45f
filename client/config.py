"""The loader's settings: one frozen dataclass, validated on construction. The job's own fields
(what every rank shares: batch size, seed, dataset, ...) are its :class:`~wire.jobspec.JobSpec`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

from client.errors import LoaderError
from wire.errors import ProtocolError
from wire.jobspec import JobSpec
from wire.protocol import DEFAULT_HEARTBEAT_S, MAX_HEARTBEAT_S

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclass(frozen=True)
class LoaderConfig:
    """This loader's settings. Build it from flat keywords (as :class:`~client.RemoteLoader`
    takes them) with :meth:`of`."""

    endpoint: str
    spec: JobSpec  # the job: what every rank shares
    rank: int = 0
    prefetch: int = 4
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"; "cuda" becomes "cuda:<current device>" here
    timeout: float = 60.0  # seconds without any message before LoaderTimeout
    job: str = ""
    normalize: Union[bool, Tuple[str, ...]] = False  # True: every RGB output; or the output names to normalize
    mean: Tuple[float, ...] = IMAGENET_MEAN  # on the 0..255 scale
    std: Tuple[float, ...] = IMAGENET_STD
    dtype: str = "float32"  # of normalized images: float32 | float16 | bfloat16
    echo: int = 1  # batch echoing: yield each batch this many times
    device_prefetch: int = 2  # batches copied to the device ahead of the one in use
    replica_timeout: float = 10.0  # with several replicas: one down this long loses its batches to the others
    # ZMTP heartbeat: a PING every heartbeat_s, also while the trainer is busy (libzmq's thread sends
    # it); a silent service counts as down after 3, and the service cuts a connection silent for 3
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    epoch_lookahead: bool = True  # start epoch e+1 on the service once all of epoch e is asked for
    curve_keys: Optional[str] = None  # a keys dir (client.key_secret + server.key) for CURVE; None: env LOADER_CURVE_KEYS
    # an endpoint tcp://NAME:port stands for every address NAME resolves to, looked up again this often
    # and after a connection loss (client/membership.py); 0: the name goes to libzmq as is, once
    dns_refresh_s: float = 10.0
    dns_server: Optional[str] = None  # "ip[:port]": ask this DNS server (dnspython); None: env LOADER_DNS_SERVER, else the system's resolver
    expect_replicas: int = 0  # size the window (batches in flight, host memory) for this many replicas; 0: as many as at the start
    # co-located mode: a replica whose shared memory this process reaches (same host, shared /dev/shm)
    # lends its batches in place (one copy out of its slots, no socket); the others go over the socket
    local: bool = False
    # bulk lanes: receive each batch's outputs on this many plain TCP connections per replica, beside
    # its ZeroMQ connection, where the service offers them (--lane-port); 0: data frames only
    lanes: int = 0

    @classmethod
    def of(cls, endpoint: str, **settings: Any) -> "LoaderConfig":
        """From flat keyword settings: those that name a :class:`JobSpec` field form the spec
        (``pipeline=None`` and ``pipeline_args=None`` mean none), the rest are the loader's own."""
        job = {k: settings.pop(k) for k in JobSpec.names() if k in settings}
        if job.get("pipeline") is None:
            job.pop("pipeline", None)
        if job.get("pipeline_args") is None:
            job.pop("pipeline_args", None)
        elif not isinstance(job["pipeline_args"], dict):
            raise ValueError(f"pipeline_args must be a dict, got {type(job['pipeline_args']).__name__}")
        for name in ("scale", "ratio"):
            if name in job:
                job[name] = list(job[name])
        if "batch_size" not in job:
            raise ValueError("batch_size is required")
        return cls(endpoint=endpoint, spec=JobSpec(**job), **settings)

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame this loader accepts: a full batch of images plus 1 MiB for the
        header (indices, skip reasons, an error's traceback). A peer sending more is dropped."""
        return self.spec.batch_size * self.spec.image_size * self.spec.image_size * 3 + (1 << 20)

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"endpoint must look like tcp://host:port, got {self.endpoint!r}")
        try:
            self.spec.check()
        except ProtocolError as exc:
            raise ValueError(f"invalid job setting: {exc}") from None
        checks = [
            ("rank", 0 <= self.rank < self.spec.world_size), ("prefetch", 1 <= self.prefetch <= 256),
            ("timeout", self.timeout > 0), ("echo", self.echo >= 1),
            ("replica_timeout", self.replica_timeout > 0), ("heartbeat_s", 0 < self.heartbeat_s <= MAX_HEARTBEAT_S),
            ("dns_refresh_s", self.dns_refresh_s >= 0), ("expect_replicas", 0 <= self.expect_replicas <= 64),
            ("device_prefetch", 1 <= self.device_prefetch <= 8), ("lanes", 0 <= self.lanes <= 8),
            ("dtype", self.dtype in ("float32", "float16", "bfloat16")),
            ("mean/std", len(self.mean) == 3 and len(self.std) == 3 and all(s > 0 for s in self.std)),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"invalid {name}: {getattr(self, name.split('/')[0], None)!r}")
        if not isinstance(self.normalize, bool):
            names = (self.normalize,) if isinstance(self.normalize, str) else tuple(self.normalize)
            object.__setattr__(self, "normalize", names)
        if self.dns_server is not None:
            from client.names import parse_server

            parse_server(self.dns_server)
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.curve_keys is None:
            from client.curve import default_keys_dir

            object.__setattr__(self, "curve_keys", default_keys_dir())


_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def resolve_device(device: str) -> str:
    """``"cpu"`` or an explicit ``"cuda:N"``. A bare ``"cuda"`` takes the device current *now*
    (``torch.cuda.current_device()``), so the loader's stream, events and allocations stay on
    that device whatever the trainer makes current later."""
    m = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise ValueError(f"invalid device: {device!r} (use 'cpu', 'cuda' or 'cuda:N')")
    if m.group(1) == "cpu":
        return "cpu"
    import torch  # only the CUDA path needs it here

    if not torch.cuda.is_available():
        raise LoaderError("bad_device", f"device={device!r} but CUDA is not available in this torch build "
                          f"({torch.__version__}); use device='cpu'")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if m.group(2) is None else int(m.group(2))
    if index >= count:
        raise LoaderError("bad_device", f"device={device!r} but this machine has {count} CUDA device(s): "
                          f"use cuda:0..cuda:{count - 1}")
    return f"cuda:{index}"


def _tuple(x: Sequence[float]) -> Tuple[float, ...]:
    return tuple(float(v) for v in x)
