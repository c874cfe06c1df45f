"""A test double for fault tests and chaos runs: any source, with samples that break workers.

Reading a sample listed in ``crash`` kills the worker (SIGKILL, as a decoder segfault would);
reading one listed in ``hang`` never returns (as an NFS read that never answers, or a decoder
stuck in a loop); ``read_delay_s`` makes every read that slow (remote storage: the benchmark of
replicas whose speed is set by their worker count, not by cores they share); ``hang_open``
makes a worker's opening of it never return (a dataset on a mount that stopped answering);
``hang_close`` makes its closing never return (a worker told to stop that never exits). The
fault lives here, in the data, so the worker's code path is the real one.
A service gets it only when a test or a benchmark builds it: ``Service(config, sources=...)``.
Not part of the product: the kind "fault" exists only in a process that imported this module;
the service's spawned workers import it by themselves, as they do for any source kind
registered outside loader_service.sources (``kind_modules`` in loader_service/sources/base.py).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Iterable

from loader_service.sources.base import Sample, Source, SourceSpec, open_source, register


@register("fault")
class FaultSource(Source):
    def __init__(self, inner: Source, crash: Iterable[int] = (), hang: Iterable[int] = (), unopenable: bool = False,
                 read_delay_s: float = 0.0, hang_open: bool = False, hang_close: bool = False):
        """``unopenable``: a worker cannot open it (as a dataset path unreadable inside a container)."""
        self.inner, self.unopenable, self.read_delay_s = inner, unopenable, float(read_delay_s)
        self.hang_open, self.hang_close = hang_open, hang_close
        self.name, self.labels = inner.name, inner.labels
        self.crash, self.hang = frozenset(int(i) for i in crash), frozenset(int(i) for i in hang)

    def __len__(self) -> int:
        return len(self.inner)

    def read(self, i: int) -> Sample:
        if i in self.crash:
            os.kill(os.getpid(), signal.SIGKILL)
        if i in self.hang:
            while True:  # only a signal ends this: the task deadline's SIGKILL
                signal.pause()
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        return self.inner.read(i)

    def fingerprint(self) -> str:
        return self.inner.fingerprint()

    def describe(self, i: int) -> str:
        return self.inner.describe(i)

    def spec(self) -> SourceSpec:
        s = self.inner.spec()
        return SourceSpec(name=s.name, kind="fault", path=s.path, index=s.index, options=(
            ("inner_kind", s.kind), ("inner_options", s.options),
            ("crash", tuple(sorted(self.crash))), ("hang", tuple(sorted(self.hang))), ("unopenable", self.unopenable),
            ("read_delay_s", self.read_delay_s), ("hang_open", self.hang_open),
            ("hang_close", self.hang_close)))

    @classmethod
    def from_spec(cls, spec: SourceSpec) -> "FaultSource":
        if spec.option("hang_open"):
            while True:  # only a signal ends this: the start deadline's SIGKILL
                signal.pause()
        if spec.option("unopenable"):
            raise PermissionError(f"[fault double] cannot open dataset {spec.name!r} at {spec.path}")
        inner = open_source(SourceSpec(name=spec.name, kind=spec.option("inner_kind"), path=spec.path,
                                       index=spec.index, options=tuple(tuple(kv) for kv in spec.option("inner_options"))))
        return cls(inner, spec.option("crash", ()), spec.option("hang", ()), read_delay_s=spec.option("read_delay_s", 0.0),
                   hang_close=spec.option("hang_close", False))

    def close(self) -> None:
        if self.hang_close:
            while True:  # only a signal ends this: the stop deadline's SIGKILL
                signal.pause()
        self.inner.close()
