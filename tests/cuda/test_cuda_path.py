"""The GPU path: pinned ring, side-stream copies, normalize on the GPU. Skipped without CUDA."""

import time

import numpy as np
import pytest
import torch

from client import RemoteLoader
from client.config import IMAGENET_MEAN, IMAGENET_STD

from ..conftest import DEMO_SIZE

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")]

KW = dict(batch_size=16, image_size=64, seed=3)


def test_gpu_batches_equal_cpu_batches_byte_for_byte_over_an_epoch(service):
    with RemoteLoader(service.endpoint, **KW, normalize=True) as cpu, \
         RemoteLoader(service.endpoint, **KW, normalize=True, device="cuda") as gpu:
        cpu_batches = [(b.indices, b.raw.clone(), b.images.clone(), b.labels.clone()) for b in cpu]
        gpu_batches = [(b.indices, b.raw.cpu(), b.images.cpu(), b.labels.cpu()) for b in gpu]
    assert len(cpu_batches) == len(gpu_batches) == DEMO_SIZE // 16
    for (ci, craw, cimg, clab), (gi, graw, gimg, glab) in zip(cpu_batches, gpu_batches):
        assert ci == gi
        assert torch.equal(craw, graw)
        assert torch.equal(clab, glab)
        assert torch.allclose(cimg, gimg, atol=1e-5, rtol=0)  # same float32 math on both devices
    assert gpu_batches[0][2].is_contiguous(memory_format=torch.channels_last)


def test_slow_compute_stream_never_sees_a_batch_change_under_it(service):
    """Long kernels on the compute stream while batches keep arriving: each batch's checksum,
    computed *after* a long kernel on the consumer stream, must equal the CPU reference. If a
    pinned slot or the allocator's memory were reused early, late checksums would differ."""
    with RemoteLoader(service.endpoint, **KW) as cpu:
        expected = [int(b.raw.to(torch.int64).sum()) for b in cpu]
    sums = []
    with RemoteLoader(service.endpoint, **KW, device="cuda", device_prefetch=2, prefetch=8) as gpu:
        for b in gpu:
            torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before we read the batch
            sums.append(b.raw.to(torch.int64).sum())  # queued after the sleep
            del b  # the trainer drops the batch; only record_stream keeps its memory safe
    torch.cuda.synchronize()
    assert [int(s) for s in sums] == expected


def test_gpu_and_pinned_memory_stay_flat_over_epochs(service):
    with RemoteLoader(service.endpoint, **KW, device="cuda", normalize=True) as gpu:
        allocated = []
        for epoch in range(4):
            gpu.set_epoch(epoch)
            for b in gpu:
                _ = b.images.float().mean()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
            if hasattr(torch.cuda, "host_memory_stats"):
                allocated[-1] = (allocated[-1], torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0))
    assert allocated[1:] == allocated[1:2] * 3, allocated


def test_breaking_out_and_closing_never_hangs(service):
    t0 = time.monotonic()
    for _ in range(3):
        with RemoteLoader(service.endpoint, **KW, device="cuda") as gpu:
            it = iter(gpu)
            next(it)
            next(it)
    assert time.monotonic() - t0 < 60


def test_normalize_on_gpu_matches_float64_reference(service):
    with RemoteLoader(service.endpoint, **KW, device="cuda", normalize=True, dtype="bfloat16") as gpu:
        b = next(iter(gpu))
    raw = b.raw.cpu().numpy().astype(np.float64).transpose(0, 3, 1, 2)
    ref = (raw - np.array(IMAGENET_MEAN).reshape(1, 3, 1, 1)) / np.array(IMAGENET_STD).reshape(1, 3, 1, 1)
    assert b.images.dtype == torch.bfloat16 and b.images.device.type == "cuda"
    assert np.allclose(b.images.float().cpu().numpy(), ref, atol=3e-2, rtol=1e-2)
