"""A real client's epoch from WebDataset shards on local disk, in moto's S3 and behind a Range
HTTP server, through the shard cache cold and warm (issue 29).

    python -m bench.remote [--photos ~/.cache/remote-loader/photos/imagenet] [--shard-size 50]
                           [--runs 3] [--workers 2] [--batch-size 32] [--json PATH]

The real-photo set (``python -m bench.photo_sets`` builds it) is packed once with ``loader-service
pack --format webdataset`` into a temporary folder, then served three ways, each on 127.0.0.1:
``local`` (``--data FOLDER``, the page cache warm), ``s3`` (``python -m moto.server``,
``testkit.stores.MotoServer``) and ``http`` (``testkit.stores.RangeHTTPServer``, a
threaded server in this process, each response paced to ``--http-mbps``: a store farther away
than loopback, where a download takes time rather than the CPU the decoders need). The cap is above the dataset. Each run starts a fresh service
on an empty shard folder (the index, built by a first start, is kept: a restart reads no shard
for it) and times two epochs of one ``RemoteLoader`` (RandomResizedCrop 224 + flip, shuffled):
epoch 0 on the cold cache (every shard downloaded during it), epoch 1 on the warm cache; the
remote ones once with ``--shard-prefetch --prefetch`` and once without (``0``), interleaved.
Figures: img/s (median of ``--runs``), the shard cache's disk use and downloads (by reads, by the
prefetch thread) after the epochs, the RSS of the service's dispatcher process and of its decode
processes together.

A second table: caps below the dataset (``--caps``, fractions of it; HTTP source), shuffled,
shuffled with each ``--windows`` value as the loader's ``shuffle_window`` (shard-aware), and
sequential; the downloads of epoch 1 as a multiple of the dataset (median of ``--cap-runs``).
``--only-caps`` runs that table alone, e.g.
``python -m bench.remote --shard-size 10 --only-caps --caps 0.75,0.5 --windows 8,16 --cap-runs 3``.

``--only-folder``: the photos as loose objects (an ImageFolder prefix in moto, behind its GET
counter): a fresh service, epoch 0 on a cold cache and epoch 1 warm, img/s and the GETs of each
epoch; with a cap that holds them (cache units) and one below them (read straight, what every
epoch cost before loose images were cached); the same photos from local disk beside them.

``--only-start``: time to first batch on a prefix of ``--start-shards`` small shards (moto,
loopback): from launching ``loader-service serve`` on an empty cache to the first batch in the
client, with and without the index file beside the shards, and the GETs made by then.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import psutil

from bench.harness import command, log, machine, raise_on_sigterm, save_json, start_service, table_head, table_row
from client import RemoteLoader
from loader_service.sources import open_path
from loader_service.sources.remote.store import RemoteSettings
from testkit.stores import TEST_KEY, MotoServer, RangeHTTPServer

PHOTOS = os.path.expanduser("~/.cache/remote-loader/photos/imagenet")
BUCKET = "bench"


def pack(photos: str, out: str, shard_size: int) -> int:
    """``loader-service pack`` the ImageFolder ``photos`` into ``out``; its bytes of shards."""
    subprocess.run([sys.executable, "-m", "loader_service", "pack", photos, out, "--format", "webdataset",
                    "--shard-size", str(shard_size), "--quiet"], check=True, stdout=subprocess.DEVNULL)
    return sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.endswith(".tar"))


def folder_bytes(folder: str) -> int:
    """Bytes of the files in ``folder`` (the shard cache's disk use: blocks allocated)."""
    if not os.path.isdir(folder):
        return 0
    return sum(os.stat(os.path.join(folder, n)).st_blocks * 512 for n in os.listdir(folder))


def timed_epoch(loader, epoch: int) -> float:
    """img/s of one whole epoch."""
    loader.set_epoch(epoch)
    n, t0 = 0, time.perf_counter()
    for images, _ in loader:
        n += images.shape[0]
    return n / (time.perf_counter() - t0)


def one_run(data_args: List[str], env: Dict[str, str], cache: str, args, extra: List[str] = ()) -> dict:
    """A fresh service on an empty shard folder: img/s of a cold and a warm epoch, cache and memory."""
    shutil.rmtree(os.path.join(cache, "shards"), ignore_errors=True)
    svc = start_service(["--no-demo", "--workers", str(args.workers), *data_args, *extra], env=env)
    try:
        with RemoteLoader(svc.endpoint, batch_size=args.batch_size, image_size=224, seed=1, prefetch=4,
                          shuffle=args.order == "shuffled") as ld:
            cold = timed_epoch(ld, 0)
            warm = timed_epoch(ld, 1)
            procs = svc.processes()
            rss = [p.memory_info().rss for p in procs]
            st = svc.status()
        caches = list(st.get("shard_cache", {}).values())
        c = caches[0] if caches else {}
        return {"cold": cold, "warm": warm, "dispatcher_rss": rss[0], "workers_rss": sum(rss[1:]),
                "workers": len(rss) - 1, "cache_disk": folder_bytes(os.path.join(cache, "shards")),
                "downloads": c.get("misses", 0), "prefetches": c.get("prefetches", 0), "downloaded_bytes": c.get("downloaded_bytes", 0),
                "wait_s": c.get("wait_s", 0.0)}
    finally:
        svc.stop()


def downloads(st: dict) -> int:
    c = next(iter(st["shard_cache"].values()))
    return c["misses"] + c["prefetches"]


def cap_run(url: str, cache: str, cap: int, shuffle: bool, args, window: int = 0) -> dict:
    """A fresh service on an empty shard folder with ``cap`` bytes: downloads and img/s of
    epoch 1 (epoch 0 fills the cache); ``window``: the loader's ``shuffle_window``."""
    shutil.rmtree(os.path.join(cache, "shards"), ignore_errors=True)
    svc = start_service(["--no-demo", "--workers", str(args.workers), "--data", url, "--cache-dir", cache,
                         "--cache-max-gb", f"{cap / 1e9:.6f}"])
    try:
        with RemoteLoader(svc.endpoint, batch_size=args.batch_size, image_size=224, seed=1, prefetch=4,
                          shuffle=shuffle, shuffle_window=window) as ld:
            timed_epoch(ld, 0)
            before = downloads(svc.status())
            rate = timed_epoch(ld, 1)
            c = next(iter(svc.status()["shard_cache"].values()))
        return {"img/s": rate, "downloads": downloads({"shard_cache": {"": c}}) - before, "wait_s": c["wait_s"]}
    finally:
        svc.stop()


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--photos", default=PHOTOS)
    ap.add_argument("--shard-size", type=int, default=50, help="samples per shard")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--http-mbps", type=float, default=40.0,
                    help="the HTTP server paces each response to this many MB/s (a store farther than loopback; 0: "
                         "unpaced)")
    ap.add_argument("--prefetch", type=int, default=8, help="--shard-prefetch of the runs with prefetch")
    ap.add_argument("--order", choices=("shuffled", "sequential"), default="shuffled",
                    help="the first table's sample order (sequential: shard after shard)")
    ap.add_argument("--caps", default="1.2,0.75,0.5",
                    help="the second table: caps as fractions of the dataset (HTTP source)")
    ap.add_argument("--windows", default="",
                    help="the second table's shuffled rows with these shuffle_window values too (shards), e.g. 8,16")
    ap.add_argument("--cap-runs", type=int, default=1, help="runs of each row of the second table (the median shown)")
    ap.add_argument("--only-caps", action="store_true", help="the second table alone")
    ap.add_argument("--only-folder", action="store_true", help="loose images: cached units vs read straight")
    ap.add_argument("--only-start", action="store_true", help="time to first batch on --start-shards shards")
    ap.add_argument("--start-shards", type=int, default=1000)
    ap.add_argument("--start-cases", default="scan,index", help="scan (no index file), index (with one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    raise_on_sigterm()
    head = f"`{command('bench.remote', argv)}` on {machine()}"
    os.environ.update(TEST_KEY)
    if args.only_folder or args.only_start:
        return (folder_table if args.only_folder else start_table)(args, head)
    work = tempfile.mkdtemp(prefix="bench-remote-")
    results: Dict[str, List[dict]] = {}
    sweep: List[tuple] = []
    try:
        data = os.path.join(work, "data")
        size = pack(args.photos, data, args.shard_size)
        n_shards = len([n for n in os.listdir(data) if n.endswith(".tar")])
        log(f"packed {args.photos}: {n_shards} shards, {size / 1e6:.1f} MB")
        cap = ["--cache-max-gb", f"{2 * size / 1e9:.6f}"]
        with MotoServer() as s3, RangeHTTPServer(work) as http:
            http.faults.bytes_per_s = int(args.http_mbps * 1e6)
            s3.upload_folder(BUCKET, data, "train/")
            sources = {
                "local disk": (["--data", data], {}),
                "S3 (moto)": (["--data", f"s3://{BUCKET}/train/", "--s3-endpoint-url", s3.endpoint], {}),
                f"HTTP (Range, {args.http_mbps:g} MB/s)": (["--data", http.url + "/data/"], {}),
            }
            for name, (data_args, env) in ({} if args.only_caps else sources).items():
                cache = os.path.join(work, "cache-" + name.split()[0].lower())
                full = data_args + ["--cache-dir", cache] + cap
                if name != "local disk":  # the index, made once: each run then starts on the listing alone
                    open_path(data_args[1], remote=RemoteSettings(endpoint_url=s3.endpoint, cache_dir=cache,
                                                                  cache_max_bytes=2 * size)).close()
                modes = [("", [])] if name == "local disk" else [
                    (f", prefetch {args.prefetch}", ["--shard-prefetch", str(args.prefetch)]),
                    (", no prefetch", ["--shard-prefetch", "0"])]
                for r in range(args.runs):
                    for mode, extra in modes:  # interleaved, so a change of the machine's load hits both
                        res = one_run(full, env, cache, args, extra)
                        results.setdefault(name + mode, []).append(res)
                        log(f"{name}{mode} run {r}: cold {res['cold']:.0f} img/s, warm {res['warm']:.0f} img/s, "
                            f"{res['downloads']} downloads + {res['prefetches']} prefetches, "
                            f"cache {res['cache_disk'] / 1e6:.1f} MB")
            caps = [float(c) for c in args.caps.split(",") if c.strip()]
            windows = [int(w) for w in args.windows.split(",") if w.strip()]
            cache = os.path.join(work, "cache-http")
            orders = [("shuffled", True, 0)] + [(f"shuffled, window {w}", True, w) for w in windows] + [
                ("sequential", False, 0)]
            for frac in caps:
                for order, shuffle, window in orders:
                    runs = [cap_run(http.url + "/data/", cache, int(frac * size), shuffle, args, window)
                            for _ in range(args.cap_runs)]
                    res = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                    sweep.append((frac, order, res))
                    log(f"cap {frac:.2f} x dataset, {order}: {runs}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save_json(args.json, {"runs": results, "caps": sweep})
    first = f"cap {2 * size / 1e6:.0f} MB; " if results else ""
    print(f"{head}; {n_shards} shards, {size / 1e6:.1f} MB; {first}{args.workers} decode "
          f"processes; batch {args.batch_size}, {args.order}; median of {args.runs} (load average {os.getloadavg()[0]:.2f} at end)")
    if results:
        print_sources(results)
    if sweep:
        print_sweep(sweep, n_shards, size, args)


def _counting_moto() -> MotoServer:
    try:
        return MotoServer(counting=True)
    except TypeError:  # an older checkout's testkit (the "before" run of --only-start)
        return MotoServer()


def _gets(s3: MotoServer) -> int:
    return s3.gets() if getattr(s3, "counting", False) else -1


def folder_table(args, head: str) -> None:
    """Loose photos in moto: epoch 0 cold and epoch 1 warm, img/s and GETs, cached and read straight."""
    work = tempfile.mkdtemp(prefix="bench-remote-folder-")
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.photos) for f in fs)
    rows: Dict[str, List[dict]] = {}
    try:
        with _counting_moto() as s3:
            s3.upload_folder(BUCKET, args.photos, "photos/", tree=True)
            cases = {"local disk": ["--data", args.photos],
                     "S3 (moto), cap holds them: cache units": [
                         "--data", f"s3://{BUCKET}/photos/", "--s3-endpoint-url", s3.endpoint,
                         "--cache-max-gb", f"{2 * total / 1e9:.6f}"],
                     "S3 (moto), cap below them: read straight": [
                         "--data", f"s3://{BUCKET}/photos/", "--s3-endpoint-url", s3.endpoint,
                         "--cache-max-gb", f"{total / 2e9:.6f}"]}
            for r in range(args.runs):
                for name, data_args in cases.items():  # interleaved
                    cache = os.path.join(work, "cache")
                    shutil.rmtree(os.path.join(cache, "shards"), ignore_errors=True)
                    svc = start_service(["--no-demo", "--workers", str(args.workers), "--cache-dir", cache,
                                         *data_args])
                    try:
                        with RemoteLoader(svc.endpoint, batch_size=args.batch_size, image_size=224, seed=1,
                                          prefetch=4, epoch_lookahead=False) as ld:
                            g0 = _gets(s3)
                            cold = timed_epoch(ld, 0)
                            g1 = _gets(s3)
                            warm = timed_epoch(ld, 1)
                            g2 = _gets(s3)
                    finally:
                        svc.stop()
                    res = {"cold": cold, "warm": warm, "gets0": g1 - g0, "gets1": g2 - g1}
                    rows.setdefault(name, []).append(res)
                    log(f"{name} run {r}: {res}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = sum(len(fs) for _, _, fs in os.walk(args.photos))
    print(f"{head}; {n} photos, {total / 1e6:.1f} MB; {args.workers} decode processes; batch {args.batch_size}, "
          f"shuffled; median of {args.runs} (load average {os.getloadavg()[0]:.2f} at end)\n")
    print(table_head(["source", "epoch 0 (cold) img/s", "GETs in epoch 0", "epoch 1 (warm) img/s",
                      "GETs in epoch 1"], "lrrrr"))
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        remote = name != "local disk"
        print(table_row([name, f"{med['cold']:.0f}", f"{med['gets0']:.0f}" if remote else "-", f"{med['warm']:.0f}",
                         f"{med['gets1']:.0f}" if remote else "-"]))


def start_table(args, head: str) -> None:
    """Time to first batch on ``--start-shards`` small shards in moto, an empty cache each run."""
    from testkit.stores import write_shards

    work = tempfile.mkdtemp(prefix="bench-remote-start-")
    rows: Dict[str, List[dict]] = {}
    try:
        data = os.path.join(work, "data")
        write_shards(data, args.start_shards, 4)
        size = sum(os.path.getsize(os.path.join(data, n)) for n in os.listdir(data))
        cases = [c for c in args.start_cases.split(",") if c]
        with _counting_moto() as s3:
            s3.upload_folder(BUCKET, data, "scan/")
            if "index" in cases:
                from loader_service.sources.remote.webdataset import INDEX_FILE, write_index_file

                write_index_file(data)
                s3.client().upload_file(os.path.join(data, INDEX_FILE), BUCKET, "index/" + INDEX_FILE)
                for name in sorted(os.listdir(data)):
                    if name.endswith(".tar"):
                        s3.client().copy_object(Bucket=BUCKET, Key="index/" + name,
                                                CopySource={"Bucket": BUCKET, "Key": "scan/" + name})
            labels = {"scan": "no index file: every shard read at start", "index": "index file beside the shards"}
            for r in range(args.runs):
                for case in cases:
                    cache = os.path.join(work, f"cache-{case}-{r}")
                    g0, t0 = _gets(s3), time.perf_counter()
                    svc = start_service(["--no-demo", "--workers", str(args.workers), "--cache-dir", cache,
                                         "--data", f"s3://{BUCKET}/{case}/", "--s3-endpoint-url", s3.endpoint])
                    try:
                        ready, gets_ready = time.perf_counter() - t0, _gets(s3) - g0
                        with RemoteLoader(svc.endpoint, batch_size=args.batch_size, image_size=64, seed=1) as ld:
                            next(iter(ld))
                            first = time.perf_counter() - t0
                            gets = _gets(s3) - g0
                    finally:
                        svc.stop()
                    rows.setdefault(labels[case], []).append({"ready": ready, "first": first, "gets": gets,
                                                                  "gets_ready": gets_ready})
                    log(f"{case} run {r}: ready {ready:.2f}s, first batch {first:.2f}s, {gets} GETs")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{head}; {args.start_shards} shards of 4 samples, {size / 1e6:.1f} MB; {args.workers} decode processes; "
          f"batch {args.batch_size}; an empty cache each run; median of {args.runs} (load average "
          f"{os.getloadavg()[0]:.2f} at end)\n")
    print(table_head(["start", "service ready s", "GETs by then", "first batch s", "GETs by then"], "lrrrr"))
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(table_row([name, f"{med['ready']:.2f}", f"{med['gets_ready']:.0f}" if med["gets"] >= 0 else "-",
                         f"{med['first']:.2f}", f"{med['gets']:.0f}" if med["gets"] >= 0 else "-"]))


def print_sources(results: Dict[str, List[dict]]) -> None:
    print()
    print(table_head(["source", "cold cache img/s", "warm cache img/s", "downloads: reads + prefetch", "cache on disk MB",
                      "dispatcher RSS MB", "decode processes RSS MB"], "lrrrrrr"))
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        remote = name != "local disk"
        dl = f"{med['downloads']:.0f} + {med['prefetches']:.0f}"
        print(table_row([name, f"{med['cold']:.0f}", f"{med['warm']:.0f}",
                         dl if remote else "-",
                         f"{med['cache_disk'] / 1e6:.1f}" if remote else "-",
                         f"{med['dispatcher_rss'] / 1e6:.0f}", f"{med['workers_rss'] / 1e6:.0f}"]))


def print_sweep(sweep: List[tuple], n_shards: int, size: int, args) -> None:
    print(f"\nA cap below the dataset (HTTP source, {args.http_mbps:g} MB/s; epoch 1 after epoch 0 filled the cache; {n_shards} shards "
          f"of {size / n_shards / 1e6:.2f} MB, {args.workers} decode processes each holding up to 2 shards open; "
          f"median of {args.cap_runs}):\n")
    print(table_head(["cap / dataset", "order", "downloads in the epoch", "downloaded / dataset", "img/s",
                      "reads waited s (2 epochs)"], "llrrrr"))
    for frac, order, r in sweep:
        print(table_row([f"{frac:.2f}", order, int(r["downloads"]),
                         f"{r['downloads'] / n_shards:.1f}x", f"{r['img/s']:.0f}", f"{r['wait_s']:.1f}"]))


if __name__ == "__main__":
    main()
