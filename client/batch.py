"""What the loader yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Tuple

import torch


@dataclass
class Batch:
    """One batch. ``images, labels = batch`` works like a DataLoader's (images, labels).

    ``images``: the model's input: uint8 NHWC as received, or, with ``normalize=True``,
    normalized floats NCHW in channels_last memory on the loader's device.
    ``raw``: the uint8 NHWC batch as it came off the wire (on the device when one is used).
    ``indices``: dataset index of each sample. ``padding``: trailing samples that repeat an
    earlier one so every DDP rank gets the same count (exclude them from eval metrics).
    ``skipped``: ``[(dataset index, reason), ...]`` for samples the service skipped.
    """

    images: torch.Tensor
    labels: torch.Tensor
    indices: List[int]
    epoch: int
    index: int
    raw: torch.Tensor
    padding: int = 0
    skipped: List[Tuple[int, str]] = field(default_factory=list)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.images, self.labels))

    def __len__(self) -> int:
        return len(self.indices)
