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

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from wire.errors import ErrorCode, ProtocolError
from wire.plan import PlanSpec

_ORDER = {"order": True}  # the field fixes the order of samples (the plan), not only their bytes


@dataclass(frozen=True)
class JobSpec:
    """What one job's epochs are made of. Validated by :meth:`check` (the wire and the loader's
    config call it), so a bad value is refused with the field named before anything runs."""

    batch_size: int = field(metadata=_ORDER)
    image_size: int = 224
    seed: int = field(default=0, metadata=_ORDER)
    world_size: int = field(default=1, metadata=_ORDER)
    shuffle: bool = field(default=True, metadata=_ORDER)
    drop_last: bool = field(default=False, metadata=_ORDER)
    train: bool = True
    dataset: Optional[str] = field(default=None, metadata=_ORDER)  # None: the service's default dataset
    scale: list = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop's area range (train)
    ratio: list = field(default_factory=lambda: [3 / 4, 4 / 3])  # and its aspect-ratio range
    pipeline: str = ""  # a pipeline the service offers ("": the built-in train/eval recipe from the fields above)
    pipeline_args: dict = field(default_factory=dict)  # plain values, checked by the pipeline

    def check(self) -> None:
        """Range checks the wire's types cannot express; raise :class:`ProtocolError` (``bad_job``)."""
        _range("batch_size", self.batch_size, 1, 1 << 16)
        _range("image_size", self.image_size, 8, 4096)
        _range("seed", self.seed, 0, (1 << 63) - 1)
        _range("world_size", self.world_size, 1, 1 << 16)
        for name in ("scale", "ratio"):
            v = getattr(self, name)
            if len(v) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                raise ProtocolError(f"{name} must be two numbers, got {v!r}", ErrorCode.BAD_JOB)
            if not 0 < v[0] <= v[1]:
                raise ProtocolError(f"{name} must satisfy 0 < min <= max, got {v!r}", ErrorCode.BAD_JOB)
        if self.scale[1] > 1:
            raise ProtocolError(f"scale max must be <= 1, got {self.scale[1]}", ErrorCode.BAD_JOB)
        check_pipeline(type(self).__name__, self.pipeline, self.pipeline_args)

    def plan(self, length: int, epoch: int, rank: int) -> PlanSpec:
        """The plan of ``rank``'s share of ``epoch`` over a dataset of ``length`` samples."""
        return PlanSpec(length, self.batch_size, self.seed, epoch, rank, self.world_size, self.shuffle,
                        self.drop_last)

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
        """The fields that fix which samples come in which batch (a resume must match them)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("order"))


def check_pipeline(where: str, pipeline: str, pipeline_args: dict) -> None:
    if len(pipeline) > 64:
        raise ProtocolError(f"{where}.pipeline: a name of at most 64 characters", ErrorCode.BAD_JOB)
    if pipeline_args and not pipeline:
        raise ProtocolError("pipeline_args given without a pipeline name", ErrorCode.BAD_JOB)
    if not all(isinstance(k, str) for k in pipeline_args):
        raise ProtocolError("pipeline_args keys must be strings", ErrorCode.BAD_JOB)


def _range(name: str, v: int, lo: int, hi: int) -> None:
    if not lo <= v <= hi:
        raise ProtocolError(f"JobSpec.{name} must be [{lo}, {hi}], got {v}", ErrorCode.BAD_JOB)


__all__ = ["JobSpec", "check_pipeline"]
