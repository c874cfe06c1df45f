"""A /dev/shm smaller than the slots (a container started without shm_size): segments reserve
their pages when they are made, so a full filesystem is a clear ``no_capacity`` refusal, never a
worker killed by SIGBUS that looks like a sample crashing the decoder.

The live tests run the service and a client in a private mount namespace whose /dev/shm is a
small tmpfs (``unshare -m``; skipped where that is not permitted). Nothing outlives the
namespace."""

from __future__ import annotations

from testkit.paths import REPO_ROOT
import errno
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from loader_service import shm
from loader_service.dispatch.memory import BatchMemory, NoShmSpace, slot_cap
from testkit.service import own_shm

from tests.conftest import needs_own_shm

ROOT = REPO_ROOT
MiB = 1 << 20


def _enospc(fd, offset, size):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_segment_that_does_not_fit_is_refused_and_leaves_no_file(monkeypatch):
    before = shm.list_segments(os.getpid())
    monkeypatch.setattr(shm.os, "posix_fallocate", _enospc)
    with pytest.raises(shm.NoSpace, match=r"MiB free, a segment of 3\.0 MiB does not fit \(raise the container's "
                                          r"shm_size") as info:
        shm.Segment.create(3 * MiB, tag="test")
    assert info.value.errno == errno.ENOSPC
    assert shm.list_segments(os.getpid()) == before


def test_segments_are_backed_by_pages_when_made():
    seg = shm.Segment.create(2 * MiB, tag="test")
    try:
        st = os.stat(os.path.join(shm.SHM_DIR, seg.name))
        assert st.st_blocks * 512 >= 2 * MiB  # allocated, not a sparse file
    finally:
        seg.close()


def test_reserves_give_their_space_back_before_the_filesystem_refuses(monkeypatch):
    arena = BatchMemory(64 * MiB, 0, live=lambda: (), connected=lambda ident: True)
    try:
        kept = [arena.acquire(owner, MiB, "plain") for owner in (b"x", b"y")]
        for seg, owner in zip(kept, (b"x", b"y")):
            arena.release(seg, owner)
        real, calls = shm.os.posix_fallocate, []

        def full_until_two_reserves_are_gone(fd, offset, size):
            calls.append(arena.reserved())
            if arena.reserved():
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, offset, size)

        monkeypatch.setattr(shm.os, "posix_fallocate", full_until_two_reserves_are_gone)
        seg = arena.acquire(b"new", 2 * MiB, "plain")
        assert calls == [2 * MiB, MiB, 0] and seg.size == 2 * MiB  # oldest reserve first
        assert arena.held_by(b"x") == arena.held_by(b"y") == 0
        monkeypatch.setattr(shm.os, "posix_fallocate", _enospc)
        with pytest.raises(NoShmSpace, match=r"^this job needs 1\.0 MiB of batch slots \(prefetch 4\) but .* MiB "
                                             r"free, a segment of 1\.0 MiB does not fit"):
            arena.acquire(b"more", MiB, "prefetch 4")
        arena.release(seg, None)
        assert arena.in_use() == 0
    finally:
        arena.close()


def test_the_slot_cap_follows_a_small_shm_and_says_what_raises_it(monkeypatch, caplog):
    monkeypatch.setattr(shm, "free_bytes", lambda: 60 * MiB)
    assert slot_cap(4096 * MiB) == (60 * MiB, f"raise the container's shm_size or the emptyDir's sizeLimit "
                                                  f"({shm.SHM_DIR} had 60 MiB free at start, less than --max-shm-mb)")
    assert "batch slots are capped at 60 MiB" in caplog.text
    caplog.clear()
    assert slot_cap(32 * MiB) == (32 * MiB, "raise --max-shm-mb")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# Run inside the namespace: a service on a free loopback port, then clients; prints what happened.
SCRIPT = textwrap.dedent("""
    import sys, urllib.request
    from client import LoaderError, RemoteLoader
    from testkit.service import ServiceProcess, free_port
    svc = ServiceProcess(free_port(), ["--demo", "--demo-size", "256", "--workers", "1"])
    try:
        with RemoteLoader(svc.endpoint, batch_size=8, image_size=32, prefetch=2, timeout=60) as ld:
            print("small job:", sum(b.raw.shape[0] for b in ld), "samples")
        if sys.argv[1] == "fill":  # another program takes the space after the service started
            with open("/dev/shm/someone-else", "wb") as f:
                f.write(b"x" * (int(sys.argv[2]) << 20))
        try:
            with RemoteLoader(svc.endpoint, batch_size=64, image_size=224, prefetch=4, timeout=60) as ld:
                print("big job:", sum(b.raw.shape[0] for b in ld), "samples")
        except LoaderError as exc:
            print("big job refused:", exc)
        with urllib.request.urlopen(svc.url + "/healthz", timeout=10) as r:
            print("health:", r.status)
    finally:
        svc.stop()
    print("service exit:", svc.proc.returncode)
""")


def _in_small_shm(size_mb: int, *args: str) -> tuple:
    """Run SCRIPT in a namespace whose /dev/shm has ``size_mb``: (its stdout, stdout + stderr)."""
    cmd = own_shm([sys.executable, "-c", SCRIPT, *args], size_mb)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    return proc.stdout, log


@needs_own_shm
def test_a_job_larger_than_a_small_shm_is_refused_at_once_and_the_service_stays_healthy():
    out, log = _in_small_shm(16, "none")
    assert "small job: 256 samples" in out, log
    assert ("big job refused: [no_capacity] this job needs 36.8 MiB of batch slots (prefetch 4 x 9.2 MiB) but 0.0 "
            "of 16 MiB are in use") in out, log
    assert "raise the container's shm_size or the emptyDir's sizeLimit (/dev/shm had 16 MiB free at start" in out, log
    assert "health: 200" in out and "service exit: 0" in out, log


@needs_own_shm
def test_a_shm_filled_by_someone_else_after_the_start_is_a_refusal_not_a_crash():
    out, log = _in_small_shm(64, "fill", "40")
    assert "small job: 256 samples" in out, log
    refused = [line for line in out.splitlines() if line.startswith("big job refused:")]
    assert refused and "[no_capacity] this job needs 36.8 MiB of batch slots" in refused[0], log
    assert "MiB free, a segment of 36.8 MiB does not fit (raise the container's shm_size" in refused[0], log
    assert "crashed the decoder" not in out, log
    assert "health: 200" in out and "service exit: 0" in out, log
