"""A client pointed at a hostile ZeroMQ peer: the peer's oversized frames cost the client no
memory, and the client fails with an error that says what happened."""

import pytest

from client import LoaderError, LoaderTimeout, RemoteLoader

from tests.conftest import DEMO_SIZE
from testkit.hostile import RoguePeer

@pytest.fixture
def rogue():
    peer = RoguePeer()
    yield peer
    peer.close()


def test_a_rogue_peer_s_huge_frame_costs_the_client_no_memory_and_a_clear_error(rogue):
    ld = RemoteLoader(f"tcp://127.0.0.1:{rogue.port}", batch_size=8, image_size=32, timeout=120)
    try:
        with pytest.raises(LoaderError, match=r"cut for breaking the protocol and is not retried: a peer that "
                                              r"sends a frame over this loader's cap of 1073152 bytes") as info:
            next(iter(ld))
    finally:
        ld.close()
    assert "is this endpoint a loader service?" in str(info.value)
    assert not isinstance(info.value, LoaderTimeout)  # raised once the cut was certain, not at the timeout
    assert rogue.connections == 1  # cut off for good, as soon as the frame's size arrived
    # what the client let in before cutting off: socket buffers, not the frame (cap: 1 MiB + 24 KiB images)
    assert rogue.sent < 32 << 20, rogue.sent


def test_a_rogue_replica_is_given_up_at_once_and_the_real_one_serves_the_epoch(rogue, make_service):
    """Replicas [a service, a rogue]: the rogue's connection is cut, its share of batches goes to
    the service at once (not after replica_timeout), and the epoch is exactly once."""
    svc = make_service()
    with RemoteLoader([svc.endpoint, f"tcp://127.0.0.1:{rogue.port}"], batch_size=8, image_size=32,
                      replica_timeout=600, timeout=120, epoch_lookahead=False) as ld:
        assert sorted(i for b in ld for i in b.indices) == list(range(DEMO_SIZE))
    assert rogue.sent < 32 << 20, rogue.sent
