"""Client-side behaviour that needs no GPU: the normalize math, CPU fallback, echo, stats."""

import numpy as np
import pytest
import torch

from client import LoaderError, RemoteLoader
from client.config import IMAGENET_MEAN, IMAGENET_STD, LoaderConfig
from client.transform import Normalize

from tests.conftest import DEMO_SIZE


def reference(raw: np.ndarray, mean, std) -> np.ndarray:
    x = raw.astype(np.float64).transpose(0, 3, 1, 2)
    return (x - np.array(mean).reshape(1, 3, 1, 1)) / np.array(std).reshape(1, 3, 1, 1)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_normalize_matches_a_float64_reference(dtype, tol):
    raw = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, 9, 7, 3), dtype=np.uint8))
    out = Normalize(IMAGENET_MEAN, IMAGENET_STD, dtype)(raw)
    assert out.shape == (4, 3, 9, 7) and out.dtype == getattr(torch, dtype)
    assert out.is_contiguous(memory_format=torch.channels_last)
    ref = reference(raw.numpy(), IMAGENET_MEAN, IMAGENET_STD)
    err = np.abs(out.float().numpy() - ref) / np.maximum(1.0, np.abs(ref))
    assert err.max() <= tol


def test_normalize_refuses_wrong_input():
    with pytest.raises(ValueError, match="expected uint8"):
        Normalize(IMAGENET_MEAN, IMAGENET_STD)(torch.zeros(2, 3, 4, 4))


def test_cpu_path_with_normalize_and_raw_kept(service, recwarn):
    with RemoteLoader(service.endpoint, batch_size=8, image_size=32, normalize=True, dtype="float16") as ld:
        b = next(iter(ld))
    assert b.raw.dtype == torch.uint8 and b.raw.shape == (8, 32, 32, 3)
    assert b.images.dtype == torch.float16 and b.images.shape == (8, 3, 32, 32)
    ref = reference(b.raw.numpy(), IMAGENET_MEAN, IMAGENET_STD)
    assert np.allclose(b.images.float().numpy(), ref, atol=2e-2, rtol=2e-3)
    assert not b.raw.is_pinned()
    assert not [w for w in recwarn.list if "pin" in str(w.message).lower()]  # clean fallback, no warnings


def test_batches_are_owned_by_the_trainer(service):
    """A batch kept across steps is never overwritten by later batches (no hidden ring on CPU)."""
    with RemoteLoader(service.endpoint, batch_size=8, image_size=32, prefetch=2) as ld:
        kept = []
        for b in ld:
            kept.append((b, b.raw.clone()))
        assert all(torch.equal(b.raw, copy) for b, copy in kept)


def test_batches_outlive_the_loader_and_are_writable(service):
    """The CPU images tensor wraps the received zmq message: it must stay valid (and writable,
    for in-place ops in a training step) after the loader, its sockets and context are gone."""
    with RemoteLoader(service.endpoint, batch_size=8, image_size=32, epoch_lookahead=False) as ld:
        batches = list(ld)
        copies = [b.raw.clone() for b in batches]
    assert all(torch.equal(b.raw, c) for b, c in zip(batches, copies))
    b = batches[0]
    b.raw[0] = 7  # in place, as a training step's augmentation might
    assert int(b.raw[0].min()) == int(b.raw[0].max()) == 7
    assert b.labels.dtype == torch.int64 and b.labels.is_contiguous()


def test_malformed_batch_from_a_service_is_a_clear_error():
    """A peer that answers with a Batch whose frames do not match its header: LoaderError, no hang."""
    import threading

    import zmq

    from wire import protocol as P

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def fake_service():
        while True:
            frames = router.recv_multipart()
            ident, (msg, _) = frames[0], P.decode(frames[1:])
            if isinstance(msg, P.Describe):
                router.send_multipart([ident, *P.encode(P.DatasetInfo(dataset="x", length=8, num_classes=1))])
            elif isinstance(msg, P.Hello):
                router.send_multipart([ident, *P.encode(P.Accept(stream=msg.stream, epoch=0, num_batches=2,
                                                                 num_samples=8, dataset_length=8, dataset="x"))])
                header = P.encode_header(P.Batch(stream=msg.stream, epoch=0, index=0, indices=[0, 1, 2, 3],
                                                 shape=[4, 8, 8, 3]))
                router.send_multipart([ident, header, b"\0" * 100, b"\0" * 32])  # 100 != 4*8*8*3 bytes
                return

    t = threading.Thread(target=fake_service, daemon=True)
    t.start()
    try:
        with RemoteLoader(f"tcp://127.0.0.1:{port}", batch_size=4, image_size=8, timeout=30) as ld:
            with pytest.raises(LoaderError, match=r"malformed batch from the service: Batch frames are \[100, 32\]"):
                next(iter(ld))
    finally:
        t.join()
        router.close()
        ctx.term()


def test_echo_yields_each_batch_k_times(service):
    with RemoteLoader(service.endpoint, batch_size=16, image_size=32, echo=3) as ld:
        assert len(ld) == 3 * DEMO_SIZE // 16
        batches = list(ld)
    assert len(batches) == 3 * DEMO_SIZE // 16
    for i in range(0, len(batches), 3):
        assert batches[i] is batches[i + 1] is batches[i + 2]
    assert sorted(i for b in batches[::3] for i in b.indices) == list(range(DEMO_SIZE))


def test_stats_count_batches_samples_bytes_and_stall(service):
    with RemoteLoader(service.endpoint, batch_size=16, image_size=32) as ld:
        list(ld)
        s = ld.stats()
    assert s["batches"] == DEMO_SIZE // 16 and s["samples"] == DEMO_SIZE
    assert s["bytes"] == DEMO_SIZE * 32 * 32 * 3
    assert s["wait_s"] > 0 and s["h2d_s"] == 0.0 and s["restarts"] == 0


def test_stall_reaches_the_service(service):
    from testkit.helpers import status

    with RemoteLoader(service.endpoint, batch_size=16, image_size=32, prefetch=2) as ld:
        list(ld)
    assert status(service)["stage_s"]["client_wait"] > 0


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(LoaderError, match="CUDA is not available in this torch build"):
        RemoteLoader("tcp://127.0.0.1:9", batch_size=4, device="cuda")


@pytest.mark.parametrize("kwargs, field", [
    (dict(batch_size=0), "batch_size"), (dict(rank=2, world_size=2), "rank"), (dict(prefetch=0), "prefetch"),
    (dict(dtype="int8"), "dtype"), (dict(echo=0), "echo"), (dict(endpoint="localhost:5555"), "endpoint"),
])
def test_loader_config_validation_names_the_field(kwargs, field):
    args = dict(endpoint="tcp://127.0.0.1:9", batch_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        LoaderConfig.of(**args)


def test_closed_loader_refuses_to_iterate(service):
    ld = RemoteLoader(service.endpoint, batch_size=8, image_size=32)
    ld.close()
    ld.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        iter(ld)


# ---------------------------------------------------------------------------------------- iter(), DataLoader-style

KW = dict(batch_size=16, image_size=32, seed=3, epoch_lookahead=False)


def test_a_new_iter_ends_the_previous_pass_and_starts_the_epoch_again(service):
    """As a DataLoader: a framework that leaves a pass after its batch limit (Lightning's sanity
    check, limit_val_batches) iterates the loader again. The new pass is the whole epoch from its
    first batch; the old iterator is ended, and using it says so instead of ending silently."""
    from testkit.helpers import status

    with RemoteLoader(service.endpoint, **KW) as ld:
        first = iter(ld)
        head = [list(next(first).indices) for _ in range(3)]
        second = iter(ld)  # no error: the first pass ends here
        with pytest.raises(RuntimeError, match="ended part-way by a later iter"):
            next(first)
        epoch = [list(b.indices) for b in second]
        third = iter(ld)  # a pass taken to its last batch and its StopIteration: the next epoch
        nxt = [list(b.indices) for b in third]
    assert epoch[:3] == head and sorted(i for b in epoch for i in b) == list(range(DEMO_SIZE))
    assert sorted(i for b in nxt for i in b) == list(range(DEMO_SIZE)) and nxt != epoch
    totals = status(service)["totals"]
    assert totals["refused_asks"] == totals["bad_messages"] == totals["internal_errors"] == 0


def test_a_pass_left_at_a_limit_comes_back_the_same_each_time(service):
    """A validation loader with limit_val_batches=2, three validations: the same two batches each
    time (the epoch is never finished, so it starts again), every pass from a fresh iter()."""
    with RemoteLoader(service.endpoint, **dict(KW, shuffle=False, train=False)) as ld:
        passes = []
        for _ in range(3):
            it = iter(ld)
            passes.append([list(next(it).indices) for _ in range(2)])  # `it` stays referenced, as a fetcher's does
    assert passes == [[list(range(16)), list(range(16, 32))]] * 3


def test_an_iterator_in_use_by_another_thread_is_refused_and_taken_over_once_that_thread_ends(service):
    import threading

    took, release, errors = threading.Event(), threading.Event(), []
    with RemoteLoader(service.endpoint, **KW) as ld:
        passes = []

        def consumer():
            it = iter(ld)
            passes.append(it)  # kept alive after this thread ends
            next(it)
            took.set()
            release.wait(60)

        t = threading.Thread(target=consumer, name="consumer-a")
        t.start()
        assert took.wait(60)
        with pytest.raises(RuntimeError, match=r"already has a live iterator, made in thread 'consumer-a'"):
            iter(ld)
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\) from thread .* cannot take it over"):
            ld.load_state_dict(ld.state_dict())
        release.set()
        t.join(60)
        assert not t.is_alive()
        epoch = [list(b.indices) for b in ld]  # its thread is gone: the pass is ended, not a live consumer
        with pytest.raises(RuntimeError, match="ended part-way"):
            next(passes[0])
    assert not errors and sorted(i for b in epoch for i in b) == list(range(DEMO_SIZE))


def test_load_state_dict_in_the_consumers_thread_ends_its_pass_and_resumes(service):
    with RemoteLoader(service.endpoint, **KW) as ld:
        full = [list(b.indices) for b in ld]
        ld.set_epoch(0)
        it = iter(ld)
        next(it)
        ld.load_state_dict(dict(ld.state_dict(), position=5 * 16))
        rest = [list(b.indices) for b in ld]
    assert rest == full[5:]


def test_a_message_a_poll_saw_that_is_gone_by_the_read_is_read_as_nothing(service, monkeypatch):
    """A poll (or a replica's wait) that saw a message which is gone when it is read (the read never
    blocks): the describe, the lookahead's adoption and an epoch's wait each read nothing and go on,
    instead of ending the loader with a raw ``zmq.Again``. Each set's first read is made to find
    nothing; two epochs are still served exactly once."""
    import zmq

    from client.connections import Connections

    real, missed = Connections.recv, []

    def recv(self, r, sink):
        if self not in missed:
            missed.append(self)
            raise zmq.Again()
        return real(self, r, sink)

    monkeypatch.setattr(Connections, "recv", recv)
    with RemoteLoader(service.endpoint, batch_size=8, image_size=32, seed=3) as ld:
        for epoch in range(2):
            ld.set_epoch(epoch)
            assert sorted(i for b in ld for i in b.indices) == list(range(DEMO_SIZE))
    assert len(missed) == 2  # the loader's set (its describe) and the lookahead's spare (its adoption)
