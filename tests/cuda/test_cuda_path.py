"""The GPU path: pinned ring, side-stream copies, hand-over, normalize on the GPU. Skipped without CUDA.

The ``test_race_*`` tests each fail when one of CudaSink's guarantees is removed (the mutant
runs in tests/cuda/run_mutants.py check that they do): a side stream made to lag behind the
CPU catches a slot reused early or a read not ordered after its copy; a compute stream made to
lag behind the CPU catches memory handed back to the allocator early.
"""

import time

import numpy as np
import pytest
import torch

from client import RemoteLoader
from client.config import IMAGENET_MEAN, IMAGENET_STD

from tests.conftest import DEMO_SIZE
from tests.cuda.conftest import gpu_sleep

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")]

KW = dict(batch_size=16, image_size=64, seed=3)
BATCHES = DEMO_SIZE // 16


def checksum(b) -> torch.Tensor:
    """Queued on the current stream; position-weighted, so a shuffled or shifted batch differs too."""
    raw = b.raw.reshape(-1).to(torch.int64)
    weights = torch.arange(1, raw.numel() + 1, device=raw.device, dtype=torch.int64) % 251
    return torch.stack([(raw * weights).sum(), b.labels.to(torch.int64).sum()])


def cpu_reference(endpoint, **kw) -> list:
    with RemoteLoader(endpoint, **{**KW, **kw}) as cpu:
        return [tuple(int(v) for v in checksum(b)) for b in cpu]


def as_ints(sums) -> list:
    torch.cuda.synchronize()
    return [tuple(int(v) for v in s.cpu()) for s in sums]


# ---------------------------------------------------------------------------------------- races
def test_race_side_stream_lags_and_the_trainer_reads_at_once(service, delayed_side_stream):
    """Copies queued behind GPU sleeps while the CPU receives on and the trainer reads each batch
    at once. Without the ring wait the CPU rewrites an entry of the pinned ring before its copy ran; without
    the stream wait the trainer's kernel reads device memory before the copy wrote it."""
    expected = cpu_reference(service.endpoint)
    with RemoteLoader(service.endpoint, **KW, device="cuda", device_prefetch=2, prefetch=8) as gpu:
        sums = [checksum(b) for b in gpu]  # no sleep on the consumer: each read is queued at once
    assert as_ints(sums) == expected


def test_race_each_batch_is_ordered_on_the_stream_current_at_next(service, delayed_side_stream):
    """The wait lands on the stream current when next() returns the batch: alternate two
    streams, read on each at once. A wait issued when the batch was received (under the other
    stream) would leave this read unordered."""
    expected = cpu_reference(service.endpoint)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    sums = []
    with RemoteLoader(service.endpoint, **KW, device="cuda", prefetch=8) as gpu:
        it = iter(gpu)
        for k in range(BATCHES):
            with torch.cuda.stream(streams[k % 2]):
                sums.append(checksum(next(it)))
        with pytest.raises(StopIteration):
            next(it)
    assert as_ints(sums) == expected


def test_race_slow_compute_stream_never_sees_a_batch_change_under_it(service):
    """Long kernels on the compute stream while batches keep arriving: each batch's checksum,
    computed *after* a long kernel on the consumer stream, must equal the CPU reference. If the
    allocator's memory were reused early (no record_stream), late checksums would differ."""
    expected = cpu_reference(service.endpoint)
    sums = []
    with RemoteLoader(service.endpoint, **KW, device="cuda", device_prefetch=2, prefetch=8) as gpu:
        for b in gpu:
            gpu_sleep(50, torch.cuda.current_stream())  # GPU time before we read the batch
            sums.append(checksum(b))  # queued after the sleep
            del b  # the trainer drops the batch; only record_stream keeps its memory safe
    assert as_ints(sums) == expected


def test_race_echo_hands_each_repeat_over_again(service, delayed_side_stream):
    """echo=2: each repeat is handed over on the stream current at that repeat."""
    expected = cpu_reference(service.endpoint)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    got, sums = [], []
    with RemoteLoader(service.endpoint, **KW, device="cuda", echo=2) as gpu:
        it = iter(gpu)
        for k in range(2 * BATCHES):
            with torch.cuda.stream(streams[k % 2]):
                b = next(it)
                got.append(b)
                sums.append(checksum(b))
    assert all(got[i] is got[i + 1] for i in range(0, len(got), 2))
    assert as_ints(sums) == [s for s in expected for _ in range(2)]


def test_race_several_replicas_reorder_before_the_hand_over(make_service, delayed_side_stream):
    a, b = make_service(), make_service()
    expected = cpu_reference(a.endpoint)
    with RemoteLoader([a.endpoint, b.endpoint], **KW, device="cuda", prefetch=4) as gpu:
        batches = [(bt.index, checksum(bt)) for bt in gpu]
    assert [i for i, _ in batches] == list(range(BATCHES))
    assert as_ints([s for _, s in batches]) == expected


# ------------------------------------------------------------------------------ values, devices
def test_gpu_batches_equal_cpu_batches_byte_for_byte_over_an_epoch(service):
    with RemoteLoader(service.endpoint, **KW, normalize=True) as cpu, \
         RemoteLoader(service.endpoint, **KW, normalize=True, device="cuda") as gpu:
        cpu_batches = [(b.indices, b.raw.clone(), b.images.clone(), b.labels.clone()) for b in cpu]
        gpu_batches = [(b.indices, b.raw.cpu(), b.images.cpu(), b.labels.cpu()) for b in gpu]
    assert len(cpu_batches) == len(gpu_batches) == BATCHES
    for (ci, craw, cimg, clab), (gi, graw, gimg, glab) in zip(cpu_batches, gpu_batches):
        assert ci == gi
        assert torch.equal(craw, graw)
        assert torch.equal(clab, glab)
        assert torch.allclose(cimg, gimg, atol=1e-5, rtol=0)  # same float32 math on both devices
    assert gpu_batches[0][2].is_contiguous(memory_format=torch.channels_last)


def test_race_co_located_copy_reads_the_service_s_slot_before_it_goes_back(service, delayed_side_stream):
    """Issue 41: the copy engine reads each lent batch straight from the service's slot
    (page-locked in place), and the side stream lags far behind. A slot handed back as soon as
    its copy is issued (the copy_read mutant) is rewritten by the service (4 slots, 15 batches)
    before the copy reads it: wrong bytes."""
    expected = cpu_reference(service.endpoint)
    with RemoteLoader(service.endpoint, **KW, device="cuda", local=True, prefetch=2, device_prefetch=2) as gpu:
        sums = [checksum(b) for b in gpu]  # read at once: nothing waits for the copies but the GPU
        lent = gpu._sink.lent
    assert as_ints(sums) == expected
    assert lent > 0  # lent (3 at most at once: one more is copied into the ring and handed back at once)
    assert not any(_until_nothing_borrowed(service))  # every slot came back


@pytest.mark.parametrize("register", [True, False], ids=["read-in-place", "copied-into-the-ring"])
def test_co_located_gpu_epochs_equal_the_socket_s_byte_for_byte(service, delayed_side_stream, monkeypatch, register):
    """Issue 41: three epochs, the side stream lagging, each batch read by the GPU from the
    service's slot, or (no cudaHostRegister) copied into the pinned ring and handed back at once:
    the same bytes as over the socket, each sample once per epoch, every slot back at the end."""
    from client.sinks import CudaSink

    monkeypatch.setattr(CudaSink, "register", register)
    with RemoteLoader(service.endpoint, **KW) as cpu, \
         RemoteLoader(service.endpoint, **KW, device="cuda", local=True) as gpu:
        _epochs_equal(cpu, gpu, 3)
        lent = gpu._sink.lent
    assert (lent > 0) is register and lent <= 3 * BATCHES
    assert not any(_until_nothing_borrowed(service))


def _epochs_equal(cpu, gpu, epochs: int) -> None:
    """``epochs`` epochs of a GPU loader: the CPU loader's bytes, every batch in order, each sample once."""
    for epoch in range(epochs):
        cpu.set_epoch(epoch)
        gpu.set_epoch(epoch)
        expected = [tuple(int(v) for v in checksum(b)) for b in cpu]
        batches = [(bt.index, bt.indices, checksum(bt)) for bt in gpu]
        assert [i for i, *_ in batches] == list(range(BATCHES))
        assert sorted(x for _, idx, _ in batches for x in idx) == list(range(DEMO_SIZE))
        assert as_ints([s for *_, s in batches]) == expected


def _until_nothing_borrowed(service, deadline_s: float = 30.0) -> list:
    """The slots the service's streams still lend, once it has read the loader's Bye (which takes
    them all back; waited for, bounded: it travels through the socket)."""
    d = service.dispatcher

    def borrowed():
        return d.call(lambda: [dict(s.borrowed) for s in d.state.sessions.streams()]
                      + [dict(s.borrowed) for s in d.state.memory.retiring]).result(10)

    end = time.monotonic() + deadline_s
    while any(borrowed()) and time.monotonic() < end:
        time.sleep(0.02)
    return borrowed()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_normalize_on_gpu_matches_the_cpu_path(service, dtype):
    with RemoteLoader(service.endpoint, **KW, normalize=True, dtype=dtype) as cpu, \
         RemoteLoader(service.endpoint, **KW, normalize=True, dtype=dtype, device="cuda") as gpu:
        pairs = [(c.images.clone(), g.images) for c, g in zip(cpu, gpu)]
    assert len(pairs) == BATCHES
    for c, g in pairs:
        assert g.dtype == getattr(torch, dtype) and g.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(g.cpu(), c)  # float32 math on both, one rounding to the half type


def test_normalize_on_gpu_matches_float64_reference(service):
    with RemoteLoader(service.endpoint, **KW, device="cuda", normalize=True, dtype="bfloat16") as gpu:
        b = next(iter(gpu))
    raw = b.raw.cpu().numpy().astype(np.float64).transpose(0, 3, 1, 2)
    ref = (raw - np.array(IMAGENET_MEAN).reshape(1, 3, 1, 1)) / np.array(IMAGENET_STD).reshape(1, 3, 1, 1)
    assert b.images.dtype == torch.bfloat16 and b.images.device.type == "cuda"
    assert np.allclose(b.images.float().cpu().numpy(), ref, atol=3e-2, rtol=1e-2)


def test_bare_cuda_is_the_device_current_at_construction(service):
    last = torch.cuda.device_count() - 1
    expected = cpu_reference(service.endpoint)
    with torch.cuda.device(last):
        gpu = RemoteLoader(service.endpoint, **KW, device="cuda")
    with gpu, torch.cuda.device(0):  # the trainer makes another device current later
        assert gpu.config.device == f"cuda:{last}"
        assert gpu._sink.stream.device == torch.device("cuda", last)
        batches = list(gpu)
        assert {b.raw.device for b in batches} == {torch.device("cuda", last)}
        with torch.cuda.device(last):
            sums = [checksum(b) for b in batches]
    assert as_ints(sums) == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_explicit_second_device_while_the_first_is_current(service, delayed_side_stream):
    expected = cpu_reference(service.endpoint, normalize=True)
    torch.cuda.set_device(0)
    with RemoteLoader(service.endpoint, **KW, device="cuda:1", normalize=True) as gpu:
        assert gpu._sink.stream.device == torch.device("cuda", 1)
        sums = []
        for b in gpu:
            assert b.images.device == b.raw.device == b.labels.device == torch.device("cuda", 1)
            with torch.cuda.device(1):  # read on device 1's current stream, the one it was handed to
                sums.append(checksum(b))
    assert as_ints(sums) == expected


# ------------------------------------------------------------------------------ memory, shutdown
def test_gpu_and_pinned_memory_stay_flat_over_epochs(service):
    with RemoteLoader(service.endpoint, **KW, device="cuda", normalize=True) as gpu:
        allocated = []
        for epoch in range(4):
            gpu.set_epoch(epoch)
            for b in gpu:
                _ = b.images.float().mean()
            torch.cuda.synchronize()
            host = torch.cuda.host_memory_stats()
            # key names from torch/cuda/memory.py (torch 2.13): "allocated_bytes.{current,peak,...}"
            assert "allocated_bytes.current" in host, sorted(host)
            allocated.append((torch.cuda.memory_allocated(), host["allocated_bytes.current"]))
    assert allocated[0][1] >= 3 * 16 * 64 * 64 * 3  # the ring's slots are counted: the key is live
    assert allocated[1:] == allocated[1:2] * 3, allocated


def test_breaking_out_and_closing_never_hangs(service):
    t0 = time.monotonic()
    for _ in range(3):
        with RemoteLoader(service.endpoint, **KW, device="cuda") as gpu:
            it = iter(gpu)
            next(it)
            next(it)
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------ several outputs
def test_every_output_of_a_pipeline_is_copied_and_normalized_as_on_the_cpu(make_service):
    """Each output gets its own pinned buffer and copy; normalize applies to the outputs named."""
    svc = make_service(pipeline=("two=testkit.pipeline_doubles:two_views",))
    kw = dict(batch_size=16, seed=3, pipeline="two", pipeline_args={"size": 32}, normalize=["big"])
    with RemoteLoader(svc.endpoint, **kw) as cpu:
        want = [{k: v.clone() for k, v in {**b.outputs, "labels": b.labels}.items()} for b in cpu]
    with RemoteLoader(svc.endpoint, **kw, device="cuda", prefetch=8) as gpu:
        got = [{k: v.cpu() for k, v in {**b.outputs, "labels": b.labels}.items()} for b in gpu]
    assert len(got) == len(want) == BATCHES
    for g, w in zip(got, want):
        assert g["big"].dtype == torch.float32 and g["small"].dtype == torch.uint8
        assert torch.allclose(g["big"], w["big"], atol=1e-4)
        assert all(torch.equal(g[k], w[k]) for k in ("small", "stamp", "labels"))


@pytest.mark.parametrize("pinned", [True, False], ids=["read-in-place", "copied-into-the-ring"])
def test_gpu_epochs_over_bulk_lanes_equal_the_cpu_s_byte_for_byte(make_service, delayed_side_stream, monkeypatch,
                                                                   pinned):
    """Issue 41: each batch's bytes on two bulk lanes, read by the copy engine from the lanes'
    page-locked buffer, or (where page-locking fails) copied from it into the pinned ring, while
    the side stream lags: the same bytes as a CPU loader's over data frames, each sample once per
    epoch, and the lanes really carried them."""
    import client.buffers

    if not pinned:
        monkeypatch.setattr(client.buffers, "torch", _NoPageLocking)
    service = make_service(lane_port=0)
    with RemoteLoader(service.endpoint, **KW) as cpu, \
         RemoteLoader(service.endpoint, **KW, device="cuda", lanes=2) as gpu:
        _epochs_equal(cpu, gpu, 2)
        assert all(r.lanes is not None and not r.lanes.failed and r.lanes.pinned is pinned
                   for r in gpu._conns.replicas)
        assert gpu._sink.lanes_in_place == (2 * BATCHES if pinned else 0)


class _NoPageLocking:
    """Stands in for torch in client.buffers: page-locking fails, as on a build without CUDA."""

    uint8 = torch.uint8

    @staticmethod
    def empty(*args, **kwargs):
        raise RuntimeError("cannot page-lock here (the test's stand-in)")


def test_race_lanes_buffer_is_received_into_again_only_after_its_copy_ran(make_service, delayed_side_stream):
    """Issue 41: the copy engine reads each batch from the lanes' page-locked buffer, and the side
    stream lags far behind while the lanes receive on. A buffer the lanes may receive into as soon
    as its copy is issued (the copy_read mutant) is overwritten by a later batch before the copy
    reads it: wrong bytes."""
    service = make_service(lane_port=0)
    expected = cpu_reference(service.endpoint)
    with RemoteLoader(service.endpoint, **KW, device="cuda", lanes=2, prefetch=2, device_prefetch=2) as gpu:
        sums = [checksum(b) for b in gpu]  # read at once: nothing waits for the copies but the GPU
        in_place = gpu._sink.lanes_in_place
    assert as_ints(sums) == expected
    assert in_place == BATCHES


def test_a_dropped_late_batch_gives_its_ring_entry_back():
    """A batch received and never pushed (a late copy from a replica whose batches went to the
    others): its pinned-ring entry is free again at once, not only at the epoch's end, so the
    window's batches always find one."""
    from client.config import LoaderConfig
    from client.sinks import CudaSink

    sink = CudaSink(LoaderConfig.of("tcp://127.0.0.1:9", batch_size=4, image_size=8, device="cuda:0"), held=2)
    try:
        free = len(sink._free)
        entry = sink._take_pinned()
        sink.drop((entry, [], entry.labels[:0], False))
        assert len(sink._free) == free and sink._free[0] is entry
    finally:
        sink.close()
