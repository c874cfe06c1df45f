"""The progress line both demo consumers print (no torch, no service dependencies)."""

from __future__ import annotations

import time
from typing import TextIO


class EpochProgress:
    """One epoch's progress: a tqdm bar on a terminal (or a container with ``tty: true``), else a
    line at every quarter, so logs stay readable. Shared by ``loader-service demo`` and ``client.demo``
    (here because the service image, which has no torch, runs the first)."""

    def __init__(self, epoch: int, total: int, image_size: int, out: TextIO):
        self.epoch, self.total, self.bytes_per_image, self.out = epoch, total, image_size * image_size * 3, out
        self.samples, self.batches, self.t0 = 0, 0, time.perf_counter()
        self.bar = None
        if out.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=f"epoch {epoch}", unit="batch", file=out, dynamic_ncols=True,
                                leave=True)
            except ImportError:  # tqdm is optional for the client: plain lines then
                pass

    def update(self, n_samples: int, stall_s: float) -> None:
        self.samples += n_samples
        self.batches += 1
        dt = max(time.perf_counter() - self.t0, 1e-9)
        rate = f"{self.samples / dt:.0f} img/s, {self.samples * self.bytes_per_image / dt / 2**20:.0f} MiB/s"
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate}, stall {stall_s:.2f}s", refresh=False)
            self.bar.update(1)
        elif self.batches == self.total or self.batches % max(1, self.total // 4) == 0:
            print(f"epoch {self.epoch} [{self.batches:>4}/{self.total}] {rate}, stall {stall_s:.2f}s",
                  file=self.out, flush=True)

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        dt = time.perf_counter() - self.t0
        print(f"epoch {self.epoch}: {self.samples} images in {dt:.2f}s = {self.samples / max(dt, 1e-9):.1f} img/s",
              file=self.out, flush=True)
        return dt
