"""The test leak check (tests/conftest.py) blames a test only for /dev/shm segments of
processes this session made: a segment that another program's process left when it died is
not this test's leak (issue 40: a teardown error blamed one on an unrelated test)."""

from __future__ import annotations

import os
import subprocess
import uuid

import psutil

from loader_service import shm
from tests.conftest import _our_segments


def _segment(pid: int) -> str:
    name = f"{shm.PREFIX}{pid}-leakcheck-{uuid.uuid4().hex[:12]}"
    with open(os.path.join(shm.SHM_DIR, name), "wb"):
        pass
    return name


def test_segments_of_processes_this_session_did_not_start_are_not_blamed():
    # a process that is not ours: started by a shell in the background, dead before the check;
    # the shell (our child) is ours, its background job was never seen
    out = subprocess.run(["sh", "-c", "sleep 0 & echo $!; wait"], capture_output=True, text=True, timeout=30)
    stranger = int(out.stdout)
    assert not psutil.pid_exists(stranger)
    theirs = _segment(stranger)
    try:
        assert theirs not in _our_segments()
    finally:
        os.unlink(os.path.join(shm.SHM_DIR, theirs))


def test_segments_of_our_own_dead_subprocess_and_of_this_process_are_blamed():
    child = subprocess.Popen(["true"])
    child.wait()
    dead_child, mine = _segment(child.pid), _segment(os.getpid())
    try:
        assert {dead_child, mine} <= _our_segments()
    finally:
        for name in (dead_child, mine):
            os.unlink(os.path.join(shm.SHM_DIR, name))
