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
from tests.support.helpers import collect, indices_of, status, wait_for

HELD = 300

# Holds ``n`` DEALER connections that each sent one Hello (batch 1, prefetch 1) and read nothing;
# once all are open it says so, and at the word "go" it keeps adding newcomers (up to 500 a
# second) on ``churn`` more connections, each replaced by a new one with a new Hello, until its
# stdin closes; then it prints how many newcomers it made.
FLOOD = r"""
import collections, resource, select, sys, uuid, zmq
from wire import protocol as P
from wire.jobspec import JobSpec
endpoint, n, churn = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))  # closed sockets free their fds later
ctx = zmq.Context()
ctx.setsockopt(zmq.LINGER, 0)
ctx.set(zmq.MAX_SOCKETS, 8192)
def one():
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    s.connect(endpoint)
    s.send_multipart(P.encode(P.Hello(stream=1, spec=JobSpec(batch_size=1, image_size=16), prefetch=1,
                                      client=uuid.uuid4().hex)))
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
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, svc.endpoint, str(HELD), "20"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
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
