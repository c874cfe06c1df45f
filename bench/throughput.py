"""Throughput benchmark: the loader service + RemoteLoader against a torch DataLoader and
against the raw decode limit of the same machine.

    python -m bench.throughput [--data DIR] [--workers N] [--batch-size 64] [--epochs 2]
                               [--image-size 224] [--demo-size 2000] [--json PATH]
                               [--runs 3] [--step-ms 50] [--sweep-workers 1,2] [--sweep-prefetch 1,2,4]
                               [--sweep-step 0,30,60]

Every contender does exactly the same work: the same images (the embedded demo set by
default, or any ImageFolder / packed folder given with ``--data``), in the same plan order
(``wire.plan.make_plan``), each sample decoded and augmented by the same
``process_sample`` (RandomResizedCrop + flip) with the same ``sample_rng(seed, epoch, index)``,
by the same number N of decode processes (default: the CPU count). Epoch 0 is a warm-up and
is not timed; the timed epochs are 1..``--epochs``.

Contenders:

1. **raw limit**: N spawned processes, each decoding an even share of all timed epochs'
   samples into a preallocated numpy batch buffer. No transport, no scheduling, perfect
   balance: the most this machine can decode. Timed from the moment all N are ready (they
   signal after start-up and a one-batch warm-up) until the last one finishes.
2. **torch DataLoader**: a map-style Dataset (memory-mapped / shared-memory index) whose
   ``__getitem__`` runs ``process_sample``; default collate, ``num_workers=N``,
   ``persistent_workers=True``.
3. **service + RemoteLoader**: ``python -m loader_service serve --workers N`` as a separate
   process, consumed by a ``RemoteLoader`` in this process (prefetch ``max(4, 2N)`` batches,
   so that all N workers can be busy).

How to read the table:

* ``images/s``: samples delivered to the consuming loop during the timed epochs, divided by
  their wall time. The loop only counts the batches; it does not touch their pixels, unless
  ``--step-ms`` gives it a simulated training step: a sleep of that long after every batch (a
  sleep, not a busy loop: a GPU step leaves the trainer's CPU idle, and on a small machine a
  busy loop would take a core from the decoders). Without a step the loop always waits for
  data, so the client stall is ~100% of wall time at every prefetch depth.
* ``--runs N``: every contender N times (interleaved); each row is the run with the median
  images/s (the upper median for an even N), and the runs' images/s are listed.
* ``% of raw limit``: how much of the machine's decode capacity the contender delivers.
* ``trainer CPU s / 1000 img``: CPU seconds (user + system, from psutil, sampled before and
  after the timed epochs while every process involved is alive) spent on the *trainer* per
  1000 images. For the DataLoader that is this process plus its worker processes (they decode
  on the trainer); for the service it is this process only (in production the service runs on
  other nodes). The raw limit's figure, in parentheses, is its decode processes' CPU: the cost
  of the decoding itself, for reference.

On a single machine the service, its workers and the client share the same cores, so the
service's row is a conservative figure for a disaggregated deployment; the CPU column shows
what moves off the trainer. The PASS/MISS lines check the project's targets; the exit status
does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import List, Optional

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from bench import plots
from bench.harness import (START_TIMEOUT_S, command, cpu_seconds, log, machine, raise_on_sigterm, run_epochs,
                           start_service, table_head, table_row, train_step, upper_median, warm_page_cache)
from client import RemoteLoader
from loader_service.decode.transforms import TransformSpec, process_sample, random_resized_crop_params, sample_rng
from loader_service.sources import Source, SourceSpec, open_source
from loader_service.sources.demo import ensure_demo
from loader_service.sources.imagefolder import ImageFolderSource
from loader_service.sources.packed import PackedSource
from wire.plan import PlanSpec, RankPlan, make_plan

SEED = 0

PLOT_NAME = "bench_throughput"  # results/bench_throughput.png and its -workers / -prefetch figures
RAW, DATALOADER, SERVICE = "raw_limit", "torch_dataloader", "service_client"
LABELS = {RAW: "raw limit (no transport)", DATALOADER: "torch DataLoader", SERVICE: "service + RemoteLoader"}


@dataclass(frozen=True)
class Settings:
    """What every contender is given. Small and picklable (it travels to spawned processes)."""

    source: SourceSpec
    length: int
    workers: int
    batch_size: int
    image_size: int
    epochs: int  # timed epochs 1..epochs; epoch 0 is the warm-up
    seed: int = SEED
    fn: str = "service"  # the per-sample function of the raw and DataLoader rows: a key of SAMPLE_FNS
    step_s: float = 0.0  # simulated training step after every batch (DataLoader and service loops)

    @property
    def transform(self) -> TransformSpec:
        return TransformSpec(self.image_size)  # train: RandomResizedCrop(image_size) + flip

    def plan(self, epoch: int) -> RankPlan:
        return make_plan(PlanSpec(self.length, self.batch_size, self.seed, epoch))

    @property
    def timed_epochs(self) -> range:
        return range(1, self.epochs + 1)

    @property
    def expected_samples(self) -> int:
        return sum(self.plan(e).num_samples for e in self.timed_epochs)


@dataclass
class Result:
    name: str
    processes: int
    samples: int
    seconds: float
    trainer_cpu_s: Optional[float]  # None for the raw limit: there is no trainer
    all_cpu_s: float  # every process involved, the trainer's and the decoders'
    extra: dict

    @property
    def images_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def per_1000(self, cpu_s: Optional[float]) -> Optional[float]:
        return None if cpu_s is None or not self.samples else 1000.0 * cpu_s / self.samples


# ------------------------------------------------------------------------ per-sample functions
def naive_sample(data: bytes, spec: TransformSpec, rng: np.random.Generator, out: np.ndarray) -> None:
    """What a user writes without the project (the fixed reference of issue 11; do not replace it
    with project code): simplejpeg full-size decode, slice the RandomResizedCrop box, cv2.resize
    bilinear, flip. Same crop box and flip draws as the service."""
    import cv2
    import simplejpeg

    img = simplejpeg.decode_jpeg(data)
    top, left, ch, cw = random_resized_crop_params(img.shape[0], img.shape[1], spec.scale, spec.ratio, rng)
    flip = spec.flip and rng.random() < 0.5
    cv2.resize(img[top:top + ch, left:left + cw], (spec.image_size, spec.image_size), dst=out,
               interpolation=cv2.INTER_LINEAR)
    if flip:
        out[:] = out[:, ::-1]


def pil_sample(data: bytes, spec: TransformSpec, rng: np.random.Generator, out: np.ndarray) -> None:
    """A torchvision-style PIL pipeline: open, convert RGB, crop, resize bilinear, flip."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("RGB")
        top, left, ch, cw = random_resized_crop_params(im.height, im.width, spec.scale, spec.ratio, rng)
        flip = spec.flip and rng.random() < 0.5
        im = im.resize((spec.image_size, spec.image_size), Image.BILINEAR, box=(left, top, left + cw, top + ch))
        if flip:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        out[:] = np.asarray(im)


SAMPLE_FNS = {"service": process_sample, "naive": naive_sample, "pil": pil_sample}


# ---------------------------------------------------------------------------------- raw limit
def _raw_worker(rank: int, settings: Settings, ctl, go, leave) -> None:
    """One raw decode process: warm up, say ready, decode its share when told, report, wait."""
    source = None
    try:
        source = open_source(settings.source)
        spec, bs, s = settings.transform, settings.batch_size, settings.image_size
        buf = np.empty((bs, s, s, 3), np.uint8)
        plans = [(e, settings.plan(e)) for e in settings.timed_epochs]
        epochs = np.concatenate([np.full(p.num_samples, e, np.int64) for e, p in plans])
        indices = np.concatenate([p.indices[: p.num_samples] for _, p in plans])
        mine = np.array_split(np.arange(len(indices)), settings.workers)[rank]
        for j, idx in enumerate(settings.plan(0).indices[:bs]):  # warm-up, not timed
            SAMPLE_FNS[settings.fn](source.read(int(idx)), spec, sample_rng(settings.seed, 0, int(idx)), buf[j])
        ctl.put(("ready", rank, None))
        go.wait()
        if leave.is_set():  # the parent gave up before the start
            return
        for start in range(0, len(mine), bs):
            for j, k in enumerate(mine[start : start + bs]):
                idx = int(indices[k])
                SAMPLE_FNS[settings.fn](source.read(idx), spec, sample_rng(settings.seed, int(epochs[k]), idx), buf[j])
        ctl.put(("done", rank, len(mine)))
        leave.wait()  # stay alive until the parent has read our CPU times
    except KeyboardInterrupt:
        pass
    except BaseException:
        ctl.put(("error", rank, traceback.format_exc()))
    finally:
        if source is not None:
            source.close()


def _collect(ctl, kind: str, procs, timeout: Optional[float]) -> list:
    """One ``kind`` message from every raw process; raises if one fails or dies."""
    got: list = []
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            msg = ctl.get(timeout=0.5)
        except queue.Empty:
            for p in procs:
                if p.exitcode is not None:
                    raise RuntimeError(f"raw decode process {p.name} exited with code {p.exitcode}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"raw decode processes not {kind} after {timeout:.0f}s")
            continue
        if msg[0] == "error":
            raise RuntimeError(f"raw decode process {msg[1]} failed:\n{msg[2]}")
        got.append(msg)
    return got


def bench_raw(settings: Settings) -> Result:
    ctx = mp.get_context("spawn")
    ctl, go, leave = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_raw_worker, args=(r, settings, ctl, go, leave), name=f"raw-decode-{r}")
             for r in range(settings.workers)]
    try:
        for p in procs:
            p.start()
        _collect(ctl, "ready", procs, START_TIMEOUT_S)
        ps = [psutil.Process(p.pid) for p in procs]
        cpu0, t0 = cpu_seconds(ps), time.perf_counter()
        go.set()
        done = _collect(ctl, "done", procs, None)
        t1 = time.perf_counter()
        cpu = cpu_seconds(ps) - cpu0  # they are waiting on `leave`: still alive
        leave.set()
        samples = sum(m[2] for m in done)
        return Result(RAW, settings.workers, samples, t1 - t0, None, cpu, {"start_method": "spawn"})
    finally:
        leave.set()
        go.set()  # releases processes still waiting for the start: they see `leave` and exit
        deadline = time.monotonic() + 2.0  # done or waiting: they exit at once; mid-decode: terminated
        for p in procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        ctl.close()
        ctl.join_thread()


# ----------------------------------------------------------------------------- torch DataLoader
class PlanSampler(Sampler):
    """The service's plan order for the current epoch, as ``(epoch, index)`` keys.

    The key carries the epoch so that persistent workers (which keep their own copy of the
    dataset) seed each sample exactly as the service does."""

    def __init__(self, settings: Settings):
        self.settings, self.epoch = settings, 0
        self._len = settings.plan(0).num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        plan, epoch = self.settings.plan(self.epoch), self.epoch
        return ((epoch, int(i)) for i in plan.indices[: plan.num_samples])


class DecodeDataset(Dataset):
    """Map-style dataset: read the bytes, ``process_sample`` into a uint8 HWC tensor.

    Holds only the source's spec; each worker opens the source itself on first use, which
    memory-maps a packed dataset or attaches the shared-memory index of an ImageFolder, so no
    per-sample Python objects are copied into the workers."""

    def __init__(self, settings: Settings):
        self.settings, self.spec = settings, settings.transform
        self._source: Optional[Source] = None

    def __len__(self) -> int:
        return self.settings.length

    def __getitem__(self, key):
        epoch, index = key
        if self._source is None:
            self._source = open_source(self.settings.source)
        s = self.settings.image_size
        out = np.empty((s, s, 3), np.uint8)
        SAMPLE_FNS[self.settings.fn](self._source.read(index), self.spec, sample_rng(self.settings.seed, epoch, index),
                                     out)
        return torch.from_numpy(out), int(self._source.labels[index])


def bench_dataloader(settings: Settings) -> Result:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    sampler = PlanSampler(settings)
    loader = DataLoader(DecodeDataset(settings), batch_size=settings.batch_size, sampler=sampler,
                        num_workers=settings.workers, persistent_workers=True)
    workers: List[psutil.Process] = []
    try:
        sampler.set_epoch(0)
        for _ in loader:  # warm-up: starts the persistent workers
            pass
        workers = [p for p in me.children(recursive=True) if p.pid not in before]
        if len(workers) != settings.workers:
            log(f"warning: expected {settings.workers} DataLoader worker processes, found {len(workers)}")
        procs = [me] + workers
        cpu0, t0 = cpu_seconds(procs), time.perf_counter()
        samples = 0
        for epoch in settings.timed_epochs:
            sampler.set_epoch(epoch)
            for images, labels in loader:
                samples += images.shape[0]
                train_step(settings.step_s)
        t1 = time.perf_counter()
        cpu = cpu_seconds(procs) - cpu0
        start_method = loader.multiprocessing_context or mp.get_start_method()
        if not isinstance(start_method, str):
            start_method = start_method.get_start_method()
        return Result(DATALOADER, settings.workers, samples, t1 - t0, cpu, cpu, {"start_method": start_method})
    finally:
        _shutdown_dataloader(loader, workers)


def _shutdown_dataloader(loader: DataLoader, workers: List[psutil.Process]) -> None:
    """Stop persistent workers now (not whenever the loader is garbage-collected)."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    loader._iterator = None
    _, alive = psutil.wait_procs(workers, timeout=10)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=5)


# --------------------------------------------------------------------- service + RemoteLoader
def bench_service(settings: Settings, dataset_args: List[str], prefetch: Optional[int] = None) -> Result:
    prefetch = prefetch or max(4, 2 * settings.workers)
    svc = start_service([*dataset_args, "--workers", str(settings.workers)])
    try:
        with RemoteLoader(svc.endpoint, batch_size=settings.batch_size, image_size=settings.image_size,
                          seed=settings.seed, prefetch=prefetch) as loader:
            run = run_epochs(loader, svc, settings.timed_epochs, settings.step_s)
        extra = {"service_cpu_s": run.service_cpu_s, "prefetch": prefetch, "endpoint": svc.endpoint,
                 "client_stall_s": run.stall_s, "service_processes": run.service_processes}
        return Result(SERVICE, settings.workers, run.samples, run.seconds, run.client_cpu_s,
                      run.client_cpu_s + run.service_cpu_s, extra)
    finally:
        svc.stop()


# ----------------------------------------------------------------------------------- report
def fmt(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(results: dict, header: dict, all_runs: Optional[dict] = None) -> List[dict]:
    """Print the table (``results``: the median run per contender; ``all_runs``: every run, listed
    when there are several) and the target checks; return the checks."""
    raw = results[RAW]
    several = all_runs is not None and any(len(rs) > 1 for rs in all_runs.values())
    print(f"\nmachine: {header['machine']} | dataset: {header['dataset']} | images: {header['images']} | "
          f"batch size: {header['batch_size']} | image size: {header['image_size']} | "
          f"epochs: {header['epochs']} timed (+1 warm-up) | training step: {header['step_ms']:g} ms per batch | "
          f"runs: {header['runs']} (median) | command: `{header['command']}`\n")
    print(table_head(["contender", "decode processes", "images/s", "% of raw limit", "trainer CPU s / 1000 img"]
                     + (["images/s each run"] if several else []), "lrrrr" + ("l" if several else "")))
    for name, r in results.items():
        pct = 100.0 * r.images_per_s / raw.images_per_s if raw.images_per_s else 0.0
        cpu = f"({fmt(r.per_1000(r.all_cpu_s))})" if name == RAW else fmt(r.per_1000(r.trainer_cpu_s))
        each = [_each(x.images_per_s for x in all_runs[name])] if several else []
        print(table_row([LABELS[name], r.processes, f"{r.images_per_s:.1f}", f"{pct:.1f}%", cpu, *each]))
    svc = results[SERVICE]
    print(f"\n(raw limit: CPU of its decode processes, for reference.) CPU s / 1000 img, all processes: "
          + ", ".join(f"{LABELS[n]} {fmt(r.per_1000(r.all_cpu_s))}" for n, r in results.items())
          + f" (service side {fmt(svc.per_1000(svc.extra['service_cpu_s']))}). "
          + f"Client stall: {svc.extra['client_stall_s']:.2f}s of {svc.seconds:.2f}s.\n")

    dl = results[DATALOADER]
    svc_cpu, dl_cpu = svc.per_1000(svc.trainer_cpu_s) or 0.0, dl.per_1000(dl.trainer_cpu_s) or 0.0
    checks = [
        {"target": "service+client >= 90% of raw limit", "pass": svc.images_per_s >= 0.9 * raw.images_per_s,
         "detail": f"{100.0 * svc.images_per_s / max(raw.images_per_s, 1e-9):.1f}% "
                   f"({svc.images_per_s:.1f} vs {raw.images_per_s:.1f} img/s)"},
        {"target": "service+client > DataLoader", "pass": svc.images_per_s > dl.images_per_s,
         "detail": f"{svc.images_per_s:.1f} vs {dl.images_per_s:.1f} img/s"},
        {"target": "trainer CPU per image: client <= DataLoader / 10", "pass": svc_cpu <= dl_cpu / 10,
         "detail": f"{svc_cpu:.3f} vs {dl_cpu:.3f} s / 1000 img"
                   + (f" ({dl_cpu / svc_cpu:.1f}x less)" if svc_cpu > 0 else "")},
    ]
    for c in checks:
        print(f"{'PASS' if c['pass'] else 'MISS'} {c['target']}: {c['detail']}")
    return checks


def to_json(results: dict, header: dict, checks: List[dict]) -> dict:
    raw = results[RAW].images_per_s
    out = dict(header)
    out["contenders"] = {
        name: {"label": LABELS[name], "decode_processes": r.processes, "samples": r.samples,
               "seconds": r.seconds, "images_per_s": r.images_per_s,
               "pct_of_raw_limit": 100.0 * r.images_per_s / raw if raw else 0.0,
               "trainer_cpu_s": r.trainer_cpu_s, "trainer_cpu_s_per_1000_img": r.per_1000(r.trainer_cpu_s),
               "all_cpu_s": r.all_cpu_s, "all_cpu_s_per_1000_img": r.per_1000(r.all_cpu_s), **r.extra}
        for name, r in results.items()
    }
    out["targets"] = checks
    return out


# ------------------------------------------------------------------------------------- main
def open_dataset(args) -> "tuple[Source, List[str], str]":
    """The source, the service's dataset arguments, and a description."""
    if args.data:
        path = os.path.abspath(args.data)
        if os.path.exists(os.path.join(path, "meta.json")):
            return PackedSource(path), ["--data", path], f"packed {path}"
        return ImageFolderSource.scan(path), ["--data", path], f"ImageFolder {path}"
    src = ensure_demo(args.demo_size)
    return src, ["--demo", "--demo-size", str(args.demo_size)], f"demo ({src.path})"


def main(argv: Optional[List[str]] = None) -> int:
    raise_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", metavar="DIR", help="ImageFolder or packed dataset (default: the embedded demo set)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decode processes, every contender")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs (after one warm-up epoch)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--demo-size", type=int, default=2000, help="images in the demo set (without --data)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--runs", type=int, default=1, help="run every contender this many times; rows are medians")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="simulated training step: sleep this long after every batch (DataLoader and service)")
    p.add_argument("--plot", metavar="PNG", help="the figure of the table (default: next to --json, else "
                                                 "results/bench_throughput.png); sweeps add -workers / -prefetch")
    p.add_argument("--sweep-workers", metavar="N,N,...", type=_int_list,
                   help="also run every contender at each of these decode process counts (a table and a figure)")
    p.add_argument("--sweep-prefetch", metavar="N,N,...", type=_int_list,
                   help="also run the service at each of these client prefetch depths: img/s and client stall")
    p.add_argument("--sweep-step", metavar="MS,MS,...", type=_ms_list,
                   help="run the prefetch sweep at each of these training steps (default: --step-ms); a line each")
    args = p.parse_args(argv)
    for name in ("workers", "batch_size", "epochs", "image_size", "demo_size", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.step_ms < 0:
        p.error("--step-ms must be >= 0")

    command_line = command("bench.throughput", argv)
    try:
        source, dataset_args, description = open_dataset(args)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    try:
        nbytes = warm_page_cache(source)
        settings = Settings(source.spec(), len(source), args.workers, args.batch_size, args.image_size, args.epochs,
                            step_s=args.step_ms / 1000)
        header = {"machine": machine(), "dataset": description, "images": len(source),
                  "mean_image_kb": nbytes / max(len(source), 1) / 1024, "batch_size": args.batch_size,
                  "image_size": args.image_size, "epochs": args.epochs, "workers": args.workers,
                  "expected_samples": settings.expected_samples, "runs": args.runs, "step_ms": args.step_ms,
                  "command": command_line}
        log(f"benchmark: {len(source)} images ({header['mean_image_kb']:.0f} KB each on average), "
            f"{args.workers} decode processes, batch {args.batch_size}, {args.epochs} timed epochs, "
            f"{args.runs} run(s), training step {args.step_ms:g} ms per batch")
        workers_sweep = {w: run_contenders(replace(settings, workers=w), dataset_args, args.runs)
                         for w in args.sweep_workers or ()}
        # the main table is the sweep's row for --workers when there is one: the same measurement
        all_runs = workers_sweep.get(args.workers) or run_contenders(settings, dataset_args, args.runs)
        prefetch_sweep: dict = {}  # {step ms: {prefetch: [Result per run]}}
        for step_ms in (args.sweep_step or [args.step_ms]) if args.sweep_prefetch else ():
            prefetch_sweep[step_ms] = {}
            for n in args.sweep_prefetch:
                prefetch_sweep[step_ms][n] = []
                for r in range(args.runs):
                    log(f"running {LABELS[SERVICE]} with prefetch {n}, step {step_ms:g} ms (run {r + 1}/{args.runs}) ...")
                    prefetch_sweep[step_ms][n].append(
                        bench_service(replace(settings, step_s=step_ms / 1000), dataset_args, prefetch=n))
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        source.close()
    results = {n: median_run(rs) for n, rs in all_runs.items()}
    checks = report(results, header, all_runs)
    out = to_json(results, header, checks)
    if args.runs > 1:
        out["runs_images_per_s"] = {n: [r.images_per_s for r in rs] for n, rs in all_runs.items()}
    step = f", training step {args.step_ms:g} ms per batch" if args.step_ms else ""
    note = (f"{header['machine']}; {header['dataset']}; batch {args.batch_size}, {args.image_size} px, "
            f"{args.epochs} timed epochs{step}; median of {args.runs} run(s); {command_line}")
    plots.bars(plots.png_path(args.plot, args.json, PLOT_NAME), f"images/s with {args.workers} decode processes",
               {LABELS[n]: r.images_per_s for n, r in results.items() if n != RAW}, "images/s", note,
               reference=("raw decode limit", results[RAW].images_per_s))
    if workers_sweep:
        out["sweep_workers"] = report_workers(workers_sweep)
        plots.lines(plots.png_path(args.plot, args.json, PLOT_NAME, "-workers"), "images/s by decode processes",
                    "decode processes", "images/s",
                    {LABELS[n]: (list(workers_sweep), [median_run(r[n]).images_per_s for r in workers_sweep.values()])
                     for n in LABELS}, note)
    if prefetch_sweep:
        out["sweep_prefetch"] = report_prefetch(prefetch_sweep, args.batch_size)
        plots.lines(plots.png_path(args.plot, args.json, PLOT_NAME, "-prefetch"),
                    f"client stall by prefetch depth, service + RemoteLoader ({args.workers} decode processes)",
                    "prefetch (batches)", "client stall, % of wall time",
                    {_step_label(ms, args.batch_size): (list(by_n), [upper_median(_stall_pct(r) for r in rs)
                                                                     for rs in by_n.values()])
                     for ms, by_n in prefetch_sweep.items()}, note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def run_contenders(settings: Settings, dataset_args: List[str], runs: int = 1) -> dict:
    """Every contender ``runs`` times, interleaved (a slow spell on a shared machine hits all of
    them): {name: [Result per run]}."""
    results: dict = {name: [] for name in LABELS}
    for i in range(runs):
        for name, run in ((RAW, lambda: bench_raw(settings)), (DATALOADER, lambda: bench_dataloader(settings)),
                          (SERVICE, lambda: bench_service(settings, dataset_args))):
            log(f"running {LABELS[name]} with {settings.workers} decode processes (run {i + 1}/{runs}) ...")
            r = run()
            results[name].append(r)
            if r.samples != settings.expected_samples:
                log(f"warning: {LABELS[name]} delivered {r.samples} samples, expected {settings.expected_samples}")
            log(f"  {r.images_per_s:.1f} img/s ({r.samples} images in {r.seconds:.2f}s)")
    return results


def median_run(runs: List[Result]) -> Result:
    """The run with the median images/s (the upper median for an even count)."""
    return sorted(runs, key=lambda r: r.images_per_s)[len(runs) // 2]


def _each(values) -> str:
    return " / ".join(f"{v:.0f}" for v in values)


def _stall_pct(r: Result) -> float:
    return 100.0 * r.extra["client_stall_s"] / r.seconds if r.seconds > 0 else 0.0


def report_workers(sweep: dict) -> list:
    """Print the scaling table (medians, and each run's images/s when there are several); return its rows."""
    several = any(len(rs) > 1 for results in sweep.values() for rs in results.values())
    print("\n" + table_head(["decode processes"] + [f"{LABELS[n]} img/s" + (" (runs)" if several else "") for n in LABELS],
                            "r" * (1 + len(LABELS))))
    rows = []
    for w, results in sweep.items():
        med = {n: median_run(results[n]).images_per_s for n in LABELS}
        cells = [f"{med[n]:.1f}" + (f" ({_each(r.images_per_s for r in results[n])})" if several else "")
                 for n in LABELS]
        print(table_row([w, *cells]))
        rows.append({"workers": w, **med})
    return rows


def _step_label(step_ms: float, batch_size: int) -> str:
    if not step_ms:
        return "no training step"
    return f"step {step_ms:g} ms / batch (at most {1000 * batch_size / step_ms:,.0f} img/s)"


def report_prefetch(sweep: dict, batch_size: int) -> list:
    """Print the prefetch table, {step ms: {prefetch: [Result per run]}} (medians over the runs,
    each run's stall % listed); return its rows."""
    print("\n" + table_head(["training step (ms per batch)", "prefetch (batches)", "service + RemoteLoader img/s",
                             "client stall s", "stall % of wall time", "stall % each run"], "rrrrrl"))
    rows = []
    for step_ms, by_n in sweep.items():
        for n, rs in by_n.items():
            ips, stall_s = upper_median(r.images_per_s for r in rs), upper_median(r.extra["client_stall_s"] for r in rs)
            pct = upper_median(_stall_pct(r) for r in rs)
            print(table_row([f"{step_ms:g}", n, f"{ips:.1f}", f"{stall_s:.2f}", f"{pct:.1f}%",
                             " / ".join(f"{_stall_pct(r):.1f}" for r in rs)]))
            rows.append({"step_ms": step_ms, "prefetch": n, "images_per_s": ips, "client_stall_s": stall_s,
                         "stall_pct": pct, "runs_stall_pct": [_stall_pct(r) for r in rs]})
    return rows


def _number_list(text: str, cast, minimum, what: str) -> list:
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} separated by commas, got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected {what} >= {minimum}, got {text!r}")
    return values


def _int_list(text: str) -> List[int]:
    return _number_list(text, int, 1, "numbers")


def _ms_list(text: str) -> List[float]:
    return _number_list(text, float, 0, "milliseconds")


if __name__ == "__main__":
    sys.exit(main())
