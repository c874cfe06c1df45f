"""The epoch plan: which dataset indices each rank gets, in which batches.

A pure function of (dataset length, seed, epoch, rank, world_size, batch_size, shuffle,
drop_last, origin, and, for a windowed shuffle, the window and the dataset's blocks). Client and service compute it independently and always agree; nothing about a
plan is ever stored, which is why a restarted service or a resumed client loses nothing.

The epoch's *global order* is one permutation of ``range(n)`` per (seed, epoch); it does not
depend on world size or batch size. Ranks take it strided (rank ``r`` of ``w`` gets positions
``r, r + w, r + 2w, ...``), so after ``k`` steps of batch ``b`` the job has consumed exactly the
prefix ``order[:k * b * w]``. ``origin`` is such a position: a plan from ``origin`` shards only
``order[origin:]``, by the same rules, at whatever world size and batch size the job has now
(an elastic resume). ``origin=0`` is the whole epoch.

Rules (the same as ``torch.utils.data.DistributedSampler`` + ``DataLoader``):

* shuffle: one permutation of ``range(n)`` per (seed, epoch), shared by all ranks.
* shuffle with ``window`` W > 0 (shard-aware, as WebDataset's shard shuffle + sample buffer and
  Mosaic's block shuffles): the dataset's *blocks* (:class:`Blocks`: its units of reading, e.g. a
  WebDataset shard, whose samples are contiguous indices) are permuted, cut into consecutive
  windows of W blocks, and the samples of each window permuted among themselves. The order stays
  one permutation of ``range(n)`` per (seed, epoch, blocks, W), whatever the world size and batch
  size (so ``origin`` works unchanged), and at any moment the job reads about W blocks, on every
  rank alike. W = 0 is the uniform permutation above, unchanged. Without blocks (``None``: a
  source whose every sample is its own block) windows of W samples drawn from a permutation of
  the samples, permuted within, are just a uniform permutation: the order is then W = 0's. Without
  shuffle W has no effect (the order is ``range(n)``).
* drop_last=False: the order (from ``origin``) is padded by wrapping around to a multiple of world_size,
  so every rank gets ``ceil(n / world_size)`` samples; the last batch may be short. Padding
  repeats at most ``world_size - 1`` samples, always in the last position of a rank, and is
  flagged in :attr:`RankPlan.padding`.
* drop_last=True: the tail is dropped to a multiple of world_size, and each rank drops its
  incomplete last batch, so every batch is full.

Every rank gets the same number of batches either way, so DDP ranks never wait on each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["Blocks", "PlanSpec", "RankPlan", "epoch_order", "make_plan", "num_batches", "position"]


class Blocks:
    """A dataset's units of reading: the sorted start indices of its blocks (int64, the first 0),
    block ``k`` being the samples ``starts[k] .. starts[k + 1] - 1`` (the last runs to the end).
    Immutable, hashable by content (a :class:`PlanSpec` holding it keys the service's plan cache);
    a source computes it once and hands the same object to every plan."""

    __slots__ = ("starts", "_hash")

    def __init__(self, starts) -> None:
        a = np.array(starts, dtype=np.int64)  # a copy: nobody else holds it writable
        if a.ndim != 1 or len(a) == 0 or a[0] != 0 or (len(a) > 1 and not (np.diff(a) > 0).all()):
            raise ValueError("blocks: strictly increasing start indices from 0, at least one")
        a.flags.writeable = False
        self.starts = a
        self._hash = hash((len(a), a.tobytes()))

    @classmethod
    def of_labels(cls, block_of: np.ndarray) -> "Blocks":
        """The blocks of a per-sample block number that is constant over each block (samples of a
        block contiguous, e.g. a WebDataset index's shard column)."""
        return cls(np.concatenate(([0], np.flatnonzero(np.diff(block_of)) + 1)))

    def __len__(self) -> int:
        return len(self.starts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Blocks) and self._hash == other._hash
                                 and np.array_equal(self.starts, other.starts))

    def __repr__(self) -> str:
        return f"Blocks({len(self)} blocks)"


@dataclass(frozen=True)
class PlanSpec:
    """Everything the plan depends on. Validated on construction."""

    length: int
    batch_size: int
    seed: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 1
    shuffle: bool = True
    drop_last: bool = False
    origin: int = 0  # samples of the epoch's global order the job consumed before this plan (a resume)
    window: int = 0  # shuffle in windows of this many blocks (0: one uniform permutation)
    blocks: Optional[Blocks] = None  # the dataset's blocks for a window (None: every sample its own block)

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"dataset length must be >= 1, got {self.length}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.seed < 0 or self.epoch < 0:
            raise ValueError(f"seed and epoch must be >= 0, got seed={self.seed} epoch={self.epoch}")
        if not 0 <= self.origin <= self.length:
            raise ValueError(f"origin must be in [0, {self.length}] (the epoch's {self.length} samples), got {self.origin}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.blocks is not None and self.blocks.starts[-1] >= self.length:
            raise ValueError(f"blocks start past the dataset's {self.length} samples (blocks of another dataset?)")
        if self.drop_last and self.length < self.world_size:
            raise ValueError(
                f"drop_last with {self.length} samples and world_size {self.world_size} leaves "
                "every rank empty"
            )


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of one epoch: ``indices`` split into consecutive batches."""

    spec: PlanSpec
    indices: np.ndarray  # int64, this rank's samples in delivery order
    padding: np.ndarray  # bool, True where the sample repeats one to even out ranks

    @property
    def num_batches(self) -> int:
        n, b = len(self.indices), self.spec.batch_size
        return n // b if self.spec.drop_last else -(-n // b)

    @property
    def num_samples(self) -> int:
        return min(len(self.indices), self.num_batches * self.spec.batch_size)

    def batch(self, i: int) -> np.ndarray:
        """Dataset indices of batch ``i``."""
        if not 0 <= i < self.num_batches:
            raise IndexError(f"batch {i} out of range [0, {self.num_batches})")
        b = self.spec.batch_size
        return self.indices[i * b : (i + 1) * b]

    def batch_padding(self, i: int) -> np.ndarray:
        b = self.spec.batch_size
        return self.padding[i * b : (i + 1) * b]

    def position_after(self, steps: int) -> int:
        """The job's position in the epoch's global order once every rank has taken ``steps``
        batches of this plan: ``origin + steps * batch_size * world_size``, at most the epoch's
        end (a resume from it serves exactly the rest)."""
        s = self.spec
        return position(s.length, s.batch_size, s.world_size, s.drop_last, s.origin, steps)


def epoch_permutation(length: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(length, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch, 0x706C616E]))  # "plan"
    return rng.permutation(length).astype(np.int64)


def windowed_permutation(length: int, seed: int, epoch: int, window: int, blocks: Blocks) -> np.ndarray:
    """The shard-aware order (see the module docstring): blocks permuted, cut into windows of
    ``window`` blocks, the samples of each window permuted among themselves (one draw per window:
    a dataset of ``k`` blocks costs ``k / window`` of them)."""
    rng = np.random.Generator(np.random.PCG64([seed, epoch, 0x77696E64]))  # "wind"
    sizes = np.diff(np.append(blocks.starts, length))
    perm = rng.permutation(len(blocks))
    first, sizes = blocks.starts[perm], sizes[perm]
    begins = np.cumsum(sizes) - sizes  # where each permuted block begins in the order
    order = np.repeat(first - begins, sizes) + np.arange(length, dtype=np.int64)
    cuts = np.append(begins[::window], length).tolist()
    for a, b in zip(cuts[:-1], cuts[1:]):
        rng.shuffle(order[a:b])
    return order


def epoch_order(spec: PlanSpec) -> np.ndarray:
    """The epoch's global order of ``spec`` (every rank's, from position 0)."""
    if spec.shuffle and spec.window > 0 and spec.blocks is not None:
        return windowed_permutation(spec.length, spec.seed, spec.epoch, spec.window, spec.blocks)
    return epoch_permutation(spec.length, spec.seed, spec.epoch, spec.shuffle)


def make_plan(spec: PlanSpec) -> RankPlan:
    """Compute ``spec.rank``'s plan for ``spec.epoch``."""
    order = epoch_order(spec)[spec.origin:]
    n, w = len(order), spec.world_size
    if spec.drop_last:
        total = (n // w) * w
        order = order[:total]
        padded = np.zeros(total, dtype=bool)
    else:
        total = -(-n // w) * w
        order = np.resize(order, total)  # wraps around, as many times as n < w needs
        padded = np.zeros(total, dtype=bool)
        padded[n:] = True
    mine = slice(spec.rank, total, w)
    indices, padding = order[mine], padded[mine]
    if spec.drop_last:
        keep = (len(indices) // spec.batch_size) * spec.batch_size
        indices, padding = indices[:keep], padding[:keep]
    return RankPlan(spec=spec, indices=np.ascontiguousarray(indices), padding=padding.copy())


def position(length: int, batch_size: int, world_size: int, drop_last: bool, origin: int, steps: int) -> int:
    """The job's position in the epoch's global order after ``steps`` steps of a plan from
    ``origin`` (see :meth:`RankPlan.position_after`), without building the plan."""
    total = num_batches(length, batch_size, world_size, drop_last, origin)
    if not 0 <= steps <= total:
        raise ValueError(f"steps must be in [0, {total}], got {steps}")
    if steps == total:
        return length  # the last step ends the epoch (a short batch, padding or a dropped tail)
    return origin + steps * batch_size * world_size


def num_batches(length: int, batch_size: int, world_size: int = 1, drop_last: bool = False, origin: int = 0) -> int:
    """Batches per rank per epoch (from ``origin``), without building the plan (what ``len(loader)`` returns)."""
    n = length - origin
    if drop_last:
        return (n // world_size) // batch_size
    return -(-(-(-n // world_size)) // batch_size)
