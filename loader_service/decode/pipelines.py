"""User-defined preprocessing: pipelines the operator installs, clients choose by name.

The contract. An operator registers ``--pipeline NAME=MODULE:CALLABLE``; ``CALLABLE`` is a
*factory*: given the job's arguments (an :class:`Args`, read with its typed getters, which
name the argument in every error) it returns a :class:`Pipeline`:

* ``outputs``: what every sample becomes, declared up front: name -> per-sample shape of a
  uint8 array (shapes may depend on the arguments). The service sizes its shared-memory slots
  from them and the wire carries one frame per output.
* ``process(item, out)``: turn one sample into those arrays. ``item`` holds the encoded bytes
  (or decoded array) as the source read them, the label, the dataset index, where the sample
  lives (``item.where``, for side files such as masks) and ``item.rng``, the per-sample
  draws keyed by (seed, epoch, sample): the same bytes on any worker and on resume (a
  :class:`~loader_service.decode.transforms.SampleRandom`: use it as a ``np.random.Generator``).
  ``out`` maps each output name to its place in the shared-memory slot: write there (no copy),
  or return a dict of arrays, which are checked (shape, dtype) and copied in.

Pipelines are code the operator installs on the service; clients only name them and pass
plain msgpack arguments. The built-in recipes are pipelines too (``train``, ``eval``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import msgpack
import numpy as np

from loader_service.decode.jpeg import DEFAULT_OPTIONS, DecodeOptions
from loader_service.sources.base import Sample
from wire.errors import brief
from wire.jobspec import RATIO_LIMITS, JobSpec

if TYPE_CHECKING:  # the built-in recipes below import transforms lazily, as they do
    from loader_service.decode.transforms import SampleRandom

MAX_SAMPLE_OUTPUT_BYTES = 256 << 20  # one sample's outputs together; a bigger declaration is a mistake
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
BUILTIN = {"train": "loader_service.decode.pipelines:train_pipeline", "eval": "loader_service.decode.pipelines:eval_pipeline"}


class PipelineError(ValueError):
    """A pipeline the service cannot use: an unknown name, arguments it refuses, bad outputs."""


@dataclass
class Item:
    """One sample as a pipeline's ``process`` sees it."""

    data: Sample
    label: int
    index: int
    rng: SampleRandom  # np.random.Generator's methods; one number is drawn without numpy
    describe: Callable[[int], str] = field(repr=False, default=lambda i: f"sample {i}")
    decode_options: DecodeOptions = DEFAULT_OPTIONS

    @property
    def where(self) -> str:
        """The sample's locator (a file path for folder datasets), for side files such as masks."""
        return self.describe(self.index)


ProcessFn = Callable[[Item, Dict[str, np.ndarray]], Optional[Mapping[str, np.ndarray]]]


@dataclass(frozen=True)
class Pipeline:
    """``outputs``: name -> per-sample uint8 shape, in frame order; ``process``: see the module doc."""

    outputs: Mapping[str, Tuple[int, ...]]
    process: ProcessFn

    def __post_init__(self) -> None:
        if not self.outputs:
            raise PipelineError("a pipeline declares at least one output")
        outs = {}
        for name, shape in self.outputs.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise PipelineError(f"output name {name!r}: use letters, digits, '_', '.', '-' (64 at most)")
            shape = tuple(shape)
            if not shape or not all(isinstance(d, (int, np.integer)) and 1 <= d <= 1 << 16 for d in shape):
                raise PipelineError(f"output {name!r}: shape must be 1 to 65536 per dimension, got {shape}")
            outs[name] = tuple(int(d) for d in shape)
        if sum(math.prod(s) for s in outs.values()) > MAX_SAMPLE_OUTPUT_BYTES:
            raise PipelineError(f"outputs {outs} exceed {MAX_SAMPLE_OUTPUT_BYTES} bytes per sample")
        object.__setattr__(self, "outputs", outs)

    @property
    def sample_bytes(self) -> int:
        return sum(math.prod(s) for s in self.outputs.values())

    def layout(self, capacity: int) -> List[Tuple[str, Tuple[int, ...], int]]:
        """(name, per-sample shape, byte offset) of each output's block in a slot of ``capacity``
        samples: output blocks one after another, each ``capacity`` samples long, so each
        output of a batch is one contiguous frame."""
        out, off = [], 0
        for name, shape in self.outputs.items():
            out.append((name, shape, off))
            off += capacity * math.prod(shape)
        return out


class Args:
    """A job's ``pipeline_args``, read with typed getters that name the argument in errors.
    Arguments never read are refused after the factory returns (a typo is an error)."""

    def __init__(self, pipeline: str, raw: Optional[Mapping[str, Any]] = None):
        self.pipeline = pipeline
        self.raw = dict(raw or {})
        self._read: set = set()

    def _bad(self, name: str, want: str, got: Any) -> PipelineError:
        return PipelineError(f"pipeline {self.pipeline!r}: argument {name!r} must be {want}, got {brief(got)}")

    def _get(self, name: str, default: Any) -> Any:
        self._read.add(name)
        return self.raw.get(name, default)

    def int(self, name: str, default: int, lo: int = -(1 << 62), hi: int = 1 << 62) -> int:
        v = self._get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._bad(name, f"an int in [{lo}, {hi}]", v)
        return v

    def float(self, name: str, default: float, lo: float = -math.inf, hi: float = math.inf) -> float:
        v = self._get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise self._bad(name, f"a number in [{lo}, {hi}]", v)
        return float(v)

    def bool(self, name: str, default: bool) -> bool:
        v = self._get(name, default)
        if not isinstance(v, bool):
            raise self._bad(name, "true or false", v)
        return v

    def str(self, name: str, default: str, choices: Optional[Sequence[str]] = None) -> str:
        v = self._get(name, default)
        if not isinstance(v, str) or (choices is not None and v not in choices):
            raise self._bad(name, f"one of {list(choices)}" if choices else "a string", v)
        return v

    def range(self, name: str, default: Tuple[float, float], lo: float = -math.inf,
              hi: float = math.inf) -> Tuple[float, float]:
        """Two numbers ``lo <= a <= b <= hi``."""
        v = self._get(name, default)
        if (not isinstance(v, (list, tuple)) or len(v) != 2 or
                not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
                or not lo <= v[0] <= v[1] <= hi):
            raise self._bad(name, f"two numbers [a, b] with {lo} <= a <= b <= {hi}", v)
        return float(v[0]), float(v[1])

    def unused(self) -> List[str]:
        return sorted(set(self.raw) - self._read)


def build(name: str, target: str, raw_args: Optional[Mapping[str, Any]]) -> Pipeline:
    """Call ``target``'s factory with ``raw_args``; every refusal is a :class:`PipelineError`
    naming the pipeline (and the argument)."""
    args = Args(name, raw_args)
    factory = resolve(target, name)
    try:
        pipe = factory(args)
    except PipelineError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise PipelineError(f"pipeline {name!r} refused its arguments: {type(exc).__name__}: "
                            f"{brief(str(exc), 300)[1:-1]}") from None
    if not isinstance(pipe, Pipeline):
        raise PipelineError(f"pipeline {name!r}: {target} returned {type(pipe).__name__}, not a Pipeline")
    unused = args.unused()
    if unused:
        raise PipelineError(f"pipeline {name!r}: unknown argument(s) {unused}; it read "
                            f"{sorted(args._read) or 'none'}")
    return pipe


# target -> its callable, once found: targets come from the service's registry (few, fixed), and
# a lookup per Hello made new strings that the interpreter's type cache kept, one per flood
# connection's arena (issue 32).
_resolved: Dict[str, Callable[[Args], Pipeline]] = {}


def resolve(target: str, name: str = "") -> Callable[[Args], Pipeline]:
    """``MODULE:CALLABLE`` -> the callable; ValueError naming what is missing."""
    found = _resolved.get(target)
    if found is not None:
        return found
    who = f"pipeline {name!r}: " if name else ""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise PipelineError(f"{who}{target!r} is not MODULE:CALLABLE")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of operator code
        raise PipelineError(f"{who}module {module_name!r} does not import: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PipelineError(f"{who}module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PipelineError(f"{who}{target} is not callable")
    _resolved[target] = obj
    return obj


class Registry:
    """The pipelines a service offers: the built-ins plus ``NAME=MODULE:CALLABLE`` entries,
    each imported now so that a bad one stops the service from starting."""

    def __init__(self, entries: Sequence[str] = ()):
        self.targets: Dict[str, str] = dict(BUILTIN)
        for entry in entries:
            name, sep, target = entry.partition("=")
            name, target = name.strip(), target.strip()
            if not sep or not _NAME.fullmatch(name):
                raise PipelineError(f"--pipeline {entry!r}: expected NAME=MODULE:CALLABLE")
            if name in self.targets:
                raise PipelineError(f"--pipeline {entry!r}: the name {name!r} is already taken"
                                    + (" (built in)" if name in BUILTIN else ""))
            resolve(target, name)
            self.targets[name] = target

    def build(self, name: str, raw_args: Optional[Mapping[str, Any]]) -> Pipeline:
        target = self.targets.get(name)
        if target is None:
            raise PipelineError(f"unknown pipeline {name!r}; this service offers {sorted(self.targets)}")
        return build(name, target, raw_args)


def legacy_args(image_size: int, train: bool, scale, ratio) -> Tuple[str, Dict[str, Any]]:
    """The built-in pipeline and arguments that a job naming no pipeline gets (today's recipes)."""
    if train:
        return "train", {"size": image_size, "scale": list(scale), "ratio": list(ratio)}
    return "eval", {"size": image_size}


class Cache:
    """Pipelines built in a worker, by (target, arguments): a factory runs once per job shape."""

    def __init__(self, size: int = 8):
        self._items: "OrderedDict[tuple, Pipeline]" = OrderedDict()
        self._size = size

    def get(self, name: str, target: str, raw_args: Mapping[str, Any]) -> Pipeline:
        key = (name, target, msgpack.packb(raw_args, use_bin_type=True))
        pipe = self._items.get(key)
        if pipe is None:
            pipe = self._items[key] = build(name, target, raw_args)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        return pipe


def check_output(name: str, output: str, want: Tuple[int, ...], got: Any) -> np.ndarray:
    """``got`` if it is a uint8 array of shape ``want``, else a PipelineError naming all four."""
    shape = getattr(got, "shape", None)
    dtype = getattr(got, "dtype", type(got).__name__)
    if not isinstance(got, np.ndarray) or got.dtype != np.uint8 or tuple(got.shape) != want:
        raise PipelineError(f"pipeline {name!r} output {output!r}: expected uint8 {want}, got {dtype} "
                            f"{tuple(shape) if shape is not None else ''}".rstrip())
    return got


def run_one(name: str, pipe: Pipeline, item: Item, out: Dict[str, np.ndarray]) -> None:
    """One sample through ``pipe`` into ``out``; a returned dict is checked and copied in."""
    result = pipe.process(item, out)
    if result is None:
        return
    if not isinstance(result, Mapping):
        raise PipelineError(f"pipeline {name!r}: process returned {type(result).__name__}; return None "
                            "(outputs written in place) or a dict of output arrays")
    extra = sorted(set(result) - set(out))
    if extra:
        raise PipelineError(f"pipeline {name!r} returned undeclared output(s) {extra}; declared {list(out)}")
    for key, dst in out.items():
        if key in result:
            dst[...] = check_output(name, key, dst.shape, result[key])
        else:
            raise PipelineError(f"pipeline {name!r} returned no output {key!r}; declared {list(out)}")


# --------------------------------------------------------------------------- built-ins
def train_pipeline(args: Args) -> Pipeline:
    """RandomResizedCrop(size, scale, ratio) + horizontal flip: the service's original recipe."""
    from loader_service.decode.transforms import TransformSpec, process_sample

    size = args.int("size", 224, 8, 4096)
    spec = TransformSpec(size, True, args.range("scale", (0.08, 1.0), 1e-9, 1.0),
                         args.range("ratio", (3 / 4, 4 / 3), *RATIO_LIMITS), args.bool("flip", True))

    def process(item: Item, out: Dict[str, np.ndarray]) -> None:
        process_sample(item.data, spec, item.rng, out["image"], item.decode_options)

    return Pipeline({"image": (size, size, 3)}, process)


def eval_pipeline(args: Args) -> Pipeline:
    """Resize the shorter side to size/crop_fraction, centre-crop size: the original eval recipe."""
    from loader_service.decode.transforms import TransformSpec, process_sample

    size = args.int("size", 224, 8, 4096)
    spec = TransformSpec(size, False, eval_crop_fraction=args.float("crop_fraction", 0.875, 0.01, 1.0))

    def process(item: Item, out: Dict[str, np.ndarray]) -> None:
        process_sample(item.data, spec, item.rng, out["image"], item.decode_options)

    return Pipeline({"image": (size, size, 3)}, process)


@dataclass(frozen=True)
class JobPipeline:
    """The pipeline one stream runs: ``named`` when the client chose it (the wire then names
    every output), else the built-in recipe its job fields describe (the original wire shape)."""

    name: str
    target: str
    args: Dict[str, Any]
    pipeline: Pipeline
    named: bool

    def outputs(self) -> list:
        """``[[name, per-sample shape], ...]`` as the wire carries them."""
        return [[k, list(v)] for k, v in self.pipeline.outputs.items()]


def job_pipeline(registry: Registry, spec: JobSpec) -> JobPipeline:
    """What a job's spec asks for (a named pipeline, else the built-in recipe its fields
    describe); PipelineError when the service cannot run it."""
    if spec.pipeline:
        return named_pipeline(registry, spec.pipeline, spec.pipeline_args)
    pipeline, args = legacy_args(spec.image_size, spec.train, spec.scale, spec.ratio)
    return JobPipeline(pipeline, registry.targets.get(pipeline, ""), args, registry.build(pipeline, args), False)


def named_pipeline(registry: Registry, pipeline: str, args: Mapping[str, Any]) -> JobPipeline:
    """A pipeline the service offers, by name (a job's, or a Describe's)."""
    args = dict(args)
    return JobPipeline(pipeline, registry.targets.get(pipeline, ""), args, registry.build(pipeline, args), True)


@functools.lru_cache(maxsize=64)
def _module_digest(module: str) -> str:
    """A digest of a pipeline module's source file (its name alone where none is found)."""
    try:
        spec = importlib.util.find_spec(module)
        with open(spec.origin, "rb") as f:  # type: ignore[union-attr, arg-type]
            return hashlib.sha256(f.read()).hexdigest()
    except (ImportError, ValueError, AttributeError, TypeError, OSError):
        return module


def output_identity(options: DecodeOptions, pipe: Optional["JobPipeline"]) -> str:
    """What, besides the dataset, makes a stream's bytes: the decode settings, and for a pipeline
    the service was given (``--pipeline``) its name, target and its module's source. Replicas whose
    identities differ decode the same samples into other bytes (a loader does not mix them). The
    built-in recipes are named as one (a Describe does not say which a job uses); a replica of
    another version of the service is not told apart by this."""
    parts = [options.max_pixels, options.fast_dct, options.fast_upsample]
    if pipe is not None and pipe.named and pipe.name not in BUILTIN:
        parts += [pipe.name, pipe.target, _module_digest(pipe.target.partition(":")[0])]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
