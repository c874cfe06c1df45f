"""Batch memory is not held hostage: an idle client's kept slots go to a job that needs them."""

from client import RemoteLoader

from .conftest import DEMO_SIZE
from .helpers import collect, indices_of, status

KW = dict(batch_size=32, image_size=64, prefetch=4, epoch_lookahead=False)  # 4 x 384 KiB = 1.5 MiB of slots


def test_an_idle_client_s_reserve_goes_to_a_job_that_needs_it(make_service):
    svc = make_service(max_shm_mb=2)
    with RemoteLoader(svc.endpoint, seed=1, **KW) as idle:
        assert sorted(indices_of(collect(idle))) == list(range(DEMO_SIZE))
        # the epoch is over, the client stays connected and keeps its slots for its next epoch
        assert status(svc)["shm_bytes"] == 4 * 32 * 64 * 64 * 3
        with RemoteLoader(svc.endpoint, seed=2, **KW) as other:  # 1.5 + 1.5 MiB > 2 MiB
            assert sorted(indices_of(collect(other))) == list(range(DEMO_SIZE))
        # and the idle client, back at work, gets memory again (the other one has left)
        assert sorted(indices_of(collect(idle))) == list(range(DEMO_SIZE))
