"""Sink logic that needs no GPU: device resolution (with a faked torch.cuda), the point where a
batch is handed over to the trainer (at next(), once per echo repeat, in plan order across
replicas), and CudaSink's hand-over bookkeeping with its stream operations recorded."""

from __future__ import annotations

import pytest
import torch

from client import LoaderError, RemoteLoader
from client.batch import Batch
from client.config import LoaderConfig, resolve_device
from client.sinks import CudaSink, HostSink

from tests.conftest import DEMO_SIZE


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda reporting two devices, device 1 current."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.mark.parametrize("given, resolved", [("cpu", "cpu"), ("cuda", "cuda:1"), ("cuda:0", "cuda:0"),
                                             ("cuda:1", "cuda:1")])
def test_device_resolves_to_an_explicit_index_at_construction(fake_cuda, given, resolved):
    assert resolve_device(given) == resolved
    assert LoaderConfig.of("tcp://127.0.0.1:9", batch_size=4, device=given).device == resolved


def test_a_device_index_beyond_the_machine_is_refused_with_the_count(fake_cuda):
    with pytest.raises(LoaderError, match=r"has 2 CUDA device\(s\): use cuda:0..cuda:1"):
        LoaderConfig.of("tcp://127.0.0.1:9", batch_size=4, device="cuda:2")


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "CUDA", " cuda", ""])
def test_malformed_device_names_the_field(bad):
    with pytest.raises(ValueError, match="invalid device"):
        LoaderConfig.of("tcp://127.0.0.1:9", batch_size=4, device=bad)


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LoaderError, match="CUDA is not available in this torch build"):
        resolve_device("cuda:0")


class RecordingSink(HostSink):
    """A host sink that logs when batches are pushed and handed over."""

    log: list = []

    def push(self, msg, payload):
        RecordingSink.log.append(("push", msg.index))
        return super().push(msg, payload)

    def hand_over(self, batch):
        RecordingSink.log.append(("hand_over", batch.index))
        return super().hand_over(batch)


@pytest.fixture
def recording(monkeypatch):
    import client.loader

    RecordingSink.log = []
    monkeypatch.setattr(client.loader, "make_sink", RecordingSink)
    return RecordingSink.log


@pytest.mark.parametrize("echo, replicas", [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_each_batch_is_handed_over_as_next_returns_it(make_service, recording, echo, replicas):
    """hand_over(k) runs inside the next() that returns k (after the trainer had k-1), once per
    echo repeat (a batch is pushed once), in plan order whichever replica delivered it."""
    endpoints = [make_service().endpoint for _ in range(replicas)]
    with RemoteLoader(endpoints, batch_size=16, image_size=32, echo=echo, prefetch=4) as ld:
        for b in ld:
            recording.append(("trainer", b.index))
    n = DEMO_SIZE // 16
    handed = [e for e in recording if e[0] != "push"]
    assert handed == [(what, k) for k in range(n) for _ in range(echo) for what in ("hand_over", "trainer")]
    pushes = [k for what, k in recording if what == "push"]
    assert pushes == list(range(n))  # reordered on the host: the device copies run in plan order


class FakeEvent:
    def __init__(self, name):
        self.name = name


def _bare_cuda_sink(calls: list, monkeypatch) -> CudaSink:
    """A CudaSink without a GPU: only the hand-over's state, its stream operations recorded."""
    sink = CudaSink.__new__(CudaSink)
    sink.device = torch.device("cuda", 1)
    sink._done, sink._handed = {}, None
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"current stream of {device}")
    sink._order_after_copy = lambda stream, done: calls.append(("wait", stream, done.name))
    sink._keep_alive = lambda tensors, stream: calls.append(("keep", len(list(tensors)), stream))
    return sink


def _batch(index: int, normalized: bool) -> Batch:
    raw = torch.zeros(2, 4, 4, 3, dtype=torch.uint8)
    images = raw.permute(0, 3, 1, 2).float() if normalized else raw
    return Batch(images, torch.zeros(2, dtype=torch.int64), [0, 1], 0, index, raw)


def test_cuda_hand_over_waits_on_its_own_event_on_the_loaders_device(monkeypatch):
    calls: list = []
    sink = _bare_cuda_sink(calls, monkeypatch)
    sink._done = {3: FakeEvent("done3"), 4: FakeEvent("done4")}
    b3, b4 = _batch(3, normalized=False), _batch(4, normalized=True)
    assert sink.hand_over(b3) is b3
    assert sink.hand_over(b3) is b3  # echo: the same event again
    assert sink.hand_over(b4) is b4
    stream = "current stream of cuda:1"
    assert calls == [("wait", stream, "done3"), ("keep", 2, stream),  # images is raw: 2 tensors
                     ("wait", stream, "done3"), ("keep", 2, stream),
                     ("wait", stream, "done4"), ("keep", 3, stream)]
    assert sink._done == {}  # events are dropped once handed over: nothing grows over an epoch


def test_cuda_hand_over_of_a_batch_never_pushed_is_loud(monkeypatch):
    sink = _bare_cuda_sink([], monkeypatch)
    sink._done = {3: FakeEvent("done3")}
    sink.hand_over(_batch(3, normalized=False))
    with pytest.raises(LoaderError, match="batch 5 handed over but never pushed"):
        sink.hand_over(_batch(5, normalized=False))


# ------------------------------------------------------------------ outputs in several frames
def _chunked_pair(monkeypatch):
    """A Batch of 3 samples of 64x64x3 sent in frames of 16 KiB (a cap lowered for the test)."""
    import numpy as np
    import zmq
    from wire import protocol as P

    monkeypatch.setattr(P, "ZERO_COPY_MIN_BYTES", 1024)
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://chunked-sink-test")
    b.connect("inproc://chunked-sink-test")
    chunk = 16 << 10
    msg = P.Batch(stream=1, epoch=0, index=0, indices=[7, 8, 9], shape=[3, 64, 64, 3], chunk=chunk)
    images = np.random.default_rng(0).integers(0, 256, 3 * 64 * 64 * 3, dtype=np.uint8)
    sizes = P.frame_sizes(images.nbytes, chunk)
    assert len(sizes) == 3  # 16 + 16 + 4 KiB

    def send(k: int) -> None:
        frames, at = [], 0
        for n in sizes:
            frames.append(images[at:at + n].tobytes())
            at += n
        a.send_multipart([P.encode_header(msg), *frames, np.array([k, k, k], np.int64).tobytes()])
        b.recv()  # the header, as Connections.recv reads it

    return a, b, msg, images, send


def test_the_host_sink_gathers_an_output_sent_in_frames_and_reuses_its_buffer_once_let_go(monkeypatch):
    a, b, msg, images, send = _chunked_pair(monkeypatch)
    try:
        sink = HostSink(LoaderConfig.of("tcp://127.0.0.1:9", batch_size=3, image_size=64), held=1)
        send(1)
        (raw,), labels = sink.receive(b, msg)
        assert raw.shape == (3, 64, 64, 3) and bytes(raw.numpy().tobytes()) == images.tobytes()
        assert labels.tolist() == [1, 1, 1]
        first = raw.data_ptr()
        send(2)
        (held,), _ = sink.receive(b, msg)  # the trainer still holds the first batch: another buffer
        assert held.data_ptr() != first and held.numpy().tobytes() == images.tobytes()
        assert raw.numpy().tobytes() == images.tobytes()  # the held batch was not overwritten
        del raw
        send(3)
        (again,), _ = sink.receive(b, msg)  # the first batch was let go of: its buffer again
        assert again.data_ptr() == first and again.numpy().tobytes() == images.tobytes()
    finally:
        a.close(0)
        b.close(0)


def test_a_pinned_buffer_fills_from_an_output_sent_in_frames(monkeypatch):
    """CudaSink's receive path (_recv_frames) with host tensors: each frame lands at its offset."""
    from client.sinks import _recv_frames

    a, b, msg, images, send = _chunked_pair(monkeypatch)
    try:
        out, labels = torch.zeros(3, 64, 64, 3, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64)
        send(5)
        _recv_frames(b, msg, [out], labels)
        assert out.numpy().tobytes() == images.tobytes() and labels.tolist() == [5, 5, 5]
    finally:
        a.close(0)
        b.close(0)


def test_each_cuda_mutant_removes_a_method_of_the_sink_and_names_a_race_test_that_exists():
    """The mutant runs happen only on a GPU, which most sessions lack: a guarantee or a race test
    renamed without them is found here, not on the next GPU's time."""
    import ast
    import os

    from tests.cuda import run_mutants
    from tests.cuda.conftest import MUTANTS

    assert set(MUTANTS) == set(run_mutants.MUST_FAIL)
    for name, (method, _) in MUTANTS.items():
        assert callable(getattr(CudaSink, method, None)), (name, method)
    path = os.path.join(os.path.dirname(run_mutants.__file__), "test_cuda_path.py")
    with open(path) as f:
        tests = {n.name for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef)}
    assert set().union(*run_mutants.MUST_FAIL.values()) <= tests


def test_page_locked_host_buffers_fall_back_to_plain_ones_where_torch_cannot_page_lock(caplog):
    """Issue 41: a GPU loader's lanes receive into page-locked buffers. Where this torch cannot
    page-lock (the CPU build CI runs: pin_memory raises), the buffers are plain ones, ``pinned``
    turns False (the CUDA sink then copies into its ring) and it is said once; buffers are still
    reused once let go of. With CUDA the buffer is page-locked."""
    from client.buffers import HostBuffers

    buffers = HostBuffers(keep=2, pinned=True)
    with caplog.at_level("WARNING", logger="client"):
        first = buffers.take(1000)
        first[:] = 7
        second = buffers.take(1000)  # the first is still held: another buffer
        assert second.ctypes.data != first.ctypes.data and first.nbytes == second.nbytes == 1000
        del first
        again = buffers.take(1000)  # let go of: the same memory again
    assert (again == 7).all()
    if torch.cuda.is_available():
        assert buffers.pinned and torch.from_numpy(again).is_pinned()
        assert not caplog.records
    else:
        assert buffers.pinned is False
        assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["cannot page-lock host buffers"]
        assert "copied into the pinned ring instead" in caplog.records[0].getMessage()
