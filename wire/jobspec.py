"""The job's specification, declared once: everything that fixes which samples a job's ranks
get, in which batches, and what bytes each sample becomes.

Every rank of a job sends the same :class:`JobSpec` (a rank and an epoch ride beside it in the
:class:`~wire.protocol.Hello`); the service refuses a rank whose spec differs from a connected
rank's, naming the fields (:meth:`JobSpec.differences`), and a loader's saved position is
checked against the fields that fix the sample order (:meth:`JobSpec.order_fields`). Adding a
setting to a job means adding a field here: the wire, the job rules, the plan and the resume
check follow.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

import msgpack

from wire.errors import ErrorCode, ProtocolError, brief
from wire.plan import Blocks, PlanSpec

# RandomResizedCrop's ranges that every sample survives: an aspect ratio beyond 1000:1 overflows
# the crop arithmetic or rounds a side to nothing, so it is refused here, not failed per image
RATIO_LIMITS = (1e-3, 1e3)
MAX_ARGS_DEPTH = 8  # pipeline_args nest at most this deep (a list in a map in a list ...)
MAX_ARGS_BYTES = 64 * 1024  # and pack to at most this many bytes
MAX_SHUFFLE_WINDOW = (1 << 31) - 1  # blocks; a window of at least the dataset's blocks shuffles them all at once

_ORDER = {"order": True}  # the field fixes the epoch's global order of samples (a resume must match it)
_SHAPE = {"shape": True}  # the field shards that order into ranks' batches (a resume may change it)


@dataclass(frozen=True)
class JobSpec:
    """What one job's epochs are made of. Validated by :meth:`check` (the wire and the loader's
    config call it), so a bad value is refused with the field named before anything runs."""

    batch_size: int = field(metadata=_SHAPE)
    image_size: int = 224
    seed: int = field(default=0, metadata=_ORDER)
    world_size: int = field(default=1, metadata=_SHAPE)
    shuffle: bool = field(default=True, metadata=_ORDER)
    drop_last: bool = field(default=False, metadata=_ORDER)
    train: bool = True
    dataset: Optional[str] = field(default=None, metadata=_ORDER)  # None: the service's default dataset
    scale: list = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop's area range (train)
    ratio: list = field(default_factory=lambda: [3 / 4, 4 / 3])  # and its aspect-ratio range
    pipeline: str = ""  # a pipeline the service offers ("": the built-in train/eval recipe from the fields above)
    pipeline_args: dict = field(default_factory=dict)  # plain values, checked by the pipeline
    # shuffle shard-aware: the dataset's blocks (shards) permuted, in windows of this many blocks whose
    # samples are permuted among themselves (wire.plan); 0: one uniform permutation of the samples
    shuffle_window: int = field(default=0, metadata=_ORDER)

    def check(self) -> None:
        """Range checks the wire's types cannot express; raise :class:`ProtocolError` (``bad_job``)."""
        _range("batch_size", self.batch_size, 1, 1 << 16)
        _range("image_size", self.image_size, 8, 4096)
        _range("seed", self.seed, 0, (1 << 63) - 1)
        _range("world_size", self.world_size, 1, 1 << 16)
        _range("shuffle_window", self.shuffle_window, 0, MAX_SHUFFLE_WINDOW)
        check_crop(self.scale, self.ratio)
        check_pipeline(type(self).__name__, self.pipeline, self.pipeline_args)

    def plan(self, length: int, epoch: int, rank: int, origin: int = 0, blocks: Optional[Blocks] = None) -> PlanSpec:
        """The plan of ``rank``'s share of ``epoch`` over a dataset of ``length`` samples, from
        position ``origin`` of the epoch's global order (0: the whole epoch); ``blocks``: the
        dataset's (its source's :meth:`~loader_service.sources.base.Source.blocks`), which only a
        shuffle window uses."""
        window = self.shuffle_window if self.shuffle else 0
        return PlanSpec(length, self.batch_size, self.seed, epoch, rank, self.world_size, self.shuffle,
                        self.drop_last, origin, window, blocks if window else None)

    def on(self, dataset: str) -> "JobSpec":
        """This spec with its dataset resolved (``None`` names the service's default), with the
        numbers of ``scale``/``ratio`` as floats, so two ranks that mean the same compare equal."""
        return JobSpec(**{**self.as_dict(), "dataset": dataset, "scale": [float(x) for x in self.scale],
                          "ratio": [float(x) for x in self.ratio]})

    def differences(self, other: "JobSpec") -> List[Tuple[str, Any, Any]]:
        """(field, this spec's value, ``other``'s) for each field that differs."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name)) for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def order_fields(cls) -> Tuple[str, ...]:
        """The fields that fix the epoch's global order of samples: a resume must match them
        (with the dataset's identity); world size and batch size only shard it, and may change."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("order"))

    @classmethod
    def shape_fields(cls) -> Tuple[str, ...]:
        """The fields that shard the global order into each rank's batches."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("shape"))


def check_crop(scale: Any, ratio: Any) -> None:
    """RandomResizedCrop's ``scale`` (area fraction) and ``ratio`` (aspect): two finite numbers
    each, ``0 < min <= max``, scale at most 1, ratio within :data:`RATIO_LIMITS`."""
    for name, v in (("scale", scale), ("ratio", ratio)):
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)):
            raise ProtocolError(f"{name} must be two finite numbers, got {brief(v)}", ErrorCode.BAD_JOB)
        if not 0 < v[0] <= v[1]:
            raise ProtocolError(f"{name} must satisfy 0 < min <= max, got {brief(v)}", ErrorCode.BAD_JOB)
    if scale[1] > 1:
        raise ProtocolError(f"scale max must be <= 1, got {scale[1]}", ErrorCode.BAD_JOB)
    lo, hi = RATIO_LIMITS
    if not lo <= ratio[0] <= ratio[1] <= hi:
        raise ProtocolError(f"ratio must lie within [{lo:g}, {hi:g}] (an aspect beyond that leaves no pixels to "
                            f"crop), got {brief(ratio)}", ErrorCode.BAD_JOB)


def check_pipeline(where: str, pipeline: str, pipeline_args: dict) -> None:
    """A pipeline's name and arguments, before anything builds it: plain, shallow and small."""
    if len(pipeline) > 64:
        raise ProtocolError(f"{where}.pipeline: a name of at most 64 characters", ErrorCode.BAD_JOB)
    if pipeline_args and not pipeline:
        raise ProtocolError("pipeline_args given without a pipeline name", ErrorCode.BAD_JOB)
    if not all(isinstance(k, str) for k in pipeline_args):
        raise ProtocolError("pipeline_args keys must be strings", ErrorCode.BAD_JOB)
    if _deeper_than(pipeline_args, MAX_ARGS_DEPTH):
        raise ProtocolError(f"pipeline_args nest deeper than {MAX_ARGS_DEPTH} levels", ErrorCode.BAD_JOB)
    size = len(msgpack.packb(pipeline_args, use_bin_type=True))
    if size > MAX_ARGS_BYTES:
        raise ProtocolError(f"pipeline_args take {size} bytes packed; at most {MAX_ARGS_BYTES}", ErrorCode.BAD_JOB)


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether ``value`` nests more than ``levels`` containers deep (stops at the limit, so a
    hostile nesting costs no more than ``levels`` frames)."""
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return False
    return levels <= 0 or any(_deeper_than(v, levels - 1) for v in items)


def _range(name: str, v: int, lo: int, hi: int) -> None:
    if not lo <= v <= hi:
        raise ProtocolError(f"JobSpec.{name} must be [{lo}, {hi}], got {v}", ErrorCode.BAD_JOB)


__all__ = ["JobSpec", "check_crop", "check_pipeline", "RATIO_LIMITS", "MAX_ARGS_DEPTH", "MAX_ARGS_BYTES",
           "MAX_SHUFFLE_WINDOW"]
