"""When the dispatcher gives freed heap back (heap.TrimRule), and that the call exists here."""

from __future__ import annotations

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_service.config import ServiceConfig
from loader_service.dispatch.heap import SETTLE_S, TrimRule, rss_bytes, trim
from testkit.dispatcher import close, loopless


def counts(rule: TrimRule, seq) -> list:
    """The counts at which ``rule`` said trim."""
    return [n for n in seq if rule.connections(n)]


def test_a_draining_flood_is_trimmed_as_it_halves_down_to_its_last_connection():
    rule = TrimRule(min_gone=256)
    assert counts(rule, range(1, 10_001)) == []  # connecting never trims
    assert counts(rule, range(9_999, -1, -1)) == [5000, 2500, 1250, 625, 312, 156, 78, 39, 19, 9, 4, 2, 1, 0]


def test_a_drain_that_stops_above_its_last_trim_is_not_trimmed_again_until_min_gone_have_left():
    rule = TrimRule(min_gone=256)
    counts(rule, range(1, 1001))
    assert counts(rule, range(999, 99, -1)) == [500, 250, 125]
    # a client comes above the count of the last trim, and goes: the drain is over
    assert counts(rule, [101, 126, 100]) == []
    assert counts(rule, [n for _ in range(300) for n in (101, 100)]) == [100]  # once, at 256 gone


def test_one_client_coming_and_going_is_trimmed_once_in_min_gone_departures():
    rule = TrimRule(min_gone=256)
    said = [rule.connections(n) for _ in range(1000) for n in (1, 0)]
    assert said.count(True) == 1000 // 256


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=200))
def test_a_trim_comes_only_after_min_gone_departures_or_in_a_drain_and_no_fewer_than_remain(seq):
    """A trim after fewer than ``min_gone`` departures only while the count has stayed at or
    below that of a previous trim (a drain going on)."""
    rule, gone, last, floor = TrimRule(min_gone=64), 0, 0, None
    for n in seq:
        gone += max(0, last - n)
        last = n
        if floor is not None and n > floor:
            floor = None
        draining = floor is not None and gone > 0
        if rule.connections(n):
            assert gone >= n and (gone >= 64 or draining)
            gone, floor = 0, n
        else:
            assert gone < n or (gone < 64 and not draining)


def test_trim_gives_back_the_free_pages_between_blocks_still_in_use():
    """The heap after a flood: what is freed lies between what is still used, so free() alone
    cannot return it (only the top of the heap goes back by itself)."""
    blocks = [bytearray(b"x" * 64 * 1024) for _ in range(2000)]  # 125 MiB, under the mmap threshold
    del blocks[::2]  # 62 MiB of holes between live blocks
    before = rss_bytes()
    if not trim():
        pytest.skip("no malloc_trim here (not glibc)")
    assert before - rss_bytes() > 40 * 2**20, f"{(before - rss_bytes()) / 2**20:.0f} MiB given back"
    del blocks


# ------------------------------------------------------------------ through the dispatch state
def _opened_state(demo_source, connections: int):
    """The dispatch state driven by hand, ``connections`` opened on it (fds from 100); close with ``close``."""
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0), demo_source,
                 workers=1)
    for fd in range(100, 100 + connections):
        d.event(zmq.EVENT_ACCEPTED, fd)
    d.read_monitor()
    return d


def test_a_drain_is_trimmed_in_the_event_that_ends_it_not_at_a_later_round(demo_source):
    """The disconnects of the silence look's cuts are read after the round's tick; before, the
    trim they asked for waited for the next round, which waits for the next event (maybe none:
    a status page then showed 0 connections beside the flood's heap, +90 MB)."""
    d = _opened_state(demo_source, 300)
    try:
        d.tick()
        assert d.sessions.connections == 300 and d.trims == 0
        for fd in range(100, 400):
            d.event(zmq.EVENT_DISCONNECTED, fd)
        trims_at = []
        while d.monitor:  # read as the shell reads them after a cut: no tick between
            d.handle(d.monitor.popleft())
            if d.trims > len(trims_at):
                trims_at.append(d.sessions.connections)
        assert trims_at == [44, 22, 11, 5, 2, 1, 0] and d.totals.heap_trims == 0  # no shell here to trim
    finally:
        close(d)


def test_the_last_trim_a_rule_asked_for_has_one_follow_up_settle_s_later():
    rule = TrimRule(min_gone=4, settle_s=1.0)
    assert not rule.settle_due(100.0) and rule.settle_at is None  # nothing trimmed, nothing to follow up
    counts(rule, range(1, 9))
    assert counts(rule, range(7, -1, -1)) == [4, 2, 1, 0]
    rule.trimmed(10.0)
    rule.trimmed(10.5)  # a later trim moves the follow-up on
    assert not rule.settle_due(11.4)
    assert rule.settle_due(11.5) and not rule.settle_due(11.5) and not rule.settle_due(99.0)


def test_a_drain_s_follow_up_trim_comes_at_the_tick_settle_s_after_its_last_trim(demo_source):
    d = _opened_state(demo_source, 300)
    try:
        for fd in range(100, 400):
            d.event(zmq.EVENT_DISCONNECTED, fd)
        d.read_monitor()
        assert d.trims == 7 and d.state.next_deadline(d.now) == pytest.approx(d.now + SETTLE_S)
        d.now += SETTLE_S / 2
        d.tick()
        assert d.trims == 7
        d.now += SETTLE_S / 2
        d.tick()
        assert d.trims == 8 and d.state.next_deadline(d.now) is None
        d.now += 10 * SETTLE_S
        d.tick()
        assert d.trims == 8  # one follow-up, not one every settle_s
    finally:
        close(d)
