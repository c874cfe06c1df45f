"""Real-photo throughput: the decode kernel against the naive code a user would write.

    python -m bench.photo_sets                          # build the sets once
    python -m bench.photos [--photos ~/.cache/remote-loader/photos] [--runs 3] [--workers 2]
                           [--plot results/photos.png]

On each size group (``imagenet/``: ~500x375; ``camera/``: 4000x3000), in one run, the same
samples, plan order, crop boxes and flips (RandomResizedCrop(224) + flip), N decode processes
everywhere:

1. **naive, raw**: ``bench.throughput.naive_sample`` (simplejpeg full decode, slice, cv2.resize
   bilinear) in N processes, no transport: the fixed reference every ratio is against.
2. **DataLoader, naive**: the same function in a torch DataLoader, N workers.
3. **DataLoader, PIL**: a torchvision-style PIL pipeline in a DataLoader, N workers.
4. **service decode loop**: the service's ``process_sample`` in N processes, no transport.
5. **service + RemoteLoader**: the real service (N workers) and client, on the same machine.

Each row is the median of ``--runs`` runs (contenders interleaved within a run). Prints a
markdown table per group and the issue's target checks (the exit status does not depend on them),
and draws each group's table as bars (``--plot`` base name + ``-<group>.png``, default
``results/bench_photos-<group>.png``; the naive raw reference is the dashed line).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from dataclasses import replace

from bench import plots
from bench import throughput as B
from bench.harness import command, log, machine, print_verdicts, table_head, table_row, warm_page_cache
from loader_service.decode.jpeg import decode_path
from loader_service.sources.imagefolder import ImageFolderSource

PREPARED = "-rst"  # python -m bench.photo_sets --prepared: the same photos after `loader-service prepare-jpegs`
ROWS = [("naive", "naive, raw (reference)"), ("dl_naive", "torch DataLoader, naive function"),
        ("dl_pil", "torch DataLoader, PIL pipeline"), ("loop", "service decode loop (no transport)"),
        ("service", "service + RemoteLoader")]


def parse_epochs(text: str) -> dict:
    """``imagenet:4,camera:1`` -> {"imagenet": 4, "camera": 1}."""
    return dict((k, int(v)) for k, v in (e.split(":") for e in text.split(",")))


@contextlib.contextmanager
def photo_group(photos: str, group: str, epochs: dict, workers: int, batch_size: int):
    """The photo set ``group`` under ``photos``, every file read once (page cache warm): yields
    (its Settings, its bytes in all, its path) and closes it after. Timed epochs: ``epochs[group]``
    (a prepared set, ``imagenet-rst``, takes its original's)."""
    path = os.path.join(photos, group)
    source = ImageFolderSource.scan(path)
    try:
        nbytes = warm_page_cache(source)
        timed = epochs.get(group, epochs.get(group.split("-")[0], 1))
        yield B.Settings(source.spec(), len(source), workers, batch_size, 224, timed), nbytes, path
    finally:
        source.close()


def run_once(settings: B.Settings, dataset_args) -> dict:
    return {
        "naive": B.bench_raw(replace(settings, fn="naive")),
        "dl_naive": B.bench_dataloader(replace(settings, fn="naive")),
        "dl_pil": B.bench_dataloader(replace(settings, fn="pil")),
        "loop": B.bench_raw(settings),
        "service": B.bench_service(settings, dataset_args),
    }


def photo_args(p: argparse.ArgumentParser, batch_size: int, epochs: str) -> None:
    """The options every real-photo benchmark takes: --photos, --groups, --runs, --batch-size, --epochs."""
    p.add_argument("--photos", default=os.path.expanduser("~/.cache/remote-loader/photos"))
    p.add_argument("--groups", default="imagenet,camera",
                   help="sets under --photos; imagenet-rst,camera-rst are the prepared copies (bench.photo_sets --prepared)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--epochs", default=epochs, help="timed epochs per group (a prepared set, "
                   "imagenet-rst, takes its original's)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    photo_args(p, 32, "imagenet:4,camera:1")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--plot", metavar="PNG", help="figure base name: one PNG per group, suffixed -<group>")
    args = p.parse_args(argv)
    epochs = parse_epochs(args.epochs)
    command_line = command("bench.photos", argv)
    mach = machine()
    print(f"machine: {mach} | decode path: {decode_path()} | command: `{command_line}`")
    verdicts = []
    medians = {}
    for group in args.groups.split(","):
        with photo_group(args.photos, group, epochs, args.workers, args.batch_size) as (settings, nbytes, path):
            runs = []
            for r in range(args.runs):
                log(f"{group}: run {r + 1}/{args.runs}")
                runs.append(run_once(settings, ["--data", path]))
                log("  " + ", ".join(f"{k} {v.images_per_s:.0f}" for k, v in runs[-1].items()))
        count = settings.length
        med = medians[group] = {k: statistics.median(run[k].images_per_s for run in runs) for k, _ in ROWS}
        print(f"\n### {group}: {count} photos, {nbytes / count / 1024:.0f} KiB mean, "
              f"{settings.expected_samples} samples timed per run, median of {args.runs} runs\n")
        print(table_head(["contender", "img/s (median)", "runs", "vs naive raw"], "lrlr"))
        for k, label in ROWS:
            each = " / ".join(f"{run[k].images_per_s:.0f}" for run in runs)
            print(table_row([label, f"{med[k]:.0f}", each, f"{med[k] / med['naive']:.2f}x"]))
        plots.bars(plots.png_path(args.plot, None, "bench_photos", f"-{group}"),
                   f"{group}: images/s, {args.workers} decode processes (median of {args.runs})",
                   {label: med[k] for k, label in ROWS if k != "naive"}, "images/s",
                   f"{mach}; {count} photos, {nbytes / count / 1024:.0f} KiB mean; batch {args.batch_size}, "
                   f"224 px, {settings.epochs} timed epoch(s); {command_line}",
                   reference=("naive, raw (reference)", med["naive"]))
        target = 1.2 if group.startswith("imagenet") else 3.0
        verdicts.append((f"{group}: service + RemoteLoader >= {target}x naive raw", med["service"] / med["naive"] >= target,
                         f"{med['service'] / med['naive']:.2f}x"))
        original = group[:-len(PREPARED)] if group.endswith(PREPARED) else None
        if original in medians:  # the user's own comparison: their files as they were vs the service on prepared ones
            ref = medians[original]["naive"]
            verdicts.append((f"{group}: service + RemoteLoader >= {target}x naive raw on {original} (the files before "
                             "prepare-jpegs)", med["service"] / ref >= target, f"{med['service'] / ref:.2f}x"))
        verdicts.append((f"{group}: service + RemoteLoader >= 1.3x DataLoader naive",
                         med["service"] / med["dl_naive"] >= 1.3, f"{med['service'] / med['dl_naive']:.2f}x"))
    print_verdicts(verdicts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
