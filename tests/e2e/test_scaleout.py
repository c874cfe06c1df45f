"""One trainer rank drawing from several service replicas."""

import logging
import os
import signal
import socket

import pytest

from client import LoaderError, RemoteLoader, resolve_endpoints
from testkit.service import ServiceProcess, free_port

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, status

KW = dict(batch_size=8, image_size=32, seed=6)


def test_two_replicas_give_the_same_bytes_in_the_same_order_as_one(make_service):
    a, b = make_service(), make_service()
    # no lookahead: the service-side sample counts below must cover exactly one epoch per loader
    with RemoteLoader(a.endpoint, **KW, epoch_lookahead=False) as one:
        ref = collect(one)
    with RemoteLoader([a.endpoint, b.endpoint], **KW, epoch_lookahead=False) as two:
        got = collect(two)
        assert len(two) == DEMO_SIZE // 8
    assert [x["index"] for x in got] == list(range(DEMO_SIZE // 8))
    assert [x["images"] for x in got] == [x["images"] for x in ref]
    assert indices_of(got) == indices_of(ref)
    # both replicas did their share
    sa, sb = status(a)["totals"]["samples"], status(b)["totals"]["samples"]
    assert sa - DEMO_SIZE > 0 and sb > 0 and (sa - DEMO_SIZE) + sb == DEMO_SIZE


def test_resume_across_replicas(make_service):
    a, b = make_service(), make_service()
    with RemoteLoader([a.endpoint, b.endpoint], **KW) as ld:
        head = collect(ld, limit=7)
        state = ld.state_dict()
    with RemoteLoader([b.endpoint, a.endpoint], **KW) as ld:  # order of replicas does not matter
        ld.load_state_dict(state)
        rest = collect(ld)
    assert sorted(indices_of(head + rest)) == list(range(DEMO_SIZE))
    assert [x["index"] for x in head + rest] == list(range(DEMO_SIZE // 8))


def test_a_replica_that_dies_mid_epoch_loses_its_batches_to_the_others(demo_source):
    args = ["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1"]
    a, b = ServiceProcess(free_port(), args), ServiceProcess(free_port(), args)
    try:
        with RemoteLoader(a.endpoint, **KW) as one:
            ref = collect(one)
        with RemoteLoader([a.endpoint, b.endpoint], **KW, replica_timeout=1.0, heartbeat_s=0.3) as ld:
            got = []
            for i, batch in enumerate(ld):
                got.append(batch.raw.numpy().tobytes())
                if i == 4:
                    b.kill(signal.SIGKILL)  # and it never comes back
        assert got == [x["images"] for x in ref]
    finally:
        a.stop()
        b.stop()
    # a SIGKILLed service cannot unlink its segments; the next start on the node sweeps them
    from loader_service import shm

    assert all(n.startswith(f"{shm.PREFIX}{b.proc.pid}-") for n in shm.sweep_stale())
    assert shm.list_segments(b.proc.pid) == []


def test_replicas_split_evenly_between_datasets_are_refused_naming_each(make_service):
    a, b = make_service(), make_service(demo_size=DEMO_SIZE // 2)
    with RemoteLoader([a.endpoint, b.endpoint], **KW) as ld:
        with pytest.raises(LoaderError) as info:
            collect(ld)
    assert info.value.code == "replica_mismatch"
    assert info.value.message.startswith("the replicas serve different data and none is served by most of them: ")
    for svc, n in ((a, DEMO_SIZE), (b, DEMO_SIZE // 2)):
        assert f"{svc.endpoint} serves 'demo' with {n} samples (fingerprint " in info.value.message
    assert "do all replicas serve the same dataset?" in info.value.message


def test_the_dataset_most_replicas_serve_is_followed_and_the_odd_one_quarantined(make_service, caplog):
    """Whichever replica answers first: the odd one out is named once and never used, and every
    epoch is exactly once from the others (before: the first answer won, and the other replicas'
    Accepts ended the loader with [dataset_changed])."""
    a, b = make_service(workers=1), make_service(workers=1)
    odd = make_service(workers=1, demo_size=DEMO_SIZE + 8)
    with RemoteLoader(a.endpoint, **KW) as one:
        ref = [collect(one) for _ in range(2)]
    caplog.set_level(logging.WARNING, logger="client")
    with RemoteLoader([odd.endpoint, a.endpoint, b.endpoint], **KW) as ld:
        assert len(ld) == DEMO_SIZE // 8
        got = [collect(ld) for _ in range(2)]
    for mine, theirs in zip(got, ref):
        assert [x["images"] for x in mine] == [x["images"] for x in theirs]
        assert sorted(indices_of(mine)) == list(range(DEMO_SIZE))
    said = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"service replica {odd.endpoint} is quarantined: it serves 'demo' "
                                                 f"with {DEMO_SIZE + 8} samples")
    assert status(odd)["totals"]["samples"] == 0


def test_a_replica_that_decodes_otherwise_is_quarantined_not_mixed_in(make_service, caplog):
    """The same dataset, one replica with --jpeg-fast-dct: the same samples in other bytes (found by a
    probe: before, 8 of 20 batches came out other bytes, silently). The odd one is named and never
    used; the epochs are byte for byte the other replicas'."""
    kw = dict(KW, image_size=192)  # a crop decoded at 1/8 scale is DC coefficients only: no IDCT to differ
    a, b = make_service(workers=1), make_service(workers=1)
    odd = make_service(workers=1, jpeg_fast_dct=True)
    with RemoteLoader(a.endpoint, **kw) as one:
        ref = [collect(one) for _ in range(2)]
    with RemoteLoader(odd.endpoint, **kw) as one:
        assert [x["images"] for x in collect(one)] != [x["images"] for x in ref[0]], "the test proves nothing"
    served = status(odd)["totals"]["samples"]
    caplog.set_level(logging.WARNING, logger="client")
    with RemoteLoader([odd.endpoint, a.endpoint, b.endpoint], **kw) as ld:
        got = [collect(ld) for _ in range(2)]
        assert list(ld.quarantined()) == [odd.endpoint]
    for mine, theirs in zip(got, ref):
        assert [x["images"] for x in mine] == [x["images"] for x in theirs]
        assert sorted(indices_of(mine)) == list(range(DEMO_SIZE))
    said = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"service replica {odd.endpoint} is quarantined: it decodes 'demo' "
                                                 "otherwise than the replicas this loader follows (decoding ")
    assert status(odd)["totals"]["samples"] == served  # none of the epochs' samples came from it


def test_resolve_endpoints():
    assert resolve_endpoints("tcp://127.0.0.1:5555") == ["tcp://127.0.0.1:5555"]
    eps = resolve_endpoints("tcp://localhost:5555")
    assert "tcp://127.0.0.1:5555" in eps and len(eps) == len(set(eps))
    with pytest.raises(ValueError, match="tcp://host:port"):
        resolve_endpoints("localhost:5555")
    with pytest.raises(socket.gaierror):
        resolve_endpoints("tcp://no-such-host.invalid:5555")


def test_empty_endpoint_list_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        RemoteLoader([], batch_size=4)
    with pytest.raises(ValueError, match="endpoint"):
        RemoteLoader(["tcp://127.0.0.1:1", "nonsense"], batch_size=4)
