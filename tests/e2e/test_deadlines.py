"""No stall outlives a deadline, and failures are loud (live services, real worker processes).

* a worker frozen with SIGSTOP mid-epoch: its task outlives the deadline, the worker is killed
  and replaced, the task is redone, and the epoch completes exactly once;
* a sample whose read hangs every time: isolated like a poison sample, then ``on_error``;
* a pool whose workers cannot start, or hang while starting: ``/healthz`` answers 503 with the
  reason;
* a worker told to stop whose exit hangs: killed at its stop deadline, counted, replaced in the
  pool's allowance;
* a dispatcher loop that dies: ``/healthz`` answers 503 and ``serve`` exits 1;
* a dispatcher loop that is stuck: ``/healthz`` and REST reads answer 503 in time, the log
  shows where the loop is, and all is well again once it moves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from client import LoaderError, LoaderTimeout, RemoteLoader
from testkit.fault_source import FaultSource
from testkit.service import ROOT, free_port

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, status, wait_for

KW = dict(batch_size=16, image_size=32, shuffle=True, seed=3, timeout=60, epoch_lookahead=False)


def test_a_sigstopped_worker_is_replaced_and_the_epoch_completes_exactly_once(make_service):
    svc = make_service(task_deadline_s=2.0)
    frozen = []

    def freeze_a_busy_worker():
        busy = [w for w in status(svc)["workers"]["list"] if w["state"] == "busy" and w["pid"]]
        if busy:
            os.kill(busy[0]["pid"], signal.SIGSTOP)
            frozen.append(busy[0]["pid"])
        return bool(busy)

    with RemoteLoader(svc.endpoint, **KW) as ld:
        batches = []
        for b in ld:
            batches.append(list(b.indices))
            if len(batches) == 2:
                wait_for(freeze_a_busy_worker, what="a busy worker to freeze")
    assert sorted(i for b in batches for i in b) == list(range(DEMO_SIZE))
    st = status(svc)
    assert st["workers"]["hung"] >= 1 and st["totals"]["hung_tasks"] >= 1
    assert frozen[0] not in [w["pid"] for w in st["workers"]["list"]], "the frozen worker is still in the pool"
    wait_for(lambda: status(svc)["workers"]["counts"].get("idle", 0) == 2, what="the pool back at 2 workers")


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_sample_that_hangs_every_time_is_isolated_and_judged_by_on_error(make_service, demo_source, policy):
    stuck = 21
    svc = make_service(on_error=policy, task_deadline_s=1.5,
                       sources={"demo": FaultSource(demo_source, hang=[stuck])})
    with RemoteLoader(svc.endpoint, **KW) as ld:
        if policy == "raise":
            with pytest.raises(LoaderError, match=rf"sample {stuck} \(.*\): hung: still running after its 1.5s"):
                collect(ld)
            return
        batches = collect(ld)
    assert sorted(indices_of(batches)) == sorted(set(range(DEMO_SIZE)) - {stuck})
    skipped = [s for b in batches for s in b["skipped"]]
    assert [i for i, _ in skipped] == [stuck] and "hung" in skipped[0][1] and "deadline" in skipped[0][1]
    assert status(svc)["workers"]["hung"] == 4  # the batch twice, then the sample alone twice


def test_healthz_fails_with_the_reason_when_no_worker_can_start(make_service, demo_source):
    svc = make_service(sources={"demo": FaultSource(demo_source, unopenable=True)})
    wait_for(lambda: httpx.get(f"{svc.http_url}/healthz", timeout=10).status_code == 503, what="healthz to fail")
    body = httpx.get(f"{svc.http_url}/healthz", timeout=10).json()
    assert body["status"] == "failing" and "cannot open dataset 'demo'" in body["problem"]
    with RemoteLoader(svc.endpoint, **KW) as ld:
        with pytest.raises(LoaderError, match="cannot open dataset 'demo'"):
            collect(ld)


def test_workers_that_hang_while_starting_are_killed_and_healthz_says_so(make_service, demo_source):
    svc = make_service(worker_start_s=1.0, sources={"demo": FaultSource(demo_source, hang_open=True)})
    wait_for(lambda: httpx.get(f"{svc.http_url}/healthz", timeout=10).status_code == 503, what="healthz to fail")
    body = httpx.get(f"{svc.http_url}/healthz", timeout=10).json()
    # workers 0 and 1, then a replacement: three failed starts in a row
    assert re.fullmatch(r"worker [23] did not become ready within 1s and was killed \(hung opening a dataset or "
                        r"importing a pipeline\?\)", body["problem"]), body
    with RemoteLoader(svc.endpoint, **KW) as ld:
        with pytest.raises(LoaderError, match="did not become ready within 1s and was killed"):
            collect(ld)
    assert not [w for w in status(svc)["workers"]["list"] if w["state"] == "starting"]

def test_workers_whose_exit_hangs_are_killed_at_their_stop_deadline(make_service, demo_source, caplog):
    token = "t"
    svc = make_service(workers=2, worker_stop_s=1.0, api_token=token,
                       sources={"demo": FaultSource(demo_source, hang_close=True)})
    wait_for(lambda: status(svc)["workers"]["counts"] == {"idle": 2}, what="two idle workers")

    def scale(n: int) -> None:
        r = httpx.put(f"{svc.http_url}/v1/workers", json={"count": n}, headers={"Authorization": f"Bearer {token}"},
                      timeout=10)
        assert r.status_code == 200, r.text

    scale(1)  # the dismissed worker's source never closes: only the stop deadline ends it
    wait_for(lambda: status(svc)["workers"]["stop_kills"] == 1 and status(svc)["workers"]["counts"] == {"idle": 1},
             what="the worker that did not exit to be killed")
    with RemoteLoader(svc.endpoint, **KW) as ld:
        assert sorted(indices_of(collect(ld))) == list(range(DEMO_SIZE))
    scale(0)
    wait_for(lambda: status(svc)["workers"]["stop_kills"] == 2 and status(svc)["workers"]["counts"] == {},
             what="the last worker to be killed")
    st = status(svc)["workers"]
    assert st["deaths"] == 0 and st["hung"] == 0  # told to stop: not a death
    killed = [r.getMessage() for r in caplog.records if "was told to stop" in r.getMessage()]
    assert len(killed) == 2 and all(re.fullmatch(r"worker \d \(pid \d+\) was told to stop 1s ago and has not exited; "
                                                 r"killing it", m) for m in killed), killed
    assert "loader_worker_stop_kills_total 2.0" in httpx.get(f"{svc.http_url}/metrics", timeout=10).text


def test_a_rest_server_that_stopped_is_a_problem_serve_exits_on(make_service):
    svc = make_service()
    assert svc.problem() == ""
    svc._http.should_exit = True  # as if uvicorn's thread had ended on its own
    wait_for(lambda: not svc._http_thread.is_alive(), what="the REST thread to end")
    assert svc.problem() == "the REST server has stopped (no /healthz, /v1/status or scaling); see the log"
    svc.stop()
    assert svc.problem() == ""  # a stop is not a failure

def test_a_stuck_dispatcher_loop_fails_healthz_in_time_and_recovers(make_service, caplog):
    svc = make_service(loop_answer_s=0.5)
    wait_for(lambda: svc.wait_ready(0), what="a worker")
    assert httpx.get(f"{svc.http_url}/healthz", timeout=10).status_code == 200
    release, blocked = threading.Event(), threading.Event()

    def wedge_the_loop():
        blocked.set()
        release.wait(60)

    svc.dispatcher.post(wedge_the_loop)
    try:
        assert blocked.wait(10)
        health = httpx.get(f"{svc.http_url}/healthz", timeout=10)
        assert health.status_code == 503
        why = "the dispatcher loop has not answered for 0.5s (stuck: every client stalls; its stack is in the log)"
        assert health.json() == {"status": "failing", "problem": why}
        st = httpx.get(f"{svc.http_url}/v1/status", timeout=10)
        assert (st.status_code, st.json()["detail"]) == (503, why)
        logged = [r.getMessage() for r in caplog.records if "the loop thread is at:" in r.getMessage()]
        assert len(logged) == 1 and "wedge_the_loop" in logged[0] and "release.wait(60)" in logged[0]
    finally:
        release.set()
    wait_for(lambda: httpx.get(f"{svc.http_url}/healthz", timeout=10).status_code == 200, what="healthz to recover")
    assert httpx.get(f"{svc.http_url}/v1/status", timeout=10).status_code == 200

def test_a_dead_dispatcher_fails_healthz(make_service, monkeypatch):
    from loader_service.dispatch.state import DispatchState

    svc = make_service()
    wait_for(lambda: svc.wait_ready(0), what="a worker")
    crashed = threading.Event()

    def broken_schedule(self):
        crashed.set()
        raise RuntimeError("injected scheduler bug")

    monkeypatch.setattr(DispatchState, "_schedule", broken_schedule)
    svc.dispatcher.post(lambda: None)  # wake the loop: it runs the broken step and dies
    wait_for(crashed.is_set, what="the loop to run the broken step")
    wait_for(lambda: httpx.get(f"{svc.http_url}/healthz", timeout=10).status_code == 503, what="healthz to fail")
    assert "injected scheduler bug" in httpx.get(f"{svc.http_url}/healthz", timeout=10).json()["problem"]


SERVE_WITH_A_DISPATCHER_BUG = """
import sys
from loader_service.dispatch.state import DispatchState
from loader_service.cli.main import main
real = DispatchState._schedule
def schedule(self):
    if self.workers.counts().get("idle"):  # once a worker is up
        raise RuntimeError("injected scheduler bug")
    return real(self)
DispatchState._schedule = schedule
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_serve_exits_non_zero_when_the_dispatcher_dies(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, LOADER_API_TOKEN="t", LOADER_CACHE_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_WITH_A_DISPATCHER_BUG, "serve", "--demo", "--demo-size", "64", "--workers", "1",
         "--data-port", str(free_port()), "--http-port", str(free_port()), "--status-log", "0"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "injected scheduler bug" in proc.stderr


def test_a_timeout_while_a_sample_hangs_names_the_sample_and_its_file(make_service, demo_source):
    """The service is alive but one read never returns (its deadline is far off): the client's
    timeout says so, naming the batch, the sample and its file, not "is it running?"."""
    stuck = 21  # batch 1, position 5, with shuffle off and batches of 16
    svc = make_service(workers=1, task_deadline_s=120, sources={"demo": FaultSource(demo_source, hang=[stuck])})
    with RemoteLoader(svc.endpoint, **{**KW, "shuffle": False, "timeout": 3}) as ld:
        with pytest.raises(LoaderTimeout) as info:
            collect(ld)
    assert re.fullmatch(
        rf"\[timeout\] no batch for 3s: the loader service at {re.escape(svc.endpoint)} is alive but slow: batch 1 has been "
        rf"decoding for \d+s, its worker on sample {stuck} \({re.escape(demo_source.describe(stuck))}\) for \d+s"
        r"( \(said \d+s ago\))?", str(info.value)), str(info.value)


def test_a_timeout_on_a_service_without_workers_says_so(make_service):
    svc = make_service(workers=0)
    with RemoteLoader(svc.endpoint, **{**KW, "timeout": 2}) as ld:
        with pytest.raises(LoaderTimeout, match=rf"no batch for 2s: the loader service at {re.escape(svc.endpoint)} "
                                                r"is alive but has no workers \(its /healthz says why\)"):
            collect(ld)


def test_a_hello_that_comes_while_the_workers_stop_is_answered_shutting_down(make_service, demo_source,
                                                                             monkeypatch):
    """After its goodbyes the dispatcher waits for its workers to exit, its data port still open: a
    loader that connects then (a validation loader starting as a replica stops) is told the service
    is shutting down, and takes its batches from the other replica at once. Before, it heard nothing
    until the process was gone, then waited out its replica_timeout (here: past its timeout)."""
    import zmq

    from loader_service.workers.pool import WorkerPool
    from testkit.helpers import collect, indices_of
    from wire import protocol as P
    from wire.jobspec import JobSpec

    # one worker whose source never closes: the pool's close waits out its stop_timeout_s
    stopping = make_service(workers=1, stop_timeout_s=20.0, sources={"demo": FaultSource(demo_source, hang_close=True)})
    other = make_service(workers=1)
    with RemoteLoader(other.endpoint, **KW) as ld:
        want = collect(ld)
    closing, real = threading.Event(), WorkerPool.close

    def close(self, *args, **kw):
        closing.set()
        return real(self, *args, **kw)

    monkeypatch.setattr(WorkerPool, "close", close)
    stopper = threading.Thread(target=stopping.stop, name="stopping")
    stopper.start()
    try:
        assert closing.wait(30), "the service never began to stop its workers"
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(stopping.endpoint)
        s.send_multipart(P.encode(P.Hello(stream=7, spec=JobSpec(batch_size=4, image_size=16, seed=1), slots=1,
                                          batches=[0])))
        assert s.poll(15_000), "no answer to a Hello while the workers stop"
        msg, _ = P.decode(s.recv_multipart())
        s.close(0)
        ctx.term()
        assert isinstance(msg, P.Error) and msg.code == P.ErrorCode.SHUTTING_DOWN and msg.stream == 7, msg
        with RemoteLoader([stopping.endpoint, other.endpoint], **{**KW, "timeout": 30}, replica_timeout=60) as ld:
            got = collect(ld)
        assert stopper.is_alive(), "the workers' stop ended before the loader's epoch: the test proves nothing"
        assert sorted(indices_of(got)) == list(range(DEMO_SIZE)) and indices_of(got) == indices_of(want)
        assert [b["images"] for b in got] == [b["images"] for b in want]
    finally:
        stopper.join(60)
