"""Faults and bad input: nothing lost, nothing doubled, clear errors, no hangs."""

from testkit.paths import REPO_ROOT
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import psutil
import pytest
import zmq

from client import LoaderError, RemoteLoader
from wire import protocol as P
from wire.jobspec import JobSpec
from testkit.fault_source import FaultSource
from testkit.service import ServiceProcess, free_port

from tests.conftest import DEMO_SIZE, write_imagefolder
from testkit.helpers import collect, indices_of, status, wait_for

ROOT = REPO_ROOT
KW = dict(batch_size=8, image_size=32, seed=4)


def demo_args():
    return ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "2"]


@pytest.fixture
def procs(demo_source):
    started = []

    def start(port, *extra, env=None):
        sp = ServiceProcess(port, demo_args() + list(extra), env=dict(LOADER_HEARTBEAT_S="0.5", **(env or {})))
        started.append(sp)
        return sp

    yield start
    for sp in started:
        sp.stop()


def gone(pids):
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_service_restart_mid_epoch_client_resumes_exactly_once(procs, how):
    port = free_port()
    first = procs(port)
    workers = first.worker_pids()
    got = []
    with RemoteLoader(first.endpoint, **KW, timeout=60) as ld:
        it = iter(ld)
        for _ in range(5):
            got.extend(next(it).indices)
        t0 = time.monotonic()
        first.proc.send_signal(getattr(signal, how))
        code = first.proc.wait(30)
        stopped_in = time.monotonic() - t0
        wait_for(lambda: gone(workers), what="the dead service's workers to exit")
        procs(port)  # a new service on the same port
        for b in it:
            got.extend(b.indices)
        assert ld.stats()["restarts"] >= 1
    assert sorted(got) == list(range(DEMO_SIZE))
    if how == "SIGTERM":
        assert code == 0 and stopped_in < 15  # drain (2 s) + worker stop ladder, well inside docker's 10 s? see docs
        assert "Traceback" not in first.proc.stderr.read()


SILENT_CLIENT = textwrap.dedent("""
    import json, sys
    from client import RemoteLoader
    ld = RemoteLoader(sys.argv[1], batch_size=8, image_size=32, seed=4, timeout=60)
    got = []
    for i, b in enumerate(ld):
        got.extend(b.indices)
        if i == 2:
            print("paused", flush=True)
            sys.stdin.readline()  # the test SIGSTOPs us around here, then SIGCONTs
    print(json.dumps({"indices": got, "restarts": ld.stats()["restarts"]}), flush=True)
""")


def test_silent_client_is_dropped_by_heartbeat_then_resumes_exactly_once(service):
    p = subprocess.Popen([sys.executable, "-c", SILENT_CLIENT, service.endpoint], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert p.stdout.readline().strip() == "paused"
        p.send_signal(signal.SIGSTOP)
        wait_for(lambda: not status(service)["clients"], what="the heartbeat to drop the frozen client")
        wait_for(lambda: status(service)["shm_bytes"] == 0, what="its slots to be released")
        p.send_signal(signal.SIGCONT)
        p.stdin.write("\n")
        p.stdin.flush()
        out = json.loads(p.stdout.readline())
        assert p.wait(60) == 0
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()
    assert sorted(out["indices"]) == list(range(DEMO_SIZE)) and out["restarts"] >= 1


@pytest.fixture
def bad_folder(tmp_path):
    root = write_imagefolder(str(tmp_path / "bad"), classes=2, per_class=10, png_every=4)
    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs)
    good = open(files[1], "rb").read()
    open(files[0], "wb").write(b"\x00" + random.Random(0).randbytes(2999))  # garbage (no image magic)
    open(files[5], "wb").write(good[: len(good) // 4])  # truncated JPEG
    open(files[11], "wb").write(b"")  # empty
    with open(files[13], "wb") as f:
        f.write(b"this is not an image")
    return root, files, {0: "not an image this service reads", 5: "corrupt or truncated JPEG", 11: "empty file",
                         13: "not an image this service reads"}


def test_bad_samples_skip_policy_delivers_the_rest_and_reports_each(make_service, bad_folder):
    root, files, bad = bad_folder
    svc = make_service(demo=False, data=(root,), on_error="skip")
    unreadable = files[17]
    os.unlink(unreadable)  # scanned, then gone: an unreadable path
    bad[17] = "No such file"
    with RemoteLoader(svc.endpoint, batch_size=6, image_size=24, dataset="bad", epoch_lookahead=False) as ld:
        batches = collect(ld)  # (no lookahead: the service-side count below is for this one epoch)
    skipped = {i: why for b in batches for i, why in b["skipped"]}
    assert sorted(skipped) == sorted(bad)
    for i, fragment in bad.items():  # each reason names the file
        assert fragment in skipped[i] and files[i] in skipped[i], skipped[i]
    assert sorted(indices_of(batches)) == sorted(set(range(20)) - set(bad))
    for b in batches:  # images and labels stay aligned with the delivered indices
        assert b["shape"][0] == len(b["indices"]) == len(b["labels"])
    assert status(svc)["totals"]["skipped"] == len(bad)


def test_bad_sample_raise_policy_names_the_file_with_the_worker_traceback(make_service, bad_folder):
    root, files, _ = bad_folder
    svc = make_service(demo=False, data=(root,), on_error="raise")
    with RemoteLoader(svc.endpoint, batch_size=20, image_size=24, dataset="bad", shuffle=False) as ld:
        with pytest.raises(LoaderError) as info:
            collect(ld)
    e = info.value
    assert e.code == "sample_failed" and files[0] in e.message and "DecodeError" in e.message
    assert "Traceback" in e.remote_traceback and "process_sample" in e.remote_traceback
    with RemoteLoader(svc.endpoint, batch_size=20, image_size=24, dataset="bad", shuffle=False) as again:
        with pytest.raises(LoaderError, match="sample_failed"):  # and the service still serves
            collect(again)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_poison_sample_that_kills_workers_is_isolated_not_retried_forever(make_service, demo_source, policy):
    poison = 37
    svc = make_service(on_error=policy, sources={"demo": FaultSource(demo_source, crash=[poison])})
    with RemoteLoader(svc.endpoint, **KW, epoch_lookahead=False) as ld:  # deaths below are for one epoch
        if policy == "raise":
            with pytest.raises(LoaderError, match=rf"sample {poison} \(.*\): crashed the decoder"):
                collect(ld)
            return
        batches = collect(ld)
    assert sorted(indices_of(batches)) == sorted(set(range(DEMO_SIZE)) - {poison})
    skipped = [s for b in batches for s in b["skipped"]]
    assert len(skipped) == 1 and skipped[0][0] == poison
    assert "crashed the decoder (worker killed by SIGKILL (-9: the kernel's OOM killer when memory runs out" in \
        skipped[0][1]
    st = status(svc)
    assert st["workers"]["deaths"] == 4  # the batch twice, then the sample alone twice
    wait_for(lambda: status(svc)["workers"]["counts"].get("idle", 0) == 2, what="the pool back at 2")


def random_frames(rng: random.Random):
    kind = rng.randrange(5)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 200))]
    if kind == 1:
        return [msgpack.packb({rng.choice(["v", "t", "x"]): rng.choice([1, "a", None, [1], 2**40])})]
    if kind == 2:
        good = P.encode_header(P.Hello(stream=1, spec=JobSpec(batch_size=4, image_size=32)))
        return [good[: rng.randrange(1, len(good))]]
    if kind == 3:
        return [P.encode_header(P.Request(stream=rng.randrange(0, 5), batches=[1])), rng.randbytes(10)]
    return [msgpack.packb({"v": 1, "t": rng.choice([1, 2, 4, 11, 21, 99]), "stream": rng.randrange(-5, 5)})]


def test_random_frames_at_the_live_port_get_errors_and_disturb_no_one(service):
    rng = random.Random(1234)
    sent, replies = 300, []
    with RemoteLoader(service.endpoint, **KW) as good:
        it = iter(good)
        got = list(next(it).indices)
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(service.endpoint)
        try:
            for _ in range(sent):
                s.send_multipart(random_frames(rng))
                assert s.poll(10000), "every bad message gets an answer"
                replies.append(P.decode(s.recv_multipart())[0])
        finally:
            s.close()
        for b in it:
            got.extend(b.indices)
    assert sorted(got) == list(range(DEMO_SIZE))
    assert all(isinstance(r, P.Error) for r in replies)
    assert {r.code for r in replies} <= {"bad_message", "bad_version", "bad_job", "unknown_client"}
    import httpx

    assert httpx.get(f"{service.http_url}/healthz", timeout=10).status_code == 200


@pytest.mark.slow
def test_sixteen_clients_several_epochs_exactly_once_with_bounded_resources(procs):
    import threading

    sp = procs(free_port())
    server = psutil.Process(sp.proc.pid)
    jobs = [dict(batch_size=8, seed=1), dict(batch_size=12, seed=2), dict(batch_size=5, seed=3, drop_last=True),
            dict(batch_size=16, seed=4, image_size=48)]
    world, epochs = 4, 3

    def run_all():
        results, errors = {}, []

        def one(j, rank):
            try:
                kw = dict(dict(image_size=32), **jobs[j])
                with RemoteLoader(sp.endpoint, rank=rank, world_size=world, job=f"job{j}", **kw) as ld:
                    for e in range(epochs):
                        ld.set_epoch(e)
                        results[(j, rank, e)] = [i for b in ld for i in b.indices]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(j, r)) for j in range(len(jobs)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        return results

    run_all()  # warm-up round: allocator arenas and caches reach their working size
    wait_for(lambda: not sp.status()["clients"], what="clients to leave")
    rss0, fds0 = server.memory_info().rss, server.num_fds()
    results = run_all()
    wait_for(lambda: not sp.status()["clients"], what="clients to leave")
    for j, job in enumerate(jobs):
        for e in range(epochs):
            got = [i for r in range(world) for i in results[(j, r, e)]]
            if job.get("drop_last"):
                assert len(got) == len(set(got)) == (DEMO_SIZE // world) // job["batch_size"] * job["batch_size"] * world
            else:
                assert sorted(set(got)) == list(range(DEMO_SIZE)) and len(got) == DEMO_SIZE
    # streams of departed clients release their slots once their last task is back
    wait_for(lambda: sp.status()["shm_bytes"] == 0, what="every batch slot to be released")
    st = sp.status()
    # no growth: connections of departed clients are closed asynchronously by zmq's io thread
    wait_for(lambda: server.num_fds() <= fds0, what=f"the service's open fds to return to {fds0}")
    rss1 = server.memory_info().rss
    print(f"\nload: 16 clients x {epochs} epochs, service RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, "
          f"fds {fds0} -> {server.num_fds()}, delivered {st['totals']['samples']} samples")
    assert rss1 < rss0 + 64 * 2**20, (rss0, rss1)
    from loader_service import shm

    assert [n for n in shm.list_segments(sp.proc.pid) if "-slots-" in n] == []


@pytest.mark.slow
def test_chaos_run_loses_and_doubles_nothing(demo_source, tmp_path):
    out = tmp_path / "chaos.json"
    r = subprocess.run([sys.executable, "-m", "bench.reliability.chaos", "--epochs", "8", "--demo-size",
                        str(DEMO_SIZE), "--seed", "3", "--min-gap", "0.2", "--max-gap", "0.6", "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    report = json.loads(out.read_text())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert report["lost"] == 0 and report["doubled"] == 0 and not report["errors"]
    assert report["samples_checked"] >= 2 * 8 * DEMO_SIZE
    assert sum(report["events"].values()) >= 3  # chaos actually happened


def test_sigterm_leaves_no_shared_memory_behind(imagefolder):
    """Regression: a second stop() (the main thread's) used to return while the signal
    handler's stop was still running, so the process exited before unlinking the index."""
    from loader_service import shm

    sp = ServiceProcess(free_port(), ["--data", imagefolder, "--workers", "1"])
    try:
        assert any("-index-" in n for n in shm.list_segments(sp.proc.pid))
        assert sp.kill(signal.SIGTERM) == 0
        assert shm.list_segments(sp.proc.pid) == []
    finally:
        sp.stop()
