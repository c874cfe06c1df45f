"""Shared-memory segments: a mapped segment holds no file descriptor (issue 32: 10,000 streams
took 10,000 descriptors besides their connections), and is unmapped only once no view is left."""

from __future__ import annotations

import os

import numpy as np
import pytest

from loader_service.shm import SHM_DIR, Segment


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_mapped_segments_hold_no_descriptor():
    before = _open_fds()
    segments = [Segment.create(4096, tag="fdtest") for _ in range(200)]
    attached = [Segment.attach(s.name) for s in segments[:50]]
    try:
        assert _open_fds() == before
    finally:
        for s in attached + segments:
            s.close()


def test_what_the_creator_writes_the_attacher_reads_and_a_read_only_attach_cannot_write():
    seg = Segment.create(4096, tag="rw")
    try:
        seg.array(np.uint8, (16,), 100)[:] = np.arange(16, dtype=np.uint8)
        ro = Segment.attach(seg.name, readonly=True)
        assert bytes(ro.buf[100:116]) == bytes(range(16))
        with pytest.raises(TypeError, match="read-only"):
            ro.buf[0] = 1
        ro.close()
    finally:
        seg.close()


@pytest.mark.parametrize("view", ["array", "slice"])
def test_a_segment_is_not_unmapped_while_a_view_of_it_is_in_use(view):
    seg = Segment.create(4096, tag="views")
    held = seg.array(np.uint8, (8,), 0) if view == "array" else seg.buf[8:16]
    with pytest.raises(BufferError, match="in use"):
        seg.close()
    held[0] = 5  # still mapped: no crash
    del held
    seg.close()  # now it goes, and a second close is a no-op
    seg.close()
    assert not os.path.exists(os.path.join(SHM_DIR, seg.name))
