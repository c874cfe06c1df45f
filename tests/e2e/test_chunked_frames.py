"""An output larger than the wire's frame cap (wire.protocol.FRAME_MAX_BYTES) crosses in several
frames and arrives whole: the same bytes as when it crosses in one, every sample once, and a
batch kept by the trainer is never overwritten by the buffers the host sink reuses."""

import numpy as np
import torch

from client import RemoteLoader
from wire import protocol as P

from tests.conftest import DEMO_SIZE

KW = dict(batch_size=8, image_size=32, shuffle=True, seed=3, epoch_lookahead=False)


def _epoch(endpoint):
    with RemoteLoader(endpoint, **KW) as ld:
        return [(b.indices, b.raw.clone(), b.labels.clone(), b) for b in ld]


def test_an_epoch_in_chunks_is_the_epoch_in_one_frame_per_output(make_service, monkeypatch):
    service = make_service()
    whole = _epoch(service.endpoint)
    monkeypatch.setattr(P, "ZERO_COPY_MIN_BYTES", 1024)  # the chunk's lower bound, lowered with the cap
    monkeypatch.setattr(P, "FRAME_MAX_BYTES", 5000)  # 8 x 32 x 32 x 3 = 24,576 bytes: 5 frames per batch
    chunked = _epoch(service.endpoint)
    assert sorted(i for idx, *_ in chunked for i in idx) == list(range(DEMO_SIZE))
    assert [idx for idx, *_ in chunked] == [idx for idx, *_ in whole]
    for (_, raw_a, lab_a, _), (_, raw_b, lab_b, kept) in zip(whole, chunked):
        assert torch.equal(raw_a, raw_b) and torch.equal(lab_a, lab_b)
        assert torch.equal(kept.raw, raw_b)  # every batch kept to the end still holds its own bytes
    assert len({b.raw.data_ptr() for *_, b in chunked}) == len(chunked)  # none shares a buffer with another
    assert np.count_nonzero(chunked[0][1].numpy()) > 0
