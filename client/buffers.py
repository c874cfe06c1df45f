"""Host buffers the client receives batches into, reused once the trainer lets go of them."""

from __future__ import annotations

import logging
import sys
from typing import Dict, List

import numpy as np
import torch
import zmq

log = logging.getLogger("client")


class HostBuffers:
    """Host buffers for batches received piece by piece (an output in several frames, a batch on
    bulk lanes), each reused once nothing else refers to it (the trainer dropped every tensor
    made from it: ``torch.from_numpy`` holds its array), so a large batch does not cost the page
    faults of a fresh mapping each time. At most ``keep`` buffers of a size are kept; past that a
    new one is made and not kept.

    ``pinned``: page-locked buffers (a loader on a GPU: the copy engine reads them as they are,
    with no copy into the pinned ring first). Where this torch cannot page-lock memory (a CPU
    build, no driver) the buffers are plain ones and ``pinned`` turns False, said once."""

    def __init__(self, keep: int, pinned: bool = False):
        self.keep, self.pinned = keep, pinned
        self._kept: Dict[int, List[np.ndarray]] = {}

    def take(self, nbytes: int) -> np.ndarray:
        kept = self._kept.setdefault(nbytes, [])
        for i in range(len(kept)):
            if sys.getrefcount(kept[i]) == 2:  # the list's reference and the argument's: unused
                return kept[i]
        buf = self._new(nbytes)
        if len(kept) < self.keep:
            kept.append(buf)
        return buf

    def _new(self, nbytes: int) -> np.ndarray:
        if self.pinned:
            try:  # the array holds the tensor, which holds the page-locked memory
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
            except RuntimeError as exc:
                self.pinned = False
                log.warning("cannot page-lock host buffers (%s): batches are copied into the pinned ring instead",
                            str(exc).splitlines()[0])
        return np.empty(nbytes, np.uint8)

    def gather(self, frames: List[zmq.Frame], nbytes: int) -> np.ndarray:
        """The frames' bytes, one after another, in a buffer of ``nbytes`` (their total)."""
        buf, at = self.take(nbytes), 0
        for f in frames:
            part = np.frombuffer(f.buffer, dtype=np.uint8)
            buf[at:at + part.size] = part
            at += part.size
        return buf


__all__ = ["HostBuffers"]
