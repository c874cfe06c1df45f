"""Clients that come and go at any moment, over every transport at once: while a seeded schedule
starts trainers over loopback TCP, bulk lanes and shared memory (co-located), SIGKILLs them,
freezes them (SIGSTOP) past the heartbeat and lets some run on, a witness loader reads whole
epochs in each transport in turn. Each of its epochs is byte for byte the reference epoch (every
sample once, the same order and bytes); afterwards the service holds nothing for anyone (no
session, no retiring stream, no slot lent, no lane set) and says it is healthy, and every trainer
that ended by itself ended cleanly (a frozen one resumes its stream when it wakes)."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys

import pytest

from client import RemoteLoader
from testkit.helpers import holdings, status, wait_for

from tests.conftest import DEMO_SIZE

MODES = ("tcp", "lanes", "local")
ROUNDS = 9

TRAINER = r"""
import os, random, sys, time
from client import RemoteLoader
endpoint, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
kw = dict(batch_size=rng.choice([8, 16]), image_size=32, shuffle=True, seed=rng.randrange(5), timeout=60,
          prefetch=rng.choice([1, 2, 4]), epoch_lookahead=rng.choice([True, False]))
if mode == "lanes":
    kw["lanes"] = 2
if mode == "local":
    kw["local"] = True
held, said = [], False
with RemoteLoader(endpoint, **kw) as ld:
    for e in range(10**6):
        ld.set_epoch(e)
        for b in ld:
            if not said:
                print("streaming", flush=True)
                said = True
            if rng.random() < 0.2:  # batches kept a while (lent in place: slots held)
                held = held[-5:] + [b]
            if rng.random() < 0.03:
                break  # leaves the epoch part-way: a new iter() ends its stream
            if rng.random() < 0.01:
                os._exit(3)  # gone without a Bye or a close
            if rng.random() < 0.05:
                time.sleep(rng.random() * 0.3)  # a slow step
"""


def _epoch(endpoint: str, mode: str, epoch: int):
    """One epoch of the witness: (indices, digest of images and labels) per batch."""
    kw = dict(batch_size=16, image_size=32, shuffle=True, seed=7, timeout=60,
              lanes=2 if mode == "lanes" else 0, local=mode == "local")
    with RemoteLoader(endpoint, **kw) as ld:
        ld.set_epoch(epoch)
        return [(tuple(b.indices), hashlib.sha1(b.raw.numpy().tobytes() + b.labels.numpy().tobytes()).hexdigest())
                for b in ld]


class _Trainers:
    """The churning trainers: child processes, each in one transport."""

    def __init__(self, endpoint: str, script: str):
        self.endpoint, self.script = endpoint, script
        self.procs = []  # [Popen, mode, frozen]
        self.ended = []  # (mode, exit code, last lines of stderr) of those that ended by themselves
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

    def start(self, mode: str, seed: int) -> None:
        p = subprocess.Popen([sys.executable, self.script, self.endpoint, mode, str(seed)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=self.env)
        line = p.stdout.readline()  # a trainer that fails first closes its pipe: '' (its timeout bounds this)
        if line != "streaming\n":
            p.wait(30)
            raise AssertionError(f"a {mode} trainer did not start streaming: {p.stderr.read()[-2000:]}")
        self.procs.append([p, mode, False])

    def act(self, rng: random.Random) -> None:
        """One step of the schedule on each trainer: kill, freeze, thaw, or leave it be."""
        for t in list(self.procs):
            p, mode, frozen = t
            if p.poll() is not None:
                self.ended.append((mode, p.returncode, p.stderr.read()[-2000:]))
                self._reap(p)
                self.procs.remove(t)
                continue
            r = rng.random()
            if frozen and r < 0.5:
                p.send_signal(signal.SIGCONT)
                t[2] = False
            elif r < 0.2:
                self._kill(p)
                self.procs.remove(t)
            elif not frozen and r < 0.4:
                p.send_signal(signal.SIGSTOP)
                t[2] = True

    def close(self) -> None:
        for p, *_ in self.procs:
            self._kill(p)
        self.procs = []

    @staticmethod
    def _kill(p) -> None:
        p.send_signal(signal.SIGKILL)
        p.send_signal(signal.SIGCONT)
        _Trainers._reap(p)

    @staticmethod
    def _reap(p) -> None:
        p.wait(30)
        p.stdout.close()
        p.stderr.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_trainers_killed_frozen_or_leaving_in_every_transport_never_touch_a_witness_epoch(make_service, tmp_path,
                                                                                          seed):
    svc = make_service(lane_port=0, heartbeat_s=0.5)
    reference = {e: _epoch(svc.endpoint, "tcp", e) for e in (0, 1)}
    for e, batches in reference.items():
        assert sorted(i for idx, _ in batches for i in idx) == list(range(DEMO_SIZE))
    script = tmp_path / "trainer.py"  # not client.py: the script's folder comes first in sys.path
    script.write_text(TRAINER)
    trainers, rng = _Trainers(svc.endpoint, str(script)), random.Random(seed)
    try:
        for k in range(ROUNDS):
            for _ in range(rng.randint(1, 2)):
                if len(trainers.procs) < 4:
                    trainers.start(rng.choice(MODES), rng.randrange(10**6))
            trainers.act(rng)
            mode, epoch = MODES[k % len(MODES)], rng.randrange(2)
            assert _epoch(svc.endpoint, mode, epoch) == reference[epoch], f"round {k}: a {mode} epoch {epoch} differs"
    finally:
        trainers.close()
    # a trainer that ended by itself: its os._exit (3), or cleanly; never an error of the loader
    assert [(m, rc, err) for m, rc, err in trainers.ended if rc not in (0, 3)] == []
    # the killed trainers' connections end (the monitor, or the heartbeat for a frozen one)
    wait_for(lambda: holdings(svc) == (0, 0, [], 0), timeout=30,
             what="the service to hold nothing for the trainers gone")
    st = status(svc)
    assert (st["healthy"], st["problem"], st["lanes_open"]) == (True, "", 0)
