"""The co-located client's batches held in place (client/local.py), on a real segment file."""

import gc
import mmap
import os

import numpy as np
import pytest
import torch

from client import local
from client.errors import LoaderError


@pytest.fixture
def segment():
    """A segment file the way the service makes one (its name prefix, in /dev/shm), 3 pages + 100 bytes."""
    name = f"{local.PREFIX}test-{os.getpid()}"
    path = os.path.join(local.SHM_DIR, name)
    size = 3 * mmap.PAGESIZE + 100
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * (size // 256) + bytes(size % 256))
    try:
        yield name, path, size
    finally:
        os.unlink(path)


def _rewrite(path, size, value):
    with open(path, "r+b") as f:
        f.write(bytes([value]) * size)


def test_a_batch_is_lent_as_views_and_queued_for_release_when_its_last_view_goes(segment):
    name, path, size = segment
    maps, borrowed = local.Mappings(writable=True), local.Borrowed(limit=2)
    m = maps.mapping(name)
    views = borrowed.lend(7, 3, name, m, [[10, 100], [200, 50]])
    a, b = (torch.from_numpy(v) for v in views)
    del views
    assert a.tolist() == list(range(10, 110)) and b.tolist() == list(range(200, 250))
    _rewrite(path, size, 9)  # the slot is shared memory: no copy was made
    assert a[0].item() == 9
    a.add_(1)  # the trainer may write into its own batch
    with open(path, "rb") as f:
        assert f.read(11)[10] == 10
    tail = b[5:]
    del a, b
    assert borrowed.holds(7, 3) and borrowed.releases() == {}
    del tail
    assert not borrowed.holds(7, 3) and borrowed.releases() == {7: [3]}
    assert borrowed.releases() == {}
    maps.close()


def test_past_the_limit_or_read_only_a_batch_is_not_lent(segment):
    name, _, _ = segment
    rw, ro = local.Mappings(writable=True), local.Mappings()
    borrowed = local.Borrowed(limit=1)
    first = borrowed.lend(1, 0, name, rw.mapping(name), [[0, 10]])
    assert first is not None
    assert borrowed.lend(1, 1, name, rw.mapping(name), [[0, 10]]) is None  # the limit: copied out instead
    assert local.Borrowed(limit=4).lend(1, 2, name, ro.mapping(name), [[0, 10]]) is None
    assert local.Borrowed(limit=0).lend(1, 3, name, rw.mapping(name), [[0, 10]]) is None
    with pytest.raises(LoaderError, match="names bytes"):
        local.Borrowed(limit=4).lend(1, 4, name, rw.mapping(name), [[0, 10 ** 9]])
    del first
    rw.close()
    ro.close()


def test_a_detached_batch_keeps_its_bytes_and_address_while_the_slot_is_rewritten(segment):
    name, path, size = segment
    maps, borrowed = local.Mappings(writable=True), local.Borrowed(limit=4)
    start = mmap.PAGESIZE - 30  # straddles a page boundary: the neighbours' edge pages are copied too
    (v,) = borrowed.lend(2, 0, name, maps.mapping(name), [[start, 100]])
    t = torch.from_numpy(v)
    before, addr = t.clone(), t.data_ptr()
    borrowed.detach()
    assert len(borrowed) == 0 and borrowed.detached == 1 and borrowed.releases() == {}
    _rewrite(path, size, 5)  # the service reuses the slot
    assert torch.equal(t, before) and t.data_ptr() == addr
    t.add_(1)  # its own pages now
    assert torch.equal(t, before + 1)
    # a batch lent afterwards reads the segment through a fresh mapping
    (w,) = borrowed.lend(2, 1, name, maps.mapping(name), [[start, 100]])
    assert np.all(w == 5)
    del v, w
    gc.collect()
    assert borrowed.releases() == {2: [1]}  # the detached one is not handed back: it is no longer borrowed
    del t
    maps.close()


def test_a_batch_already_let_go_of_is_handed_back_before_a_detach(segment):
    name, _, _ = segment
    maps, borrowed = local.Mappings(writable=True), local.Borrowed(limit=4)
    views = borrowed.lend(3, 0, name, maps.mapping(name), [[0, 10]])
    del views
    assert borrowed.releases() == {3: [0]}
    maps.close()
