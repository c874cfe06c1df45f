"""When the dispatcher gives freed heap back (heap.TrimRule), and that the call exists here."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_service.dispatch.heap import TrimRule, rss_bytes, trim


def counts(rule: TrimRule, seq) -> list:
    """The counts at which ``rule`` said trim."""
    return [n for n in seq if rule.connections(n)]


def test_a_draining_flood_is_trimmed_as_it_halves_until_fewer_than_min_gone_are_left_to_close():
    rule = TrimRule(min_gone=256)
    assert counts(rule, range(1, 10_001)) == []  # connecting never trims
    assert counts(rule, range(9_999, -1, -1)) == [5000, 2500, 1250, 625, 312, 56]


def test_one_client_coming_and_going_is_trimmed_once_in_min_gone_departures():
    rule = TrimRule(min_gone=256)
    said = [rule.connections(n) for _ in range(1000) for n in (1, 0)]
    assert said.count(True) == 1000 // 256


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=200))
def test_a_trim_comes_only_after_min_gone_departures_and_no_fewer_than_remain(seq):
    rule, gone, last = TrimRule(min_gone=64), 0, 0
    for n in seq:
        gone += max(0, last - n)
        last = n
        if rule.connections(n):
            assert gone >= 64 and gone >= n
            gone = 0
        else:
            assert gone < 64 or gone < n


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
