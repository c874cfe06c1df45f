"""The loader's settings: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclass(frozen=True)
class LoaderConfig:
    endpoint: str
    batch_size: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    image_size: int = 224
    train: bool = True
    prefetch: int = 4
    device: str = "cpu"
    dataset: Optional[str] = None
    timeout: float = 60.0  # seconds without any message before LoaderTimeout
    job: str = ""
    scale: Tuple[float, float] = (0.08, 1.0)
    ratio: Tuple[float, float] = (3 / 4, 4 / 3)
    normalize: bool = False
    mean: Tuple[float, ...] = IMAGENET_MEAN  # on the 0..255 scale
    std: Tuple[float, ...] = IMAGENET_STD
    dtype: str = "float32"  # of normalized images: float32 | float16 | bfloat16
    echo: int = 1  # batch echoing: yield each batch this many times
    device_prefetch: int = 2  # batches copied to the device ahead of the one in use
    replica_timeout: float = 10.0  # with several replicas: one down this long loses its batches to the others
    heartbeat_s: float = 2.0  # ZMTP heartbeat towards the service; a silent one counts as down after 3x
    epoch_lookahead: bool = True  # start epoch e+1 on the service once all of epoch e is asked for

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"endpoint must look like tcp://host:port, got {self.endpoint!r}")
        checks = [
            ("batch_size", self.batch_size >= 1), ("world_size", self.world_size >= 1),
            ("rank", 0 <= self.rank < self.world_size), ("seed", self.seed >= 0),
            ("image_size", self.image_size >= 8), ("prefetch", 1 <= self.prefetch <= 256),
            ("timeout", self.timeout > 0), ("echo", self.echo >= 1),
            ("replica_timeout", self.replica_timeout > 0), ("heartbeat_s", self.heartbeat_s > 0),
            ("device_prefetch", 1 <= self.device_prefetch <= 8),
            ("dtype", self.dtype in ("float32", "float16", "bfloat16")),
            ("mean/std", len(self.mean) == 3 and len(self.std) == 3 and all(s > 0 for s in self.std)),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"invalid {name}: {getattr(self, name.split('/')[0], None)!r}")


def _tuple(x: Sequence[float]) -> Tuple[float, ...]:
    return tuple(float(v) for v in x)
