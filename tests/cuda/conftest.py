"""CUDA test helpers: GPU sleeps in milliseconds, a side stream made to lag, and mutant runs.

Mutant runs: ``LOADER_CUDA_MUTANT=<name> pytest tests/cuda -k race`` replaces one of
one of ``CudaSink``'s guarantees with a no-op (see client/sinks.py's module doc); at least one
race test must then fail. ``python tests/cuda/run_mutants.py`` runs all three and checks that.
"""

from __future__ import annotations

import functools
import os
import weakref

import pytest
import torch

from client.sinks import CudaSink

# mutant name -> (the CudaSink method it removes, what stands in for it)
MUTANTS = {"ring_wait": ("_wait_pinned_free", lambda *args: None),
           "stream_wait": ("_order_after_copy", lambda *args: None),
           "record_stream": ("_keep_alive", lambda *args: None),
           # co-located: a lent slot goes back to the service as soon as its copy is issued
           "copy_read": ("_copy_has_read", lambda *args: True)}


@pytest.fixture(autouse=True)
def cuda_mutant(monkeypatch):
    name = os.environ.get("LOADER_CUDA_MUTANT", "")
    if name:
        if name not in MUTANTS:
            raise pytest.UsageError(f"LOADER_CUDA_MUTANT={name!r}: choose one of {sorted(MUTANTS)}")
        method, stand_in = MUTANTS[name]
        monkeypatch.setattr(CudaSink, method, stand_in)
    yield name


@functools.lru_cache(maxsize=None)
def _cycles_per_ms(device: int) -> float:
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        return 20_000_000 / max(start.elapsed_time(end), 1e-3)


def gpu_sleep(ms: float, stream: torch.cuda.Stream) -> None:
    """Queue about ``ms`` milliseconds of spinning on ``stream`` (returns at once on the CPU)."""
    cycles = int(ms * _cycles_per_ms(stream.device.index))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


# The side stream sleeps this long before the first copy of a loader, then before every copy:
# the copies lag far behind the CPU (the service delivers a 16 x 64px batch in a few ms), so a
# slot reused early or a read not ordered after its copy sees the wrong bytes.
FIRST_DELAY_MS, EACH_DELAY_MS = 1000.0, 50.0


@pytest.fixture
def delayed_side_stream(monkeypatch):
    push = CudaSink.push
    delayed = weakref.WeakSet()

    def slow_push(self, msg, payload):
        gpu_sleep(EACH_DELAY_MS if self in delayed else FIRST_DELAY_MS, self.stream)
        delayed.add(self)
        return push(self, msg, payload)  # the pushed batch: the epoch run hands it over

    monkeypatch.setattr(CudaSink, "push", slow_push)
