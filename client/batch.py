"""What the loader yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Tuple

import torch


@dataclass
class Batch:
    """One batch. ``images, labels = batch`` works like a DataLoader's (images, labels) for a
    pipeline with one output; ``batch["name"]`` gives any output by name (``batch["global"]``,
    ``batch["local"]`` of a multi-crop pipeline).

    ``images``: the model's input: uint8 NHWC as received, or, with ``normalize=True``,
    normalized floats NCHW in channels_last memory on the loader's device (the first output
    of a pipeline with several).
    ``raw``: the uint8 NHWC batch as it came off the wire (on the device when one is used).
    ``outputs`` / ``raw_outputs``: every output by name, as ``images`` / ``raw`` are for the first.
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
    outputs: Dict[str, torch.Tensor] = field(default_factory=dict)
    raw_outputs: Dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = {"image": self.images}
            self.raw_outputs = {"image": self.raw}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "labels":
            return self.labels
        try:
            return self.outputs[name]
        except KeyError:
            raise KeyError(f"no output {name!r}; this batch has {list(self.outputs)} and 'labels'") from None

    def __iter__(self) -> Iterator[torch.Tensor]:
        if len(self.outputs) > 1:
            raise TypeError(f"this pipeline has {len(self.outputs)} outputs {list(self.outputs)}: use "
                            "batch[name] and batch.labels instead of unpacking (images, labels)")
        return iter((self.images, self.labels))

    def __len__(self) -> int:
        return len(self.indices)

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the batch holds, once each (what a device stream must keep alive)."""
        seen = {id(t): t for t in (self.images, self.raw, self.labels, *self.outputs.values(),
                                   *self.raw_outputs.values())}
        return list(seen.values())
