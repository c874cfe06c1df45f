"""Worker memory of a dataset index, and the HDF5 chunk cache's effect on random reads.

    python -m bench.index_memory [index] [--entries 10000000] [--workers 1,2,4,8]
    python -m bench.index_memory hdf5-cache [--images 4096] [--size 64]

``index`` (the default): a synthetic index of ``--entries`` ImageNet-like relative paths
(``train/n01440764/n01440764_10026.JPEG``). For each K in ``--workers``, K worker processes are
started at once; each touches every entry of the index (sums all path lengths and reads every
byte), reports its own USS (``psutil.Process().memory_full_info().uss``: pages no other
process shares) and waits until all K have reported. Three contenders:

* ``list[str] fork``: a Python list of str built in the parent and inherited by ``fork``.
  Merely reading an entry increments its refcount, which writes to the object's page, so
  every worker ends up with a private copy of (almost) the whole index: pytorch/pytorch#13246.
* ``ours fork``: the same paths as :class:`loader_service.sources.index.PackedStrings` (one
  UTF-8 buffer + int64 offsets) in a shared-memory segment, inherited by ``fork``.
* ``ours spawn``: the same segment attached by name in a spawned process, which is what the
  service's workers do (imagefolder; packed, webdataset map ``.npy`` files the same way). Its
  USS includes a fresh interpreter with numpy (``base``, measured before touching).

The ``ours`` workers also decode 200k random entries one by one (``paths[i]``), as a
``__getitem__`` would. At 10M entries the list needs ~1 GiB in the parent and up to ~1 GiB
per list worker: about 10 GiB at K=8 (use ``--entries`` for less).

``hdf5-cache``: random single-sample reads over one shuffled epoch (the service's access
pattern) from HDF5 files of ``--images`` samples, with chunk caches of several sizes (one
fresh file handle per run, i.e. per worker): raw uint8 arrays ``N x S x S x 3`` chunked by 1
and by 32 images (gzip), the latter also with ``rdcc_w0=1.0``, and encoded JPEGs in a
variable-length dataset (chunks of 256). The files sit in the page cache, so this measures
HDF5's work (chunk lookup, decompression), not the disk.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np
import psutil

from loader_service.shm import Segment
from loader_service.sources.index import PackedStrings

MiB = 1 << 20
PATHS: list = []  # the list contender, inherited by forked workers
OURS: dict = {}  # the shared-memory contender: {"seg": Segment, "n": int, "blob_len": int}
RANDOM_READS = 200_000


# ---------------------------------------------------------------------------- index memory
def make_paths(n: int) -> list:
    rng = np.random.default_rng(0)
    synsets = [f"n{int(s):08d}" for s in rng.integers(1_000_000, 15_000_000, size=1000)]
    return [f"train/{synsets[i % 1000]}/{synsets[i % 1000]}_{i // 1000 + 10000}.JPEG" for i in range(n)]


def to_shared(paths: list) -> dict:
    """PackedStrings of ``paths`` in one shared-memory segment: [n, blob_len][offsets][blob]."""
    lengths = np.fromiter(map(len, paths), dtype=np.int64, count=len(paths))  # ASCII: chars == bytes
    n, blob_len = len(paths), int(lengths.sum())
    seg = Segment.create(16 + 8 * (n + 1) + blob_len, tag="bench-index")
    seg.array(np.int64, (2,))[:] = (n, blob_len)
    offsets = seg.array(np.int64, (n + 1,), 16)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    blob = seg.array(np.uint8, (blob_len,), 16 + 8 * (n + 1))
    blob[:] = np.frombuffer("".join(paths).encode("ascii"), dtype=np.uint8)
    del offsets, blob
    return {"seg": seg, "n": n, "blob_len": blob_len}


def _views(seg: Segment) -> PackedStrings:
    n, blob_len = (int(x) for x in seg.array(np.int64, (2,)))
    offsets = seg.array(np.int64, (n + 1,), 16)
    return PackedStrings(seg.array(np.uint8, (blob_len,), 16 + 8 * (n + 1)), offsets)


def _uss() -> int:
    return psutil.Process().memory_full_info().uss


def touch_list(conn, release) -> None:
    base = _uss()
    total = count = 0
    for s in PATHS:  # each access increments (and later decrements) the str's refcount
        total += len(s)
        count += 1
    conn.send((base, _uss(), total, count))
    release.wait()


def touch_ours(conn, release, seg_name) -> None:
    seg = OURS["seg"] if seg_name is None else Segment.attach(seg_name, readonly=True)
    base = _uss()
    paths = _views(seg)
    lengths = np.diff(paths.offsets)
    total, count = int(lengths.sum()), len(lengths)
    blob_sum = int(paths.blob.sum(dtype=np.uint64))  # reads every byte of every path
    rng = np.random.default_rng(os.getpid())
    chars = 0
    for i in rng.integers(0, count, size=RANDOM_READS):
        chars += len(paths[int(i)])  # one entry at a time, like a Dataset.__getitem__
    assert blob_sum > 0 and chars > 0
    del lengths
    conn.send((base, _uss(), total, count))
    del paths
    release.wait()
    if seg_name is not None:
        seg.close()


def run_workers(kind: str, k: int, seg_name=None):
    """Start k workers at once; return ([(base USS, USS after touching)], seconds)."""
    ctx = mp.get_context("spawn" if kind == "spawn" else "fork")
    release = ctx.Event()
    pipes, procs = [], []
    t0 = time.perf_counter()
    for _ in range(k):
        r, w = ctx.Pipe(duplex=False)
        target, args = (touch_list, (w, release)) if kind == "list" else (touch_ours, (w, release, seg_name))
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        pipes.append(r)
        procs.append(p)
    try:
        results = [r.recv() for r in pipes]
        seconds = time.perf_counter() - t0
    finally:
        release.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
    totals = {(t, c) for _, _, t, c in results}
    assert len(totals) == 1, f"workers disagree on the index: {totals}"
    return [(b, a) for b, a, _, _ in results], seconds


def bench_index(args) -> None:
    ks = [int(x) for x in args.workers.split(",")]
    n = args.entries
    print(f"building {n:,} paths ...", flush=True)
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    PATHS.extend(make_paths(n))
    gc.freeze()  # as a careful DataLoader user would; it does not stop the refcount writes
    list_mib = (psutil.Process().memory_info().rss - rss0) / MiB
    OURS.update(to_shared(PATHS))
    ours_mib = OURS["seg"].size / MiB
    print(f"  list[str]: ~{list_mib:,.0f} MiB in the parent ({list_mib * MiB / n:.0f} B/entry);  "
          f"PackedStrings: {ours_mib:,.0f} MiB in /dev/shm ({OURS['seg'].size / n:.1f} B/entry);  "
          f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        rows = []
        for k in ks:
            row = {"k": k}
            for kind in ("list", "fork", "spawn"):
                res, secs = run_workers(kind, k, OURS["seg"].name if kind == "spawn" else None)
                row[kind] = (np.mean([a for _, a in res]) / MiB, np.mean([b for b, _ in res]) / MiB,
                             sum(a for _, a in res) / MiB, secs)
                print(f"  K={k} {kind:>5}: USS/worker {row[kind][0]:8.1f} MiB (base {row[kind][1]:.1f}), "
                      f"total {row[kind][2]:9.1f} MiB, {secs:.1f} s", flush=True)
            rows.append(row)
    finally:
        OURS["seg"].close()
    print()
    print(f"Per-worker private memory (USS) after touching all {n:,} index entries; "
          f"total = sum over the K workers (MiB)")
    print(f"index in the parent: list[str] ~{list_mib:,.0f} MiB, PackedStrings {ours_mib:,.0f} MiB (shared)")
    head = (f"| {'K':>2} | {'list[str] fork /worker':>22} | {'total':>9} | {'ours fork /worker':>17} | {'total':>7} | "
            f"{'ours spawn /worker (base)':>25} | {'total':>7} |")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        li, fo, sp = r["list"], r["fork"], r["spawn"]
        print(f"| {r['k']:>2} | {li[0]:>22,.1f} | {li[2]:>9,.1f} | {fo[0]:>17,.1f} | {fo[2]:>7,.1f} | "
              f"{f'{sp[0]:,.1f} ({sp[1]:.1f})':>25} | {sp[2]:>7,.1f} |")


# ---------------------------------------------------------------------------- hdf5 chunk cache
def _images(n: int, size: int) -> np.ndarray:
    """Smooth colour fields, posterized: raw pixels that gzip to about 60%, like photos do."""
    import cv2

    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, size=(n, 4, 4, 3), dtype=np.uint8)
    return np.stack([cv2.resize(s, (size, size), interpolation=cv2.INTER_CUBIC) // 4 * 4 for s in small])


def _read_epoch(path: str, order: np.ndarray, cache: int, w0: float) -> tuple:
    """(reads/s, MiB of memory the reader grew by) for one shuffled epoch through a fresh
    handle, in a spawned process of its own: a clean heap, so its growth is what HDF5 held."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_read_epoch_here, (path, order, cache, w0))


def _read_epoch_here(path: str, order: np.ndarray, cache: int, w0: float) -> tuple:
    import h5py

    rss0 = psutil.Process().memory_info().rss
    with h5py.File(path, "r", rdcc_nbytes=cache, rdcc_nslots=10007, rdcc_w0=w0) as f:
        ds = f["images"]
        ds[0]  # open the dataset's metadata before the clock and the memory baseline matter
        rss0 = psutil.Process().memory_info().rss
        t0 = time.perf_counter()
        for i in order:
            ds[int(i)]
        rate = len(order) / (time.perf_counter() - t0)
        return rate, (psutil.Process().memory_info().rss - rss0) / MiB


def bench_hdf5_cache(args) -> None:
    import h5py

    from loader_service.sources.demo import encode_jpeg

    n, size = args.images, args.size
    caches = [0, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        imgs = _images(n, size)
        files = []
        for per_chunk in (1, 32):
            path = os.path.join(tmp, f"raw-c{per_chunk}.h5")
            with h5py.File(path, "w") as f:
                f.create_dataset("images", data=imgs, chunks=(per_chunk, size, size, 3), compression="gzip",
                                 compression_opts=4)
            files.append((f"raw gzip, {per_chunk} img/chunk ({per_chunk * imgs[0].nbytes // 1024} KiB)", path, 0.75))
        files.append((f"same, 32 img/chunk, rdcc_w0=1.0", files[-1][1], 1.0))
        path = os.path.join(tmp, "encoded.h5")
        with h5py.File(path, "w") as f:
            ds = f.create_dataset("images", shape=(n,), dtype=h5py.vlen_dtype(np.uint8), chunks=(256,))
            for i in range(n):
                ds[i] = np.frombuffer(encode_jpeg(imgs[i], 90), np.uint8)
        files.append(("encoded JPEG vlen, 256/chunk", path, 0.75))
        order = np.random.default_rng(1).permutation(n)
        print(f"HDF5 random reads: one shuffled epoch of {n} images ({size}x{size}x3, {imgs.nbytes / MiB:.0f} MiB "
              f"raw), one process, fresh handle per run, rdcc_nslots=10007, h5py {h5py.__version__} / HDF5 "
              f"{h5py.version.hdf5_version}")
        print(f"cell: reads/s (median of {args.repeats}) and, in brackets, MiB the reading process grew by "
              "(what the chunk cache holds)")
        head = f"| {'layout':<34} | {'MiB':>5} | " + " | ".join(f"{_fmt_cache(c):>14}" for c in caches) + " |"
        print(head)
        print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
        for label, p, w0 in files:
            cells = []
            for c in caches:
                runs = [_read_epoch(p, order, c, w0) for _ in range(args.repeats)]
                rate = float(np.median([r for r, _ in runs]))
                cells.append(f"{rate:,.0f} ({float(np.median([g for _, g in runs])):.0f})")
            print(f"| {label:<34} | {os.path.getsize(p) / MiB:>5.1f} | " + " | ".join(f"{c:>14}" for c in cells)
                  + " |", flush=True)


def _fmt_cache(c: int) -> str:
    return "cache 0" if c == 0 else f"{c // MiB} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", default="index", choices=["index", "hdf5-cache"])
    p.add_argument("--entries", type=int, default=10_000_000, help="index entries (index mode)")
    p.add_argument("--workers", default="1,2,4,8", help="worker counts K (index mode)")
    p.add_argument("--images", type=int, default=4096, help="samples per HDF5 file (hdf5-cache mode)")
    p.add_argument("--size", type=int, default=64, help="image side (hdf5-cache mode)")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell (hdf5-cache mode)")
    p.add_argument("--dir", default=None, help="folder for the temporary HDF5 files")
    args = p.parse_args()
    if args.mode == "index":
        bench_index(args)
    else:
        bench_hdf5_cache(args)


if __name__ == "__main__":
    main()
