"""The worker pool under hostile control traffic: a scale storm leaves no zombie and no
descriptor behind and never starts a burst of workers; a pool whose workers cannot start
still stops promptly on SIGTERM."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading

import httpx
import pytest
import psutil

from client import RemoteLoader
from loader_service import shm
from testkit.service import ROOT, ServiceProcess, free_port

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, status, wait_for
from testkit.hostile import workers as _workers, zombies as _zombies


def test_scale_storm_while_streaming_leaves_no_zombies_no_fds_and_starts_no_burst(demo_source):
    sp = ServiceProcess(free_port(), ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "2"],
                        env=dict(LOADER_HEARTBEAT_S="0.5"))
    try:
        me = psutil.Process(sp.proc.pid)
        wait_for(lambda: sp.status()["workers"]["counts"] == {"idle": 2}, what="two idle workers")
        fds_before = me.num_fds()
        result, errors, storming = {}, [], threading.Event()

        def stream() -> None:
            try:
                with RemoteLoader(sp.endpoint, batch_size=8, image_size=24, seed=5, epoch_lookahead=False) as ld:
                    result["batches"] = collect(ld)
            except BaseException as exc:
                errors.append(exc)

        def storm(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(10):
                try:
                    r = httpx.put(f"{sp.url}/v1/workers", json={"count": rng.randint(1, 6)}, timeout=30,
                                  headers={"Authorization": f"Bearer {sp.token}"})
                    assert r.status_code == 200, r.text
                except BaseException as exc:
                    errors.append(exc)

        client = threading.Thread(target=stream)
        client.start()
        storm_threads = [threading.Thread(target=storm, args=(s,)) for s in range(10)]
        storming.set()
        for t in storm_threads:
            t.start()
        most = 0
        while any(t.is_alive() for t in storm_threads):
            most = max(most, len([p for p in _workers(me) if _alive(p)]))
        for t in storm_threads:
            t.join()
        client.join(120)
        assert not errors, errors
        assert sorted(indices_of(result["batches"])) == list(range(DEMO_SIZE))
        # never a burst: at most the largest target live, plus as many again on their way out
        assert most <= 12, most
        sp.scale(2)
        wait_for(lambda: sp.status()["workers"]["counts"] == {"idle": 2}, timeout=60, what="the pool back at 2")
        wait_for(lambda: len(_workers(me)) == 2 and _zombies(me) == 0, timeout=30, what="every exited worker reaped")
        wait_for(lambda: me.num_fds() <= fds_before, timeout=30,
                 what=f"descriptors back to {fds_before} (now {me.num_fds()})")
    finally:
        sp.stop()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


SERVE_WITH_UNOPENABLE_DATA = textwrap.dedent("""
    import sys
    from loader_service import service
    from loader_service.cli.main import main
    from testkit.fault_source import FaultSource
    real = service.open_datasets
    # the test double: every worker fails to open the dataset, as in a container without the mount
    service.open_datasets = lambda config: {n: FaultSource(s, unopenable=True) for n, s in real(config).items()}
    sys.exit(main(sys.argv[1:]))
""")


def test_sigterm_with_no_worker_able_to_start_exits_within_the_drain_bound(demo_source):
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_WITH_UNOPENABLE_DATA, "serve", "--demo", "--demo-size", str(DEMO_SIZE),
         "--workers", "2", "--host", "127.0.0.1", "--data-port", "0", "--http-port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, LOADER_API_TOKEN="t"))
    try:
        line = "-"
        while line and "could not start" not in line:  # EOF ("") if it exits first
            line = proc.stderr.readline()
        assert "could not start" in line  # the first worker's failure: the pool is failing to start
        me = psutil.Process(proc.pid)
        children = me.children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        # drain_s + 3 stop ladder stages of stop_timeout_s (defaults 2 + 3 x 5) and the join margins
        code = proc.wait(timeout=2 + 3 * 5 + 10)
        assert code in (0, 1)  # 1 when it noticed the broken pool first and stopped on its own
        _, err = proc.communicate(timeout=10)
        assert "TypeError" not in err and "Exception in thread" not in err and "crashed" not in err, err[-3000:]
        # the workers are gone with the service; multiprocessing's resource tracker exits on its own
        # once the last process holding its pipe has, a moment later: wait for it, with a deadline
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not [c for c in alive if _alive(c)], [(c.pid, c.cmdline()) for c in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _deleted_segments(pids) -> list:
    """The unlinked loader segments that the processes ``pids`` still map."""
    out = []
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            out += [line.split()[-2] for line in f if "/loader_service-" in line and line.rstrip().endswith("(deleted)")]
    return out


def test_workers_unmap_a_segment_as_soon_as_it_is_unlinked_not_at_their_next_task(make_service):
    svc = make_service(workers=3)
    wait_for(lambda: all(w["pid"] for w in status(svc)["workers"]["list"]), what="the workers to start")
    pids = [w["pid"] for w in status(svc)["workers"]["list"]]
    for batch_size in (8, 16):  # a second shape of job: the first one's reserve is unlinked while it runs
        with RemoteLoader(svc.endpoint, batch_size=batch_size, image_size=32, seed=1, epoch_lookahead=False) as ld:
            assert sorted(indices_of(collect(ld))) == list(range(DEMO_SIZE))
    # the job ended: its connection's reserve is unlinked, and no worker has a task to come
    wait_for(lambda: not [n for n in shm.list_segments(os.getpid()) if "-slots-" in n], what="the slots unlinked")
    wait_for(lambda: _deleted_segments(pids) == [], what="workers to unmap the job's deleted segments")


@pytest.mark.parametrize("nice", [None, 0, 7])
def test_decode_processes_run_as_much_nicer_as_configured_also_those_started_later(make_service, nice):
    """``--worker-nice`` (10 unless given): the dispatcher and a trainer beside the service run
    before the decode processes when both want the CPU."""
    svc = make_service(api_token="t", **({} if nice is None else {"worker_nice": nice}))
    want = min(19, os.nice(0) + (10 if nice is None else nice))

    def ready(n):  # a worker says Ready once it runs at its niceness and has opened the datasets
        listed = status(svc)["workers"]["list"]
        return len(listed) == n and all(w["state"] in ("idle", "busy") for w in listed)

    wait_for(lambda: ready(2), what="the workers to start")
    # one started by a live scale, as the autoscaler's are
    r = httpx.put(f"{svc.http_url}/v1/workers", json={"count": 3}, headers={"Authorization": "Bearer t"}, timeout=30)
    assert r.status_code == 200, r.text
    wait_for(lambda: ready(3), what="the third worker to start")
    pids = [w["pid"] for w in status(svc)["workers"]["list"]]
    assert [psutil.Process(pid).nice() for pid in pids] == [want] * 3
    assert os.nice(0) == want - (10 if nice is None else nice)  # the service's own process (this one) as it was
    with RemoteLoader(svc.endpoint, batch_size=16, image_size=32, seed=1, epoch_lookahead=False) as ld:
        assert sorted(indices_of(collect(ld))) == list(range(DEMO_SIZE))


def test_a_stop_past_its_deadline_kills_the_workers_removes_the_shared_memory_and_exits_1(demo_source):
    # A decode worker frozen (SIGSTOP) holding a task: the stop's drain would wait drain_s (2 s) for
    # it, past the stop's deadline of 0.5 s. The stop gives up on the dispatcher's thread there,
    # logs where it is, and lets go of what needs no socket of it.
    sp = ServiceProcess(0, ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1", "--stop-deadline", "0.5"],
                        drain=True)
    try:
        wait_for(lambda: sp.status()["workers"]["counts"] == {"idle": 1}, what="an idle worker")
        (worker,) = [psutil.Process(pid) for pid in sp.worker_pids()]
        worker.suspend()
        ld = RemoteLoader(sp.endpoint, batch_size=8, image_size=24, timeout=3, epoch_lookahead=False)
        asking = threading.Thread(target=lambda: pytest.raises(Exception, next, iter(ld)))
        asking.start()
        wait_for(lambda: sp.status()["workers"]["counts"] == {"busy": 1}, what="a task on the frozen worker")
        assert shm.list_segments(sp.proc.pid)  # its batch slots and the co-location probe
        # the harness's stop (SIGTERM, then a wait) fails loudly on a stop that was cut
        with pytest.raises(AssertionError, match="the service's stop ran past its deadline"):
            sp.stop()
        err = "\n".join(sp.stderr_tail)
        asking.join(60)
        ld.close()
        assert sp.proc.returncode == 1, err
        assert ("thread loader-dispatcher did not stop within the stop's deadline (0.5s); leaving it behind. "
                "It is at:") in err
        assert "loader_service/dispatch/loop.py" in err, err  # its stack
        assert "abandoned the stop: killed the decode workers, removed" in err
        assert "exiting 1: thread loader-dispatcher did not stop within 0.5s" in err
        assert "Timeout (0:00" not in err  # the faulthandler backstop was not needed
        _, alive = psutil.wait_procs([worker], timeout=10)
        assert not [p for p in alive if _alive(p)]
        assert shm.list_segments(sp.proc.pid) == []
    finally:
        sp.stop()
