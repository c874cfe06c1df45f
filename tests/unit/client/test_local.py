"""The co-located client's batches held in place (client/local.py), on a real segment file."""

import gc
import mmap
import os
import uuid

import numpy as np
import pytest
import torch

from client import local
from client.errors import LoaderError


@pytest.fixture
def segment():
    """A segment file the way the service makes one (its name prefix, in /dev/shm), 3 pages + 100 bytes."""
    name = f"{local.PREFIX}{os.getpid()}-test-{uuid.uuid4().hex[:12]}"  # named as the service names its segments
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


@pytest.fixture
def replica(segment):
    """A real Replica connected to a ROUTER on 127.0.0.1, and the segment mapped read-write:
    ``(replica, received, lend)``; ``received()`` the next message the ROUTER read, ``lend(stream,
    batch)`` the views of batch ``batch`` of ``stream`` lent in place (10 bytes at 100 x batch)."""
    import zmq
    from client.replica import Replica
    from wire import protocol as P

    name, _, _ = segment
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    r = Replica(ctx, f"tcp://127.0.0.1:{port}", heartbeat_s=1.0)
    maps = local.Mappings(writable=True)
    m = maps.mapping(name)

    def received():
        assert router.poll(10_000), "nothing came within 10 s"
        return P.decode(router.recv_multipart()[1:])[0]

    def lend(stream, batch):
        return r.borrowed.lend(stream, batch, name, m, [[100 * batch, 10]])

    try:
        yield r, received, lend
    finally:
        maps.close()
        r.close()
        router.close()
        ctx.term()


def test_a_request_takes_its_stream_s_batches_let_go_of_along_and_a_release_carries_the_others(replica):
    """One message per batch on the co-located path: the Request that asks for the next batch
    hands back what the trainer let go of on its stream (Request.released); let-go batches of an
    older stream still go in a Release of their own; nothing is handed back twice."""
    from wire import protocol as P

    r, received, lend = replica
    r.borrowed.limit = 3
    lent = [lend(stream, batch) for stream, batch in [(4, 1), (5, 2), (5, 3)]]
    del lent  # the trainer lets go of all three
    r.stream = 5
    r.request([7], consumed=2)
    assert received() == P.Release(stream=4, batches=[1])
    ask = received()  # (let go of in whatever order the views died)
    assert ask == P.Request(stream=5, batches=[7], consumed=2, released=ask.released)
    assert sorted(ask.released) == [2, 3]
    r.request([8], consumed=3)
    assert received() == P.Request(stream=5, batches=[8], consumed=3)  # nothing twice
    r.send(P.Describe())  # a marker: what comes before it is all that was sent
    assert received() == P.Describe()


def test_a_wait_keeps_its_stream_s_let_go_batches_for_the_request_while_the_slots_need_none(replica):
    """In a wait (``owed`` given), the current stream's let-go batches stay for the Request that
    follows the take while its slots hold them, those still held and the owed ones; once they do
    not, they go at once in a Release (the service needs that slot). Other streams' always go."""
    from wire import protocol as P

    r, received, lend = replica
    r.borrowed.limit = 5
    r.stream, r.slots = 5, 6
    held = lend(5, 1)
    lent = [lend(stream, batch) for stream, batch in [(4, 0), (5, 2)]]
    del lent  # let go of: 4/0 (an older stream) and 5/2; 5/1 still held
    r.send_releases(owed=4)  # 5's slots: 1 held + 1 let go + 4 owed = 6: room without the Release
    assert received() == P.Release(stream=4, batches=[0])
    r.send(P.Describe())  # a marker: what comes before it is all that was sent
    assert received() == P.Describe()
    assert r.borrowed.holds(5, 1) and list(r.borrowed.back) == [(5, 2)]
    r.send_releases(owed=5)  # 7 > 6: the service needs it now
    assert received() == P.Release(stream=5, batches=[2])
    del held
    r.send_releases(owed=4)  # kept again (1 let go + 4 owed <= 6) ...
    r.request([9], consumed=3)  # ... and taken along by the Request
    assert received() == P.Request(stream=5, batches=[9], consumed=3, released=[1])
    r.send_releases()  # not a wait: nothing is kept, and nothing is left
    r.send(P.Describe())
    assert received() == P.Describe()


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


def test_a_holder_that_only_waits_for_a_copy_lets_go_first_so_nothing_is_detached(segment):
    """The CUDA sink holds lent batches only until their copy is done: a detach asks it to settle
    first, so those batches are neither copied privately nor handed back (the Hello that follows
    takes them back); one the trainer still holds is detached as before."""
    name, _, _ = segment
    maps, borrowed = local.Mappings(writable=True), local.Borrowed(limit=4)
    copying = borrowed.lend(4, 0, name, maps.mapping(name), [[0, 10]])
    kept = borrowed.lend(4, 1, name, maps.mapping(name), [[20, 10]])
    settled = []

    def settle():
        settled.append(len(borrowed))
        copying.clear()  # the copies are done: the sink drops what it held

    borrowed.settle = settle
    borrowed.detach()
    assert settled == [2] and borrowed.detached == 1 and len(borrowed) == 0 and borrowed.releases() == {}
    del kept
    maps.close()


def test_each_mapping_is_announced_before_it_is_unmapped(segment):
    """The CUDA sink unregisters a page-locked mapping before its pages go: on eviction past
    ``keep``, on a stale mapping's replacement, and on close, each mapping once."""
    name, _, _ = segment
    gone = []
    maps = local.Mappings(keep=1, writable=True, unmapping=gone.append)
    first = maps.mapping(name)
    assert maps.mapping(name) is first and gone == []
    first.stale = True
    second = maps.mapping(name)  # a fresh mapping replaces the stale one
    assert second is not first and gone == [first]
    maps.close()
    maps.close()
    assert gone == [first, second]


# ------------------------------------------------------------------ the CPU sink, from a socket
def _pair():
    import zmq
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    addr = f"inproc://lend-{os.getpid()}-{id(a)}"
    a.bind(addr)
    b.connect(addr)
    return a, b


def _sink_receive(name, blocks, label_frames=(np.array([7, 8], np.int64).tobytes(),)):
    """A 2-sample 8x8 batch handed over in place at ``blocks`` of segment ``name``, through HostSink,
    its data frames ``label_frames`` (the labels, as a service sends them)."""
    from client.config import LoaderConfig
    from client.sinks import HostSink
    from wire import protocol as P
    msg = P.Batch(stream=4, epoch=0, index=1, indices=[5, 6], shape=[2, 8, 8, 3], local=[name, blocks])
    a, b = _pair()
    try:
        a.send_multipart([P.encode_header(msg), *label_frames])
        b.recv()  # the header, as Connections.recv reads it
        borrowed = local.Borrowed(limit=2)
        sink = HostSink(LoaderConfig.of("tcp://127.0.0.1:9", batch_size=2, image_size=8), held=1)
        try:
            (raw,), labels = sink.receive(b, msg, borrowed)
            return raw, labels, borrowed
        finally:
            sink.close()
    finally:
        a.close(0)
        b.close(0)


def test_the_cpu_sink_lends_a_batch_handed_over_in_place(segment):
    name, path, _ = segment
    raw, labels, borrowed = _sink_receive(name, [[100, 384]])
    with open(path, "rb") as f:
        assert raw.numpy().tobytes() == f.read()[100:484]
    assert raw.shape == (2, 8, 8, 3) and labels.tolist() == [7, 8] and borrowed.holds(4, 1)
    del raw
    assert borrowed.releases() == {4: [1]}


@pytest.mark.parametrize("where, blocks, says", [
    ("inside", [[3 * mmap.PAGESIZE + 50, 384]], "names bytes"),  # past the segment's end
    ("nowhere", [[0, 384]], "no longer exists"),  # no such segment (SlotsGone: the batch is asked again)
    ("foreign", [[0, 384]], "cannot map the service's shared memory"),  # not a service segment's name
])
def test_a_batch_handed_over_in_place_that_the_segment_cannot_hold_is_a_clear_error(segment, where, blocks, says):
    name = {"inside": segment[0], "nowhere": f"{local.PREFIX}{os.getpid()}-gone-0",
            "foreign": "shm-of-something-else"}[where]
    with pytest.raises(LoaderError, match=says) as info:
        _sink_receive(name, blocks)
    assert info.value.code == "bad_message"


@pytest.mark.parametrize("frames, says", [
    ((), "missing data frames"),
    ((bytes(8),), r"Batch frames are \[8\] bytes, header says \[16\]"),  # too short
    ((bytes(24),), r"Batch frames are \[24\] bytes, header says \[16\]"),  # too long: cut, and refused
    ((bytes(16), b"x"), "Batch takes 1 data frames, got 2"),  # a frame too many
])
def test_labels_of_a_batch_handed_over_in_place_that_are_not_its_size_are_a_clear_error(segment, frames, says):
    """The labels are received straight into their tensor: a frame of another size, a missing or
    an extra one is refused (and the message read to its end), never a short or stale tensor."""
    with pytest.raises(LoaderError, match=says) as info:
        _sink_receive(segment[0], [[100, 384]], frames)
    assert info.value.code == "bad_message"


# ------------------------------------------------------------------ the model: any interleaving
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

SLOTS = 5
SLOT_BYTES = mmap.PAGESIZE + 100  # slots that share pages: the edge pages of a detach are the neighbours'


class BorrowedModel(RuleBasedStateMachine):
    """The service writes slots and lends them, the trainer keeps, slices and drops batches, the
    loader drains Releases and moves on (detach), in any order. Every batch the trainer still
    holds reads what was lent to it, whatever the service wrote since; a slot is handed back
    once, only after the trainer let go, never after a detach; at most ``limit`` are held."""

    def __init__(self):
        super().__init__()
        self.name = f"{local.PREFIX}{os.getpid()}-model-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(local.SHM_DIR, self.name)
        with open(self.path, "wb") as f:
            f.write(bytes(SLOTS * SLOT_BYTES))
        self.maps, self.borrowed = local.Mappings(writable=True), local.Borrowed(limit=3)
        self.stream, self.next_batch = 1, 0
        self.free = set(range(SLOTS))  # slots the service may write
        self.lent = {}  # (stream, batch) -> slot, borrowed and not yet handed back
        self.let_go = set()  # let go of, Release not yet drained
        self.held = {}  # (stream, batch) -> (tensor or a slice of it, the bytes it must read)

    def teardown(self):
        self.held.clear()
        self.maps.close()
        os.unlink(self.path)

    def _write(self, slot, value):
        with open(self.path, "r+b") as f:
            f.seek(slot * SLOT_BYTES)
            f.write(bytes([value]) * SLOT_BYTES)

    @precondition(lambda self: self.free)
    @rule(value=st.integers(0, 255), data=st.data())
    def service_lends(self, value, data):
        slot = data.draw(st.sampled_from(sorted(self.free)))
        self._write(slot, value)
        key = (self.stream, self.next_batch)
        self.next_batch += 1
        base, n = slot * SLOT_BYTES, SLOT_BYTES - 7
        views = self.borrowed.lend(*key, self.name, self.maps.mapping(self.name), [[base + 7, n]])
        if views is None:  # copied out and handed back at once: the limit
            assert len(self.lent) - len(self.let_go) == self.borrowed.limit
            return
        self.free.discard(slot)
        self.lent[key] = slot
        self.held[key] = (torch.from_numpy(views[0]), value)

    @precondition(lambda self: self.free)
    @rule(value=st.integers(0, 255), data=st.data())
    def service_rewrites_a_free_slot(self, value, data):
        self._write(data.draw(st.sampled_from(sorted(self.free))), value)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), keep_a_slice=st.booleans())
    def trainer_lets_go(self, data, keep_a_slice):
        key = data.draw(st.sampled_from(sorted(self.held)))
        t, value = self.held.pop(key)
        if keep_a_slice:  # a view of the batch keeps it, then goes too
            part = t[3:9]
            del t
            assert key not in self.lent or self.borrowed.holds(*key)
            assert part.tolist() == [value] * 6  # still the bytes lent to it
            del part
        else:
            del t
        if key in self.lent:
            self.let_go.add(key)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def trainer_writes_its_batch(self, data):
        key = data.draw(st.sampled_from(sorted(self.held)))
        t, value = self.held[key]
        t.fill_((value + 1) % 256)
        self.held[key] = (t, (value + 1) % 256)

    @rule()
    def loader_sends_releases(self):
        got = self.borrowed.releases()
        want = {}
        for stream, batch in sorted(self.let_go):
            want.setdefault(stream, []).append(batch)
        assert {s: sorted(b) for s, b in got.items()} == want
        for key in self.let_go:
            self.free.add(self.lent.pop(key))
        self.let_go.clear()

    @rule(data=st.data())
    def loader_waits_and_keeps_one_stream_s_releases(self, data):
        """A wait's poll: the Releases of every stream but ``keep`` go; ``keep``'s stay, once, for
        a later call (the Request after the take)."""
        keep = data.draw(st.sampled_from(sorted({s for s, _ in self.lent} | {self.stream})))
        got = self.borrowed.releases(keep)
        want = {}
        for stream, batch in sorted(k for k in self.let_go if k[0] != keep):
            want.setdefault(stream, []).append(batch)
        assert {s: sorted(b) for s, b in got.items()} == want
        for key in [k for k in self.let_go if k[0] != keep]:
            self.free.add(self.lent.pop(key))
            self.let_go.discard(key)

    @rule(data=st.data(), slots=st.integers(0, SLOTS + 2), owed=st.integers(0, SLOTS))
    def loader_asks_whether_the_slots_need_releases(self, data, slots, owed):
        """The slots hold what is lent (let go of or not, not yet handed back) and what is owed."""
        stream = data.draw(st.sampled_from(sorted({s for s, _ in self.lent} | {self.stream})))
        kept = sum(1 for s, _ in self.lent if s == stream)
        assert self.borrowed.room_without_releases(stream, slots, owed) == (kept + owed <= slots)

    @rule()
    def connection_moves_on(self):
        """The next Hello: what was let go of is handed back first, the rest detached; the
        service then takes back every slot."""
        self.loader_sends_releases()
        self.borrowed.detach()
        self.free |= set(self.lent.values())
        self.lent.clear()
        self.stream += 1

    @invariant()
    def every_batch_held_reads_what_it_was_lent(self):
        for t, value in self.held.values():
            assert bool((t == value).all())

    @invariant()
    def borrowed_is_what_the_trainer_holds(self):
        assert len(self.borrowed) == len(self.lent) - len(self.let_go) <= self.borrowed.limit


def test_borrowed_batches_under_any_interleaving():
    run = BorrowedModel.TestCase
    run.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
    run().runTest()


def test_a_fifo_or_a_link_under_a_segment_s_name_is_neither_a_probe_nor_mapped(tmp_path):
    """/dev/shm is anyone's to write in. A FIFO named like a service's probe or slots would block a
    plain open until someone writes to it (the trainer hangs before its first batch); a symbolic link
    would point the trainer's writes into lent batches at a file of the link's maker. Neither is
    read, nor mapped: the probe is not reachable, the mapping a clear error."""
    import threading

    base = f"{local.PREFIX}{os.getpid()}-test-{uuid.uuid4().hex[:12]}"
    fifo, link = base + "-fifo", base + "-link"
    target = tmp_path / "theirs"
    target.write_bytes(link.encode() + bytes(mmap.PAGESIZE))  # holds the link's name, as a probe would
    os.mkfifo(os.path.join(local.SHM_DIR, fifo))
    os.symlink(target, os.path.join(local.SHM_DIR, link))
    try:
        answers = []
        probing = threading.Thread(target=lambda: answers.extend(local.reachable(n) for n in (fifo, link)), daemon=True)
        probing.start()
        probing.join(30)
        if probing.is_alive():  # blocked in open(): free it (a writer's open completes the reader's) and fail
            os.close(os.open(os.path.join(local.SHM_DIR, fifo), os.O_WRONLY | os.O_NONBLOCK))
            probing.join(30)
        assert answers == [False, False]
        for name, why in ((fifo, "is not a regular file"), (link, "Too many levels of symbolic links")):
            for writable in (True, False):
                with pytest.raises(LoaderError, match=f"cannot map the service's shared memory {name!r}.*{why}"):
                    local.Mappings(writable=writable).mapping(name)
        assert target.read_bytes() == link.encode() + bytes(mmap.PAGESIZE)
    finally:
        for name in (fifo, link):
            os.unlink(os.path.join(local.SHM_DIR, name))
