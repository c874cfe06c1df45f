"""Sessions end with their connections (issue 32 item 3): clients that send a Hello and are
SIGKILLed at once leave nothing listed, holding nothing, and their job's ranks are free again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from client import RemoteLoader
from loader_service.dispatch.state import ACCEPT_REPORT_GRACE_S
from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, status, wait_for

PROCS, SOCKETS = 4, 50  # 200 Hellos, as in the issue

FLOOD = r"""
import sys, uuid, zmq
from wire import protocol as P
from wire.jobspec import JobSpec
endpoint, first, n, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ctx = zmq.Context()
socks = []
for rank in range(first, first + n):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    s.connect(endpoint)
    s.send_multipart(P.encode(P.Hello(stream=1, job="vanishing", rank=rank, client=uuid.uuid4().hex,
                                      spec=JobSpec(batch_size=4, image_size=32, world_size=world), slots=2,
                                      batches=[0, 1])))
    socks.append(s)
print("sent", flush=True)
sys.stdin.read()  # held until killed
"""


@pytest.mark.slow
def test_clients_killed_right_after_their_hello_leave_no_session_and_free_their_job(make_service):
    svc = make_service(heartbeat_s=0.5)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", FLOOD, svc.endpoint, str(k * SOCKETS), str(SOCKETS),
                               str(PROCS * SOCKETS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
             for k in range(PROCS)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == b"sent"
        for p in procs:  # at once, Hellos possibly still queued
            os.kill(p.pid, signal.SIGKILL)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdin.close()
            p.stdout.close()
    # the deadline: the monitor's disconnects, or ZMTP heartbeats (3 x heartbeat_s) for a silent peer,
    # or, for a Hello read before its connection's accept was reported, ACCEPT_REPORT_GRACE_S from
    # when the loop read it, which a loaded machine may do seconds after the kill (once in CI the
    # old 11.5 s from the kill ran out); a session may end at a send that finds its connection gone
    # before the monitor's event for that connection is read: both are waited for
    wait_for(lambda: (status(svc)["connections"]["sessions"], status(svc)["connections"]["open"]) == (0, 0),
             timeout=3 * 0.5 + ACCEPT_REPORT_GRACE_S + 30, what="every killed client's session and connection dropped")
    assert status(svc)["clients"] == []
    wait_for(lambda: status(svc)["shm_bytes"] == status(svc)["connections"]["sessions"] == 0, what="slots back")
    # a new loader of the same job, with another world size, is served: no rank is held by the dead
    with RemoteLoader(svc.endpoint, batch_size=8, image_size=32, job="vanishing", epoch_lookahead=False) as ld:
        assert sorted(indices_of(collect(ld))) == list(range(DEMO_SIZE))
