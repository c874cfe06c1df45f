"""Check exactly-once delivery against a running loader service, from inside the trainer image.

    python3 verify_epoch.py --endpoint tcp://127.0.0.1:5555 --world-size 2 --epoch 0

For every rank of ``world_size`` it streams one epoch with :class:`client.RemoteLoader` and
collects the dataset indices of the delivered samples (padding excluded). It then asserts:
every rank got the same number of batches and samples (DDP needs that), the ranks are
disjoint, and their union, sorted, is exactly ``range(n)``. Prints one JSON line with the
result and exits 0 on success, 1 with the reason otherwise.

The container test (tests/container/test_compose.py) runs it with ``docker compose run``.
It only needs the client library (pyzmq, msgpack, numpy, torch), so it also runs on a host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def collect(endpoint: str, rank: int, world_size: int, epoch: int, batch_size: int, seed: int,
            image_size: int, timeout: float, local: bool = False):
    from client import RemoteLoader

    indices, padded, batches = [], 0, 0
    with RemoteLoader(endpoint, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed,
                      image_size=image_size, timeout=timeout, local=local) as loader:
        expected_batches = len(loader)
        loader.set_epoch(epoch)
        for batch in loader:
            n = len(batch.indices)
            keep = n - batch.padding
            if tuple(batch.images.shape[:1]) != (n,) or tuple(batch.labels.shape) != (n,):
                raise AssertionError(f"rank {rank} batch {batch.index}: images {tuple(batch.images.shape)} / "
                                     f"labels {tuple(batch.labels.shape)} do not match {n} indices")
            indices.extend(int(i) for i in batch.indices[:keep])
            padded += batch.padding
            batches += 1
        length = loader._dataset_length
        local_batches = loader.stats()["local_batches"]
    if batches != expected_batches:
        raise AssertionError(f"rank {rank}: got {batches} batches, len(loader) said {expected_batches}")
    return indices, padded, batches, length, local_batches


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--expect", type=int, default=None, help="dataset length the service must report")
    p.add_argument("--local", action="store_true", help="co-located: batches from the service's shared memory "
                   "where it is shared (the result counts them: local_batches)")
    a = p.parse_args()

    t0 = time.perf_counter()
    per_rank, lengths, counts, local_batches = [], set(), set(), 0
    try:
        for rank in range(a.world_size):
            idx, padded, batches, length, local = collect(a.endpoint, rank, a.world_size, a.epoch, a.batch_size,
                                                          a.seed, a.image_size, a.timeout, a.local)
            local_batches += local
            per_rank.append(set(idx))
            if len(per_rank[-1]) != len(idx):
                dup = sorted(i for i in per_rank[-1] if idx.count(i) > 1)[:10]
                raise AssertionError(f"rank {rank} got indices more than once: {dup}")
            lengths.add(length)
            counts.add((batches, len(idx) + padded))
        if len(lengths) != 1:
            raise AssertionError(f"ranks saw different dataset lengths: {sorted(lengths)}")
        n = lengths.pop()
        if a.expect is not None and n != a.expect:
            raise AssertionError(f"dataset length {n}, expected {a.expect}")
        if len(counts) != 1:
            raise AssertionError(f"ranks got different (batches, samples incl. padding): {sorted(counts)}")
        for r in range(a.world_size):
            for s in range(r + 1, a.world_size):
                both = per_rank[r] & per_rank[s]
                if both:
                    raise AssertionError(f"ranks {r} and {s} both got {sorted(both)[:10]}")
        union = sorted(set().union(*per_rank))
        if union != list(range(n)):
            missing = sorted(set(range(n)) - set(union))[:10]
            extra = sorted(set(union) - set(range(n)))[:10]
            raise AssertionError(f"union of ranks != range({n}): missing {missing}, unexpected {extra}")
    except AssertionError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}), flush=True)
        return 1
    print(json.dumps({"ok": True, "n": n, "world_size": a.world_size, "epoch": a.epoch,
                      "per_rank": [len(s) for s in per_rank], "batches": next(iter(counts))[0] * a.world_size,
                      "local_batches": local_batches, "seconds": round(time.perf_counter() - t0, 2)}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
