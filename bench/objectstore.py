"""S3 client libraries on the same server: throughput and client CPU per GB (issue 29).

    python -m bench.objectstore [--objects 50] [--mb 4] [--runs 3]

Starts moto's standalone S3 server on 127.0.0.1 (:class:`testkit.stores.MotoServer`),
uploads ``--objects`` objects of ``--mb`` MiB of random bytes, then, for each library, in this
process, one request at a time (the way one decode process reads):

* ``whole``: every object read whole, once (a shard download);
* ``1 MiB ranges`` / ``64 KiB ranges``: random ranges, as many bytes as one ``whole`` pass for
  1 MiB and a tenth of that for 64 KiB (a sample read without a cache).

Figures: MB/s of wall time, and the CPU seconds this process spent per GB (user + system, every
thread: the library's own event loop or runtime included). The server's CPU is printed apart: it
is the same for all, and on this server it is the bottleneck of the wall time, so the CPU per GB
is the figure that tells the libraries apart. Medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import time
from typing import Callable, Dict, List, Tuple

import psutil

from bench.harness import command, log, machine, table_head, table_row
from testkit.stores import TEST_KEY, MotoServer

BUCKET = "bench"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def readers(endpoint: str) -> Dict[str, Tuple[Callable[[str], bytes], Callable[[str, int, int], bytes]]]:
    """Each library's (read whole, read range [start, end)) against ``endpoint``."""
    import boto3
    import obstore
    import s3fs
    from obstore.store import S3Store

    out = {}
    b3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    out["boto3 " + boto3.__version__] = (
        lambda k: b3.get_object(Bucket=BUCKET, Key=k)["Body"].read(),
        lambda k, a, b: b3.get_object(Bucket=BUCKET, Key=k, Range=f"bytes={a}-{b - 1}")["Body"].read())
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, cache_regions=False, use_listings_cache=False)
    out["s3fs " + s3fs.__version__] = (
        lambda k: fs.cat_file(f"{BUCKET}/{k}"),
        lambda k, a, b: fs.cat_file(f"{BUCKET}/{k}", start=a, end=b))
    st = S3Store(BUCKET, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True})
    out["obstore " + obstore.__version__] = (
        lambda k: obstore.get(st, k).bytes().to_bytes(),
        lambda k, a, b: obstore.get_range(st, k, start=a, end=b).to_bytes())
    return out


def run(read, keys: List[str], size: int) -> Tuple[float, float, int]:
    t0, c0 = time.perf_counter(), _cpu()
    n = 0
    for k in keys:
        data = read(k)
        assert len(data) == size, (k, len(data))
        n += len(data)
    return time.perf_counter() - t0, _cpu() - c0, n


def run_ranges(read_range, keys: List[str], obj: int, rng_bytes: int, total: int, seed: int):
    rng = random.Random(seed)
    t0, c0 = time.perf_counter(), _cpu()
    n = 0
    while n < total:
        k, a = rng.choice(keys), rng.randrange(0, obj - rng_bytes)
        data = read_range(k, a, a + rng_bytes)
        assert len(data) == rng_bytes
        n += len(data)
    return time.perf_counter() - t0, _cpu() - c0, n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=50)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.update(TEST_KEY)
    size = int(args.mb * (1 << 20))
    with MotoServer() as server:
        log(f"moto on {server.endpoint}; uploading {args.objects} x {args.mb} MiB")
        c = server.client()
        c.create_bucket(Bucket=BUCKET)
        keys = [f"shards/s-{i:05d}.tar" for i in range(args.objects)]
        for k in keys:
            c.put_object(Bucket=BUCKET, Key=k, Body=os.urandom(size))
        server_proc = psutil.Process(server.proc.pid)
        libs = readers(server.endpoint)
        cases = [("whole", None), ("1 MiB ranges", 1 << 20), ("64 KiB ranges", 64 << 10)]
        rows = []
        for case, rb in cases:
            for lib, (whole, ranged) in libs.items():
                figures = []
                for r in range(args.runs):
                    s0 = sum(server_proc.cpu_times()[:2])
                    if rb is None:
                        wall, cpu, n = run(whole, keys, size)
                    else:
                        wall, cpu, n = run_ranges(ranged, keys, size, rb, size * len(keys) // (1 if rb >= 1 << 20 else 10), r)
                    srv = sum(server_proc.cpu_times()[:2]) - s0
                    gb = n / 1e9
                    figures.append((n / 1e6 / wall, cpu / gb, srv / gb))
                    log(f"{case:14} {lib:22} run {r}: {figures[-1][0]:.0f} MB/s, {figures[-1][1]:.2f} CPU s/GB")
                rows.append([case, lib] + [f"{statistics.median(f[i] for f in figures):.{d}f}"
                                           for i, d in ((0, 0), (1, 2), (2, 1))])
    print(f"`{command('bench.objectstore', argv)}` on {machine()}; {args.objects} objects x {args.mb} MiB, "
          f"median of {args.runs}\n")
    print(table_head(["read", "library", "MB/s", "client CPU s/GB", "server CPU s/GB"], "llrrr"))
    for row in rows:
        print(table_row(row))


if __name__ == "__main__":
    main()
