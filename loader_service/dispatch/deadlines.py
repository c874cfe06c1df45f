"""When a running task counts as hung.

A decode task's time depends on the photos and the batch size, so a fixed deadline is either
too short for camera-size images or too long to notice an NFS read that never returns. By
default the deadline follows what tasks have measured: ``factor`` times the slowest recent
time per sample, times the task's samples, never below ``floor_s``. Before anything has been
measured a task gets ``6 x floor_s``. A fixed ``task_deadline_s`` overrides all of this.
"""

from __future__ import annotations

from collections import deque
from typing import Deque


class TaskDeadlines:
    def __init__(self, fixed_s: float = 0.0, floor_s: float = 10.0, factor: float = 10.0, window: int = 128):
        if fixed_s < 0 or floor_s <= 0 or factor < 1 or window < 1:
            raise ValueError("task deadlines: fixed_s >= 0, floor_s > 0, factor >= 1, window >= 1")
        self.fixed_s, self.floor_s, self.factor = fixed_s, floor_s, factor
        self._per_sample: Deque[float] = deque(maxlen=window)

    def observe(self, samples: int, seconds: float) -> None:
        """A task of ``samples`` samples took ``seconds``."""
        if samples > 0 and seconds >= 0:
            self._per_sample.append(seconds / samples)

    def deadline_s(self, samples: int) -> float:
        """Seconds a task of ``samples`` samples may run before its worker is replaced."""
        if self.fixed_s > 0:
            return self.fixed_s
        if not self._per_sample:
            return 6 * self.floor_s
        return max(self.floor_s, self.factor * max(self._per_sample) * max(1, samples))
