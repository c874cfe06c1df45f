"""End-to-end invariants of the data plane, against a live service on loopback."""

from testkit.paths import REPO_ROOT
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zmq

from client import LoaderError, LoaderTimeout, RemoteLoader
from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service import shm
from loader_service.config import ServiceConfig
from wire.plan import PlanSpec, epoch_permutation, make_plan
from loader_service.shm import list_segments

from tests.conftest import DEMO_SIZE, write_imagefolder
from testkit.helpers import collect, image_array, indices_of, run_ranks, status, wait_for

N = DEMO_SIZE
KW = dict(batch_size=16, image_size=32, seed=5)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_exactly_once_per_epoch_across_ranks(service, world, drop_last):
    kw = dict(KW, batch_size=7 if world == 3 else 16)  # 240 / 3 / 7 leaves a short last batch
    results = run_ranks(service.endpoint, world, drop_last=drop_last, **kw)
    delivered = [i for r in results for i in indices_of(r)]
    padding = [b["padding"] for r in results for b in r]
    batch_counts = {len(r) for r in results}
    assert len(batch_counts) == 1, "every rank must get the same number of batches"
    if drop_last:
        assert len(delivered) == len(set(delivered))
        per_rank = (N // world) // kw["batch_size"] * kw["batch_size"]
        assert len(delivered) == per_rank * world
        assert all(len(b["indices"]) == kw["batch_size"] for r in results for b in r)
    else:
        perm = epoch_permutation(N, kw["seed"], 0, True)
        total = -(-N // world) * world
        expected = sorted(list(range(N)) + np.resize(perm, total)[N:].tolist())
        assert sorted(delivered) == expected
        assert sum(padding) == total - N
    for rank, r in enumerate(results):  # and each rank got exactly its plan, in order
        plan = make_plan(PlanSpec(N, kw["batch_size"], kw["seed"], 0, rank, world, True, drop_last))
        assert indices_of(r) == plan.indices[: plan.num_samples].tolist()


def test_same_seed_and_epoch_give_identical_bytes_other_epochs_differ(service):
    with RemoteLoader(service.endpoint, **KW) as a, RemoteLoader(service.endpoint, **KW) as b:
        first, second = collect(a), collect(b)
        b.set_epoch(1)
        other = collect(b)
    assert [x["images"] for x in first] == [x["images"] for x in second]
    assert [x["labels"] for x in first] == [x["labels"] for x in second]
    assert indices_of(first) != indices_of(other)
    assert sorted(indices_of(first)) == sorted(indices_of(other)) == list(range(N))


def test_labels_match_the_dataset(service, demo_source):
    with RemoteLoader(service.endpoint, **KW) as ld:
        for b in collect(ld, limit=3):
            assert b["labels"] == demo_source.labels[b["indices"]].tolist()


def test_resume_mid_epoch_yields_exactly_the_remainder(service):
    with RemoteLoader(service.endpoint, **KW) as ld:
        ld.set_epoch(2)
        full = collect(ld)
    with RemoteLoader(service.endpoint, **KW) as ld:
        ld.set_epoch(2)
        head = collect(ld, limit=6)
        state = ld.state_dict()
    assert state["epoch"] == 2 and state["position"] == 6 * 16
    with RemoteLoader(service.endpoint, **KW) as fresh:
        fresh.load_state_dict(state)
        fresh.set_epoch(2)  # what a training loop does on resume: keeps the position
        rest = collect(fresh)
        after = fresh.state_dict()
    assert [b["images"] for b in head + rest] == [b["images"] for b in full]
    assert indices_of(head + rest) == indices_of(full)
    assert after["position"] == N


def test_resume_state_from_another_plan_is_refused(service):
    with RemoteLoader(service.endpoint, **KW) as ld:
        state = ld.state_dict()
    with RemoteLoader(service.endpoint, **dict(KW, seed=KW["seed"] + 1)) as other:
        with pytest.raises(ValueError, match=f"seed: saved {KW['seed']} vs loader {KW['seed'] + 1}"):
            other.load_state_dict(state)


def test_iterating_again_moves_to_the_next_epoch_like_a_dataloader(service):
    with RemoteLoader(service.endpoint, **KW) as ld:
        assert len(ld) == N // 16
        e0, e1 = collect(ld), collect(ld)
        assert ld.state_dict()["epoch"] == 1
    assert indices_of(e0) != indices_of(e1)
    assert sorted(indices_of(e1)) == list(range(N))


def test_two_jobs_with_different_batch_sizes_interleaved_do_not_interfere(service):
    with RemoteLoader(service.endpoint, **KW) as solo_a, RemoteLoader(service.endpoint, **dict(KW, batch_size=24, seed=9, image_size=40)) as solo_b:
        ref_a, ref_b = collect(solo_a), collect(solo_b)
    a = RemoteLoader(service.endpoint, **KW, job="a")
    b = RemoteLoader(service.endpoint, **dict(KW, batch_size=24, seed=9, image_size=40), job="b")
    with a, b:
        ia, ib = iter(a), iter(b)
        got_a, got_b = [], []
        for step in range(max(len(ref_a), len(ref_b))):  # alternate, like two trainers sharing a service
            if step < len(ref_a):
                got_a.append(next(ia).raw.numpy().tobytes())
            if step < len(ref_b):
                got_b.append(next(ib).raw.numpy().tobytes())
    assert got_a == [x["images"] for x in ref_a]
    assert got_b == [x["images"] for x in ref_b]
    assert image_array(ref_b[0]).shape == (24, 40, 40, 3)


def test_imagefolder_with_jpeg_and_png(make_service, tmp_path):
    root = write_imagefolder(str(tmp_path / "folder"), classes=3, per_class=7, png_every=2)
    svc = make_service(demo=False, data=(root,))
    with RemoteLoader(svc.endpoint, batch_size=5, image_size=24, dataset="folder") as ld:
        batches = collect(ld)
    assert sorted(indices_of(batches)) == list(range(21))
    labels = {i: l for b in batches for i, l in zip(b["indices"], b["labels"])}
    assert [labels[i] for i in range(21)] == [i // 7 for i in range(21)]  # sorted class folders


def test_unknown_dataset_is_a_clear_error_and_service_keeps_serving(service):
    with RemoteLoader(service.endpoint, dataset="nope", **KW) as bad:
        with pytest.raises(LoaderError, match=r"unknown dataset 'nope'; this service serves \['demo'\]"):
            collect(bad)
    with RemoteLoader(service.endpoint, **KW) as good:
        assert len(indices_of(collect(good))) == N


def raw_client(endpoint: str):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def reply(sock, timeout_ms=10000):
    assert sock.poll(timeout_ms), "no reply from the service"
    return P.decode(sock.recv_multipart())[0]


@pytest.mark.parametrize("frames, code, match", [
    ([b"garbage"], "bad_message", "not valid msgpack"),
    ([b"\x82\xa1v\x63\xa1t\x01"], "bad_version", "version 99"),
    ([P.encode_header(P.Hello(stream=1, spec=JobSpec(batch_size=4, image_size=32))), b"extra frame"], "bad_message",
     "data frames"),
    ([P.encode_header(P.Accept(stream=1, epoch=0, num_batches=1, num_samples=1, dataset_length=1, dataset="d"))],
     "bad_message", "unexpected message Accept"),
])
def test_malformed_frames_get_an_error_reply_and_harm_no_one(service, frames, code, match):
    with RemoteLoader(service.endpoint, **KW) as good:
        it = iter(good)
        first = next(it)
        s = raw_client(service.endpoint)
        try:
            s.send_multipart(frames)
            err = reply(s)
        finally:
            s.close()
        rest = [b.indices for b in it]
    assert isinstance(err, P.Error) and err.code == code and match in err.message
    assert sorted(first.indices + [i for r in rest for i in r]) == list(range(N))
    assert status(service)["totals"]["bad_messages"] >= 1


def test_job_settings_that_would_break_every_sample_are_refused_naming_the_setting(service):
    """A ratio that passed validation used to fail every sample with an error naming an image
    file; a deep or huge pipeline_args got an internal error or a reply as large as the input."""
    s = raw_client(service.endpoint)
    try:
        cases = [
            (JobSpec(batch_size=4, image_size=32, ratio=[1e-9, 1e-9]), "ratio must lie within"),
            (JobSpec(batch_size=4, image_size=32, ratio=[1e308, 1e308]), "ratio must lie within"),
            (JobSpec(batch_size=4, image_size=32, pipeline="train", pipeline_args={"ratio": [1e-9, 1e-9]}),
             "argument 'ratio' must be two numbers"),
            (JobSpec(batch_size=4, image_size=32, pipeline="train", pipeline_args={"size": "x" * 30_000}),
             "argument 'size' must be an int"),
        ]
        for stream, (spec, match) in enumerate(cases, 1):
            s.send_multipart(P.encode(P.Hello(stream=stream, spec=spec)))
            err = reply(s)
            assert err.code == "bad_job" and match in err.message and err.stream == stream, err
            assert len(err.message) < 400 and ".jpg" not in err.message
        deep: object = 1
        for _ in range(990):
            deep = [deep]
        raw = __import__("msgpack").unpackb(P.encode_header(P.Hello(stream=9, spec=JobSpec(batch_size=4))))
        raw["spec"].update(pipeline="train", pipeline_args={"a": deep})
        s.send_multipart([__import__("msgpack").packb(raw)])
        err = reply(s)
        assert err.code == "bad_job" and "nest deeper than 8 levels" in err.message
        s.send_multipart(P.encode(P.Hello(stream=10, spec=JobSpec(batch_size=4, image_size=32))))
        assert isinstance(reply(s), P.Accept)  # and the service serves on
    finally:
        s.close(0)


def test_bad_job_spec_gets_an_error_naming_the_field(service):
    s = raw_client(service.endpoint)
    try:
        hello = P.encode_header(P.Hello(stream=1, spec=JobSpec(batch_size=4, image_size=32)))
        raw = __import__("msgpack").unpackb(hello)
        raw["spec"]["world_size"] = 0
        s.send_multipart([__import__("msgpack").packb(raw)])
        err = reply(s)
        assert err.code == "bad_job" and "JobSpec.world_size" in err.message and err.stream == 1
        s.send_multipart(P.encode(P.Hello(stream=2, spec=JobSpec(batch_size=4, image_size=32), batches=[10**6])))
        err = reply(s)
        assert err.code == "bad_job" and "past the end of the epoch" in err.message
        s.send_multipart(P.encode(P.Hello(stream=3, spec=JobSpec(batch_size=4, image_size=32), slots=256)))
        # 256 slots x 12 KiB fits, but an absurd batch does not
        assert isinstance(reply(s), P.Accept)
        s.send_multipart(P.encode(P.Hello(stream=4, spec=JobSpec(batch_size=60000, image_size=4096), slots=8)))
        err = reply(s)
        assert err.code == "no_capacity" and "raise --max-shm-mb" in err.message
    finally:
        s.close()


def test_oversized_message_disconnects_the_sender_only(service):
    with RemoteLoader(service.endpoint, **KW) as good:
        it = iter(good)
        first = next(it)
        s = raw_client(service.endpoint)
        try:
            s.send_multipart([b"x" * (P.MAX_CLIENT_MESSAGE_BYTES + 1)])
            assert not s.poll(300), "the service must not answer an oversized message"
        finally:
            s.close()
        rest = [b.indices for b in it]
    assert sorted(first.indices + [i for r in rest for i in r]) == list(range(N))


def test_a_request_from_an_unknown_client_is_answered_so_it_can_restart(service):
    s = raw_client(service.endpoint)
    try:
        s.send_multipart(P.encode(P.Request(stream=3, batches=[1])))
        err = reply(s)
        assert err.code == "unknown_client" and err.stream == 3 and not err.fatal
    finally:
        s.close()


KILLED_CLIENT = textwrap.dedent("""
    import sys
    from client import RemoteLoader
    ld = RemoteLoader(sys.argv[1], batch_size=16, image_size=64, prefetch=8)
    next(iter(ld))
    print("got", flush=True)
    sys.stdin.read()
""")


def test_killed_clients_free_their_buffers(service):
    root = REPO_ROOT
    baseline = status(service)
    for _ in range(20):
        p = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, service.endpoint], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, cwd=root, env=dict(os.environ, PYTHONPATH=root))
        try:
            assert p.stdout.readline().strip() == b"got"
            assert status(service)["shm_bytes"] > 0
        finally:
            p.kill()
            p.wait()
        wait_for(lambda: not status(service)["clients"] and status(service)["shm_bytes"] == 0,
                 what="the service to drop the killed client and free its slots")
    after = status(service)
    assert after["shm_bytes"] == baseline["shm_bytes"] == 0
    assert shm.list_segments(os.getpid()) == [n for n in shm.list_segments(os.getpid())
                                             if "-index-" in n or "-probe-" in n]  # the co-located probe


def test_no_service_gives_a_timeout_naming_the_endpoint():
    with RemoteLoader("tcp://127.0.0.1:9", timeout=0.5, **KW) as ld:
        with pytest.raises(LoaderTimeout, match=r"could not connect to the loader service at tcp://127.0.0.1:9 "
                                                r"within 0.5s; is it running and reachable\?"):
            collect(ld)


def test_a_loader_pointed_at_the_rest_port_says_something_else_listens_there(service):
    """The usual slip: the REST port instead of the data port. TCP connects, no ZMTP handshake."""
    rest = service.http_url.replace("http://", "tcp://")
    with RemoteLoader(rest, timeout=1.0, **KW) as ld:
        with pytest.raises(LoaderTimeout, match=rf"reached {rest} but no ZeroMQ handshake completed within 1s: "
                                                r"something else listens there \(the REST port\? the data port is"):
            collect(ld)

def test_healthz_answers(service):
    import httpx

    r = httpx.get(f"{service.http_url}/healthz", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok", "problem": ""}


def test_worker_killed_mid_epoch_loses_and_doubles_nothing(service):
    import signal

    with RemoteLoader(service.endpoint, **dict(KW, batch_size=8)) as ld:
        got = []
        for i, b in enumerate(ld):
            got.extend(b.indices)
            if i == 2:
                busy = [w for w in status(service)["workers"]["list"] if w["state"] == "busy"]
                victim = (busy or status(service)["workers"]["list"])[0]  # busy if any: its batch is redone
                os.kill(victim["pid"], signal.SIGKILL)
    assert sorted(got) == list(range(N))
    st = status(service)
    assert st["workers"]["deaths"] == 1
    wait_for(lambda: status(service)["workers"]["counts"].get("idle", 0) == 2, what="the pool to be back to 2")


def test_epoch_lookahead_changes_nothing_but_timing(service):
    with RemoteLoader(service.endpoint, **KW, epoch_lookahead=False) as plain:
        ref = [collect(plain) for _ in range(3)]  # epochs 0, 1, 2 by auto-advance
    with RemoteLoader(service.endpoint, **KW) as ld:
        got = [collect(ld) for _ in range(2)]
        assert ld._ahead is not None and ld._ahead.epoch == 2  # epoch 2 already streams on the spare connections
        ld.set_epoch(0)  # ... but the trainer jumps elsewhere: the lookahead must not leak in
        again = collect(ld)
        ld.set_epoch(2)
        last = collect(ld)
    assert [b["images"] for e in got for b in e] == [b["images"] for e in ref[:2] for b in e]
    assert [b["images"] for b in again] == [b["images"] for b in ref[0]]
    assert [b["images"] for b in last] == [b["images"] for b in ref[2]]


def test_lookahead_is_not_adopted_for_a_resumed_position(service):
    with RemoteLoader(service.endpoint, **KW) as ld:
        full = [collect(ld) for _ in range(2)]
    with RemoteLoader(service.endpoint, **KW) as ld:
        collect(ld)  # epoch 0; epoch 1 starts streaming ahead
        ld.load_state_dict(dict(ld.state_dict(), epoch=1, position=5 * 16))
        rest = collect(ld)
    assert indices_of(rest) == indices_of(full[1][5:])


def test_service_logs_throughput_while_serving_and_stays_quiet_when_idle(make_service, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="loader_service")
    svc = make_service(status_log_s=0)  # no log thread: this test calls the log step itself

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "loader_service" and "img/s" in r.getMessage()]

    wait_for(lambda: status(svc)["workers"]["counts"].get("idle", 0) == 2, what="both workers started")
    svc._log_progress()  # the baseline: says nothing
    with RemoteLoader(svc.endpoint, **KW, epoch_lookahead=False) as ld:
        assert sorted(indices_of(collect(ld))) == list(range(N))
    svc._log_progress()
    assert len(lines()) == 1
    assert f"{N} samples delivered, 0 skipped" in lines()[0] and "workers: idle 2" in lines()[0]
    # the client's last Request (its stream ends) and Bye may still be on their way
    wait_for(lambda: not status(svc)["clients"], what="the client to have left")
    svc._log_progress()  # idle, nothing delivered since: quiet
    assert len(lines()) == 1


def test_service_logs_throughput_on_its_own_interval(make_service, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="loader_service")
    svc = make_service(status_log_s=0.05)
    with RemoteLoader(svc.endpoint, **KW, epoch_lookahead=False) as ld:
        collect(ld)
    wait_for(lambda: any(f"{N} samples delivered" in r.getMessage() for r in caplog.records),
             what="the periodic throughput line")


def test_status_log_interval_is_validated():
    with pytest.raises(ValueError, match="status_log_s must be >= 0"):
        ServiceConfig(demo=True, status_log_s=-1)


def test_a_clients_next_epoch_reuses_its_batch_slots_and_leaving_frees_them(service):

    def slot_segments():
        return sorted(n for n in shm.list_segments(os.getpid()) if "-slots-" in n)

    with RemoteLoader(service.endpoint, **KW, prefetch=2, epoch_lookahead=False) as ld:
        seen, epochs = [], []
        for _ in range(3):
            epochs.append(collect(ld))
            seen.append(slot_segments())
        assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 1  # one segment, kept across epochs
        assert status(service)["shm_bytes"] == 2 * KW["batch_size"] * KW["image_size"] ** 2 * 3
        # a resume near the end: an on-demand stream's slots depend on prefetch only, so the same
        # segment serves it
        ld.load_state_dict(dict(ld.state_dict(), epoch=3, position=(len(ld) - 1) * KW["batch_size"]))
        tail = collect(ld)
        assert slot_segments() == seen[0]
    assert [sorted(indices_of(e)) for e in epochs] == [list(range(N))] * 3
    assert indices_of(tail) == list(make_plan(PlanSpec(N, KW["batch_size"], KW["seed"], 3)).batch(len(epochs[0]) - 1))
    wait_for(lambda: not slot_segments() and status(service)["shm_bytes"] == 0, what="the slots to be freed")


def test_resume_from_an_epoch_end_checkpoint_in_the_usual_loop(service):
    """``for epoch in range(saved_epoch, E): set_epoch(epoch)`` after loading a state taken at the
    end of an epoch: that epoch yields nothing more, the next ones are whole and correctly numbered."""
    with RemoteLoader(service.endpoint, **KW) as ld:
        ld.set_epoch(0)
        collect(ld)
        state = ld.state_dict()
        assert (state["epoch"], state["position"]) == (0, N)
    with RemoteLoader(service.endpoint, **KW) as ld:
        ld.load_state_dict(state)
        got = {}
        for epoch in range(state["epoch"], 2):
            ld.set_epoch(epoch)
            got[epoch] = collect(ld)
    assert got[0] == []
    assert sorted(indices_of(got[1])) == list(range(N))
    assert indices_of(got[1]) == list(make_plan(PlanSpec(N, 16, KW["seed"], 1)).indices[: N])
    # without set_epoch, a restored end-of-epoch state moves on to the next epoch (DataLoader-like)
    with RemoteLoader(service.endpoint, **KW) as ld:
        ld.load_state_dict(state)
        assert indices_of(collect(ld)) == indices_of(got[1])


def _deleted_shm_mappings(pid: int) -> list:
    """The service's unlinked segments ``pid`` still maps (not multiprocessing's own arenas,
    which it unlinks at once by design: the worker's progress cell lives in one)."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split()[-2] for line in f if f"/dev/shm/{shm.PREFIX}" in line
                       and line.rstrip().endswith("(deleted)")})


def _shm_mappings(pid: int) -> list:
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split()[-1] for line in f if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")})


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /proc and /dev/shm")
def test_workers_drop_the_mappings_of_segments_the_dispatcher_unlinked(make_service):
    """A worker's cached mapping of a gone segment would pin its memory past max_shm_mb."""
    svc = make_service(workers=1)

    def slot_segments():
        return {n for n in list_segments(os.getpid()) if "-slots-" in n}

    with RemoteLoader(svc.endpoint, **KW) as ld:
        collect(ld, limit=3)
        gone = slot_segments()
    assert len(gone) == 1, "the first client's stream made no segment"
    wait_for(lambda: not gone & slot_segments(), what="the first client's segment to be unlinked")
    pid = status(svc)["workers"]["list"][0]["pid"]
    with RemoteLoader(svc.endpoint, **dict(KW, image_size=48)) as ld:
        collect(ld, limit=3)  # three tasks of the new stream ran on the one worker
        mapped, deleted = _shm_mappings(pid), _deleted_shm_mappings(pid)
    assert mapped, "the worker maps no segment: wrong process?"
    assert deleted == [], f"the worker still maps unlinked segments: {deleted}"
