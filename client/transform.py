"""uint8 NHWC batch -> normalized float NCHW (channels_last memory), on whatever device the
batch is. The same code runs on CPU and GPU, so the CPU fallback computes the same values."""

from __future__ import annotations

from typing import Sequence

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Normalize:
    """``(x - mean) / std`` per channel. Mean and std are on the 0..255 scale."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], dtype: str = "float32"):
        self.dtype = DTYPES[dtype]
        self._mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self._inv_std = (1.0 / torch.tensor(std, dtype=torch.float32)).view(1, 3, 1, 1)
        self._on: dict = {}

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        """``raw``: uint8 (N, H, W, 3). Returns (N, 3, H, W) in ``dtype``, channels_last."""
        if raw.dtype != torch.uint8 or raw.dim() != 4 or raw.shape[-1] != 3:
            raise ValueError(f"expected uint8 (N, H, W, 3), got {raw.dtype} {tuple(raw.shape)}")
        mean, inv_std = self._constants(raw.device)
        x = raw.permute(0, 3, 1, 2)  # a view: NHWC memory is NCHW in channels_last layout
        # arithmetic in float32 (exact for uint8 inputs), cast at the end for half types
        y = torch.empty(x.shape, dtype=torch.float32, device=raw.device).contiguous(memory_format=torch.channels_last)
        torch.sub(x, mean, out=y)
        y.mul_(inv_std)
        if self.dtype is not torch.float32:
            y = y.to(self.dtype, memory_format=torch.channels_last)
        return y

    def _constants(self, device: torch.device):
        key = str(device)
        if key not in self._on:
            self._on[key] = (self._mean.to(device), self._inv_std.to(device))
        return self._on[key]
