"""A real loader during a connection flood (issue 32 item 4): 300 connections that each said
Hello and never read hold sessions, and newcomers keep joining while the loader runs; the
loader still gets its whole epoch, each sample once. Before, a new stream went ahead of every
stream already served, so the real loader's second batch waited for as long as newcomers kept
coming (0 images/s and a timeout under a 10,000-connection flood)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from client import RemoteLoader
from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, status, wait_for
from testkit.service import ServiceProcess

HELD = 300
# The floods' connections are idle sessions, not silent ones: their Hellos say a heartbeat of a
# minute, so the silence look (3 heartbeats with no data: silence.py) leaves them be however long
# a slow machine takes to open them all (they send no PINGs: libzmq would for a real client).
IDLE_HEARTBEAT = 60.0

# Holds ``n`` DEALER connections that each sent one Hello (batch 1, prefetch 1) and read nothing;
# once all are open it says so, and at the word "go" it keeps adding newcomers (up to 500 a
# second) on ``churn`` more connections, each replaced by a new one with a new Hello, until its
# stdin closes; then it prints how many newcomers it made.
FLOOD = r"""
import collections, resource, select, sys, uuid, zmq
from wire import protocol as P
from wire.jobspec import JobSpec
endpoint, n, churn, IDLE_HEARTBEAT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))  # closed sockets free their fds later
ctx = zmq.Context()
ctx.setsockopt(zmq.LINGER, 0)
ctx.set(zmq.MAX_SOCKETS, 8192)
def one():
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    s.connect(endpoint)
    s.send_multipart(P.encode(P.Hello(stream=1, spec=JobSpec(batch_size=1, image_size=16), slots=1,
                                      client=uuid.uuid4().hex, batches=[0], heartbeat=IDLE_HEARTBEAT)))
    return s
held = [one() for _ in range(n)]
print("open", flush=True)
assert sys.stdin.readline().strip() == "go"
rotating, made = collections.deque(), 0
while not select.select([sys.stdin], [], [], 0.002)[0]:
    if len(rotating) >= churn:
        rotating.popleft().close()
    rotating.append(one())
    made += 1
print(made, flush=True)
"""


@pytest.mark.slow
def test_a_loader_gets_its_whole_epoch_while_non_reading_connections_keep_saying_hello(make_service):
    svc = make_service(workers=1, max_sessions=HELD + 50)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, svc.endpoint, str(HELD), "20", str(IDLE_HEARTBEAT)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert flood.stdout.readline().strip() == b"open"
        wait_for(lambda: status(svc)["connections"]["sessions"] >= HELD, what=f"{HELD} flood sessions")
        flood.stdin.write(b"go\n")
        flood.stdin.flush()
        streams_before = status(svc)["totals"]["streams"]
        with RemoteLoader(svc.endpoint, batch_size=8, image_size=32, epoch_lookahead=False, timeout=60) as ld:
            got = indices_of(collect(ld))
        st = status(svc)
        flood.stdin.close()  # no more newcomers
        made = int(flood.stdout.readline())
    finally:
        flood.kill()
        flood.wait()
        flood.stdout.close()
    assert sorted(got) == list(range(DEMO_SIZE))
    # the flood held its sessions all along, and newcomers kept joining while the loader ran
    assert st["connections"]["sessions"] >= HELD and made > 0
    assert st["totals"]["streams"] - streams_before > 1
    wait_for(lambda: status(svc)["connections"]["sessions"] == 0, what="the flood's sessions dropped")


# Holds ``n`` DEALER connections that each sent one Hello and read nothing, says "open", and
# closes them all when its stdin closes.
HELLOS = r"""
import resource, sys, uuid, zmq
from wire import protocol as P
from wire.jobspec import JobSpec
endpoint, n, IDLE_HEARTBEAT = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 3 * n + 1024), hard))
ctx = zmq.Context()
ctx.setsockopt(zmq.LINGER, 0)
ctx.set(zmq.MAX_SOCKETS, n + 64)
held = []
for _ in range(n):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    s.connect(endpoint)
    s.send_multipart(P.encode(P.Hello(stream=1, spec=JobSpec(batch_size=1, image_size=16), slots=1,
                                      client=uuid.uuid4().hex, batches=[0], heartbeat=IDLE_HEARTBEAT)))
    held.append(s)
print("open", flush=True)
sys.stdin.read()
for s in held:
    s.close()
ctx.term()
"""


def anonymous_resident_mb(pid: int) -> float:
    """The process's resident anonymous memory (heap, arenas, stacks), from /proc/PID/status:
    what a flood can leave behind, without the shared libraries' pages it may fault in."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def flood_and_leave(svc: ServiceProcess, n: int) -> None:
    """``n`` connections say Hello, are all served a session, then all close; returns once the
    service holds no session and no connection of theirs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    flood = subprocess.Popen([sys.executable, "-c", HELLOS, svc.endpoint, str(n), str(IDLE_HEARTBEAT)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert flood.stdout.readline().strip() == b"open"
        wait_for(lambda: svc.status()["connections"]["sessions"] >= n, timeout=120, what=f"{n} flood sessions")
        flood.stdin.close()
        assert flood.wait(60) == 0
    finally:
        flood.kill()
        flood.wait()
        flood.stdout.close()
    wait_for(lambda: svc.status()["connections"]["open"] == 0, timeout=60, what="the flood's connections closed")


@pytest.mark.slow
def test_a_flood_s_memory_goes_back_to_the_system_once_its_connections_are_gone():
    """Issue 32: 3,000 connections that each open a session, then leave. Before, the service kept
    +20 MB or more for good (Python's arenas pinned by a few objects; the last sessions' heap never
    trimmed); now the dispatcher trims down to the drain's end, after a full collection, and the
    service's objects live in malloc (``PYTHONMALLOC=malloc``, which its decode processes do not
    inherit)."""
    n = 3000
    svc = ServiceProcess(0, ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1", "--max-sessions", str(n + 100)],
                         nofile=2 * n + 1024)
    try:
        with open(f"/proc/{svc.proc.pid}/environ", "rb") as f:
            assert b"PYTHONMALLOC=malloc" in f.read().split(b"\0")
        for p in svc.processes()[1:]:  # decode processes keep Python's own allocator
            assert b"PYTHONMALLOC" not in open(f"/proc/{p.pid}/environ", "rb").read()
        with RemoteLoader(svc.endpoint, batch_size=8, image_size=32, epoch_lookahead=False, timeout=60) as ld:
            assert sorted(indices_of(collect(ld))) == list(range(DEMO_SIZE))  # every path warmed up
        flood_and_leave(svc, 200)
        before = anonymous_resident_mb(svc.proc.pid)
        flood_and_leave(svc, n)
        # libzmq frees a connection's buffers after it reports it gone: the drain's last trim has a
        # follow-up a second later (heap.SETTLE_S), and that one must give them back
        after = [anonymous_resident_mb(svc.proc.pid)]
        try:
            wait_for(lambda: after.append(anonymous_resident_mb(svc.proc.pid)) or after[-1] - before < 6,
                     timeout=20, what="the flood's heap given back")
        except AssertionError as exc:
            raise AssertionError(f"{before:.1f} MB before the flood, {after[0]:.1f} MB once its connections were "
                                 f"closed, {after[-1]:.1f} MB 20 s later") from exc
        st = svc.status()
    finally:
        svc.stop()
    assert st["connections"]["sessions"] == 0 and st["totals"]["heap_trims"] > 0


def test_a_service_started_with_an_allocator_of_the_user_s_choice_keeps_it():
    svc = ServiceProcess(0, ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1"], env={"PYTHONMALLOC": "pymalloc"})
    try:
        for p in svc.processes():
            assert b"PYTHONMALLOC=pymalloc" in open(f"/proc/{p.pid}/environ", "rb").read().split(b"\0")
    finally:
        svc.stop()
