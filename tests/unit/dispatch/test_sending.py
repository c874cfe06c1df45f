"""BatchLayout and the pure half of sending a batch: where each output lies in a slot, what the
Batch message says (skipped samples and padding left out), which blocks of the slot go out;
then the two steps that touch a slot (compacting after skips, zero-copy frames)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from wire import protocol as P
from wire.jobspec import JobSpec
from wire.plan import make_plan
from loader_service.decode.pipelines import JobPipeline, Pipeline, Registry, job_pipeline
from loader_service.dispatch import sending
from loader_service.dispatch.sending import BatchLayout
from loader_service.dispatch.stream_state import SendBatch
from loader_service.shm import Segment

TWO_VIEWS = {"big": (2, 16, 16, 3), "small": (8, 8), "stamp": (4,)}  # tests/pipeline_doubles.two_views' outputs


def _named(outputs=TWO_VIEWS) -> JobPipeline:
    return JobPipeline("views", "testkit.pipeline_doubles:two_views", {}, Pipeline(outputs, lambda item, out: None), True)


def test_a_named_pipeline_lays_its_outputs_out_one_block_after_another():
    layout = BatchLayout.of(_named(), capacity=5)
    assert [(o.name, o.shape, o.sample_bytes) for o in layout.outputs] == [
        ("big", (2, 16, 16, 3), 1536), ("small", (8, 8), 64), ("stamp", (4,), 4)]
    assert [o.offset for o in layout.outputs] == [0, 5 * 1536, 5 * (1536 + 64)]
    assert layout.slot_bytes == 5 * (1536 + 64 + 4)
    assert layout.shape(3) == [3]
    assert layout.wire_outputs() == [["big", [2, 16, 16, 3]], ["small", [8, 8]], ["stamp", [4]]]


def test_the_layout_is_the_one_the_workers_write_by():
    pipe = _named()
    assert [(o.name, o.shape, o.offset) for o in BatchLayout.of(pipe, 7).outputs] == pipe.pipeline.layout(7)


def test_a_job_naming_no_pipeline_keeps_the_original_wire_shape():
    pipe = job_pipeline(Registry(), JobSpec(batch_size=4, image_size=32))
    layout = BatchLayout.of(pipe, capacity=4)
    assert not layout.named and [o.name for o in layout.outputs] == ["image"]
    assert layout.slot_bytes == 4 * 32 * 32 * 3
    assert layout.shape(3) == [3, 32, 32, 3] and layout.wire_outputs() == []


def _plan(batch_size=4, length=22, world_size=1, rank=0):
    return make_plan(JobSpec(batch_size=batch_size, world_size=world_size, shuffle=False).plan(length, 0, rank))


def test_a_whole_batch_goes_out_from_its_slot():
    layout, plan = BatchLayout.of(_named(), 4), _plan()
    out = sending.outgoing(layout, plan, stream=3, epoch=1, e=SendBatch(batch=2, slot=1))
    m = out.message
    assert (m.stream, m.epoch, m.index, m.indices, m.shape, m.padding) == (3, 1, 2, [8, 9, 10, 11], [4], 0)
    assert m.skipped == []
    assert m.outputs == layout.wire_outputs() and out.keep is None and out.indices.tolist() == [8, 9, 10, 11]
    base = layout.slot_bytes
    assert out.blocks == [(base + o.offset, 4 * o.sample_bytes) for o in layout.outputs]


def test_skipped_samples_are_left_out_of_the_message_and_the_frames():
    layout, plan = BatchLayout.of(_named(), 4), _plan()
    e = SendBatch(batch=1, slot=0, skipped=((0, 4, "bad jpeg"), (2, 6, "hung")), compact=True)
    out = sending.outgoing(layout, plan, stream=1, epoch=0, e=e)
    assert out.message.indices == [5, 7] and out.message.skipped == [[4, "bad jpeg"], [6, "hung"]]
    assert out.keep.tolist() == [False, True, False, True]
    assert [size for _, size in out.blocks] == [2 * o.sample_bytes for o in layout.outputs]
    assert out.message.shape == [2]


def test_padding_counts_only_the_samples_sent():
    plan = _plan(batch_size=4, length=7, world_size=2, rank=1)  # rank 1 of 2 over 7: its 4th sample repeats one
    assert plan.batch_padding(0).tolist() == [False, False, False, True]
    layout = BatchLayout.of(job_pipeline(Registry(), JobSpec(batch_size=4, image_size=8)), 4)
    assert sending.outgoing(layout, plan, 1, 0, SendBatch(0, 0)).message.padding == 1
    skipped = sending.outgoing(layout, plan, 1, 0, SendBatch(0, 0, skipped=((3, int(plan.batch(0)[3]), "x"),)))
    assert skipped.message.padding == 0 and skipped.message.shape == [3, 8, 8, 3]


def test_compacting_moves_the_kept_samples_to_the_front_of_every_block():
    layout = BatchLayout.of(_named({"a": (3,), "b": (2,)}), capacity=4)
    seg = Segment.create(2 * layout.slot_bytes, tag="test")
    try:
        for o in layout.outputs:
            block = seg.array(np.uint8, (4, o.sample_bytes), layout.slot_bytes + o.offset)  # slot 1
            block[:] = np.arange(4, dtype=np.uint8)[:, None] + 10 * (o.name == "b")
            del block
        sending.compact(seg, layout, 1, np.array([False, True, False, True]))
        for o in layout.outputs:
            block = seg.array(np.uint8, (4, o.sample_bytes), layout.slot_bytes + o.offset)
            assert block[:2, 0].tolist() == [1 + 10 * (o.name == "b"), 3 + 10 * (o.name == "b")]
            del block
        assert not seg.array(np.uint8, (layout.slot_bytes,), 0).any()  # slot 0 untouched
    finally:
        seg.close()


def test_a_small_block_is_copied_and_a_large_one_is_sent_from_the_slot():
    seg = Segment.create(2 * P.ZERO_COPY_MIN_BYTES, tag="test")
    try:
        seg.array(np.uint8, (16,), 0)[:] = 7
        small, zero_copy = sending.frame(seg, 0, 16, lambda: pytest.fail("a copied frame reports nothing"))
        assert small == bytes([7] * 16) and not zero_copy
        done = threading.Event()
        big, zero_copy = sending.frame(seg, 0, P.ZERO_COPY_MIN_BYTES, done.set)
        assert zero_copy and bytes(big.buffer[:16]) == bytes([7] * 16)
        assert not done.is_set()  # libzmq may still read the slot
        del big
        assert done.wait(10), "the send was never reported complete"
    finally:
        seg.close()


def test_an_output_above_the_frame_cap_goes_in_frames_that_tile_its_block(monkeypatch):
    monkeypatch.setattr(P, "FRAME_MAX_BYTES", 1000)
    layout, plan = BatchLayout.of(_named(), 4), _plan()
    out = sending.outgoing(layout, plan, stream=3, epoch=1, e=SendBatch(batch=0, slot=1))
    base, (big, small, stamp) = layout.slot_bytes, layout.outputs
    assert out.message.chunk == 1000 and big.sample_bytes * 4 == 6144
    assert out.blocks == [(base + big.offset + k * 1000, 1000) for k in range(6)] + [
        (base + big.offset + 6000, 144), (base + small.offset, 256), (base + stamp.offset, 16)]
    assert out.message.data_frames() == len(out.blocks) + 1  # and the labels


def test_outputs_within_the_frame_cap_go_one_frame_each():
    out = sending.outgoing(BatchLayout.of(_named(), 4), _plan(), stream=3, epoch=1, e=SendBatch(batch=0, slot=0))
    assert out.message.chunk == 0 and len(out.blocks) == 3
