"""SlotArena's capacity rules (pure bookkeeping over real segments)."""

import pytest

from loader_service.dispatch.slots import NoCapacity, SlotArena

MiB = 1 << 20


@pytest.fixture
def arena():
    a = SlotArena(4 * MiB)
    yield a
    a.close()


def test_headroom_is_kept_free_and_a_refused_owner_keeps_its_reserve(arena):
    plain = arena.acquire(b"a", 2 * MiB, "plain")
    ahead = arena.acquire(b"b", MiB, "lookahead", headroom=MiB)  # 2 + 1 + 1 <= 4
    arena.release(ahead, b"b")  # b keeps it as its reserve
    with pytest.raises(NoCapacity, match="would leave less than 2.0 MiB for a current epoch"):
        arena.acquire(b"b", MiB, "lookahead", headroom=2 * MiB)  # reusing it would leave 1 MiB
    assert arena.held_by(b"b") == MiB  # refused, the reserve is still b's
    assert arena.acquire(b"b", MiB, "plain") is ahead  # without headroom the reserve is reused
    arena.release(plain, None)


def test_other_clients_reserves_give_way_before_a_refusal(arena):
    idle = arena.acquire(b"idle", 2 * MiB, "plain")
    arena.release(idle, b"idle")
    arena.acquire(b"a", MiB, "plain")
    arena.acquire(b"b", MiB, "lookahead", headroom=MiB)  # fits only once idle's reserve is gone
    assert arena.held_by(b"idle") == 0 and arena.in_use() == 2 * MiB
