"""Shared fixtures. Every test is checked for leaks: no child process, /dev/shm segment or
inet socket may outlive it (services started by a test are stopped by its fixtures first)."""

from __future__ import annotations

import atexit
import multiprocessing.process
import os
import shutil
import subprocess
import tempfile

import numpy as np
import psutil
import pytest

# before anything imports the demo module: tests never touch the user's cache
_CACHE = tempfile.mkdtemp(prefix="loader-test-cache-")
os.environ["LOADER_CACHE_DIR"] = _CACHE
os.environ.pop("LOADER_DEMO_BUILTIN", None)  # nor a pre-generated set (the service image's)
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

from loader_service import shm  # noqa: E402
from loader_service.config import ServiceConfig  # noqa: E402
from loader_service.service import Service  # noqa: E402
from testkit.service import can_own_shm  # noqa: E402

DEMO_SIZE = 240
# a service in a /dev/shm of its own (testkit.service.own_shm): where a private mount namespace is permitted
needs_own_shm = pytest.mark.skipif(not can_own_shm(), reason="needs a private mount namespace (unshare -m, mount)")


def _children() -> set:
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "resource_tracker" in cmd or "forkserver" in cmd:
            continue  # multiprocessing's own helpers live for the whole session
        out.add((p.pid, cmd[:120]))
    return out


def _sockets() -> set:
    try:
        conns = psutil.Process().net_connections(kind="inet")
    except psutil.Error:
        return set()
    return {(c.laddr, c.raddr, c.status) for c in conns if c.status != psutil.CONN_TIME_WAIT}


# Every process this test session started (subprocess.Popen, multiprocessing) or saw among its
# descendants, alive or dead: the leak check blames only their segments, never those of another
# program's processes (another test run, a benchmark, a service beside it) that die meanwhile.
_OURS: set = {os.getpid()}
_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _recording_popen_init(self, *args, **kwargs):
    _popen_init(self, *args, **kwargs)
    _OURS.add(self.pid)


def _recording_process_start(self):
    _process_start(self)
    _OURS.add(self.pid)


subprocess.Popen.__init__ = _recording_popen_init
multiprocessing.process.BaseProcess.start = _recording_process_start


def _note_descendants() -> None:
    try:
        _OURS.update(p.pid for p in psutil.Process().children(recursive=True))
    except psutil.Error:
        pass


def _our_segments() -> set:
    """Segments of this process, of a process it started or saw among its descendants, now
    dead (a subprocess of a test that left them). A descendant of a descendant that started and
    died unseen (between two checks) is not counted: its segments are not blamed."""
    _note_descendants()
    out = set()
    for name in shm.list_segments():
        try:
            pid = int(name[len(shm.PREFIX):].split("-", 1)[0])
        except ValueError:  # not a segment's name (another program's file): not ours
            continue
        if pid == os.getpid() or (pid in _OURS and not psutil.pid_exists(pid)):
            out.add(name)
    return out


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail a test that leaves processes, shared-memory segments or sockets behind."""
    before_procs, before_shm, before_socks = _children(), _our_segments(), _sockets()
    yield
    leaked = []
    procs = _children() - before_procs
    if procs:
        leaked.append(f"processes {sorted(procs)}")
    segs = _our_segments() - before_shm
    if segs:
        leaked.append(f"/dev/shm segments {sorted(segs)}")
    socks = _sockets() - before_socks
    if socks:
        leaked.append(f"sockets {sorted(socks)}")
    if leaked:
        for pid, _ in procs:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        for name in segs:
            try:
                os.unlink(os.path.join(shm.SHM_DIR, name))
            except OSError:
                pass
        pytest.fail(f"{request.node.nodeid} leaked: " + "; ".join(leaked), pytrace=False)


@pytest.fixture(scope="session")
def demo_source():
    from loader_service.sources.demo import ensure_demo

    src = ensure_demo(DEMO_SIZE, quiet=True)
    yield src
    src.close()


def write_imagefolder(root: str, classes: int = 3, per_class: int = 8, png_every: int = 3, seed: int = 0) -> str:
    """A small ImageFolder of JPEGs and PNGs of varied sizes. Returns root."""
    import cv2

    from loader_service.sources.demo import demo_image, encode_jpeg

    k = 0
    for c in range(classes):
        d = os.path.join(root, f"cls{c}")
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            img = demo_image(seed, k, c)
            h, w = 120 + 17 * (k % 5), 160 + 13 * (k % 7)
            img = cv2.resize(img, (w, h))
            if png_every and k % png_every == 0:
                ok, buf = cv2.imencode(".png", img[:, :, ::-1])
                assert ok
                data, ext = buf.tobytes(), "png"
            else:
                data, ext = encode_jpeg(img, 85), "jpg"
            with open(os.path.join(d, f"img{i:03d}.{ext}"), "wb") as f:
                f.write(data)
            k += 1
    return root


@pytest.fixture(scope="session")
def imagefolder(tmp_path_factory):
    return write_imagefolder(str(tmp_path_factory.mktemp("imagefolder")))


@pytest.fixture
def make_service(demo_source):
    """Start services on free loopback ports; all are stopped at teardown."""
    started = []

    def make(sources=None, **overrides) -> Service:
        """``sources``: open datasets to serve instead of the configured ones (fault doubles)."""
        opts = dict(demo=True, demo_size=DEMO_SIZE, workers=2, host="127.0.0.1", data_port=0, http_port=0,
                    heartbeat_s=0.5, stop_timeout_s=5.0)
        opts.update(overrides)
        svc = Service(ServiceConfig(**opts), sources=sources)
        started.append(svc)
        return svc.start()

    yield make
    for svc in started:
        svc.stop()


@pytest.fixture
def service(make_service):
    return make_service()
