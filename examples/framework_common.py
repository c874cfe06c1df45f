"""What the training-framework examples share (train_torchrun.py, train_lightning.py,
train_accelerate.py): a tiny model, the loader they build, their common options, and the
index log the tests read to check that every sample of an epoch was trained on exactly once
across a kill and a resume.

The index log: one JSON line per training step, ``{"epoch", "step", "indices"}`` (the dataset
indices the step trained on, without the loader's padding), in ``DIR/attempt{A}-rank{R}.jsonl``,
where ``A`` is torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 without torchrun). Each attempt
starts with ``{"event": "start", "resumed_from": STEP or null, ...}`` and a rank that stops at
``--hang-after`` writes ``{"event": "hang", "step": STEP}``. Steps are numbered across
restarts (a resumed run continues at the checkpoint's step + 1), so whoever reads the log can
keep what a killed run trained up to its checkpoint and drop what the kill lost.

With ``--validate`` each example also has a validation loader (``train=False, shuffle=False``,
the same dataset; :func:`make_val_loader`), beside the training loader in the same rank and
with the launcher's default job: the loaders' settings differ, so their default jobs do too.
Each validation batch goes to ``DIR/val-attempt{A}-rank{R}.jsonl`` as ``{"epoch", "step",
"sanity", "pass", "indices"}`` (``pass``: the validation run, counted from 0 in each attempt).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from client import RemoteLoader


class TinyNet(nn.Module):
    """A few thousand parameters: the examples are about the data path, not the model."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="the loader service's data port")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=6, help="steps between checkpoints")
    p.add_argument("--log-indices", metavar="DIR", help="log the dataset indices each rank trained on, per step")
    p.add_argument("--validate", action="store_true",
                   help="also validate, on a second RemoteLoader (train=False, shuffle=False) in each rank")
    p.add_argument("--val-batches", type=int, default=0, metavar="N",
                   help="validate on the first N batches of this rank's share (0: all of it)")
    p.add_argument("--hang-after", type=int, default=0, metavar="STEP",
                   help="stop making progress after this step (the tests then SIGKILL the whole group: a job "
                        "killed mid-epoch; what it trained after its last checkpoint is lost)")
    return p


def make_loader(args: argparse.Namespace, rank: int, world_size: int, device: str = "cpu") -> RemoteLoader:
    """This rank's loader. The job name is left to the loader: torchrun's run id, or
    MASTER_ADDR:MASTER_PORT (Lightning, accelerate), so two trainings never share one."""
    return RemoteLoader(args.endpoint, batch_size=args.batch_size, rank=rank, world_size=world_size,
                        seed=args.seed, image_size=args.image_size, device=device, normalize=True)


def make_val_loader(args: argparse.Namespace, rank: int, world_size: int, device: str = "cpu") -> RemoteLoader:
    """This rank's validation loader: eval transforms, the same order every pass. Its default job
    is the launcher's id with a digest of its settings, another job than the training loader's."""
    return RemoteLoader(args.endpoint, batch_size=args.batch_size, rank=rank, world_size=world_size,
                        seed=args.seed, image_size=args.image_size, device=device, normalize=True,
                        train=False, shuffle=False)


def validate(model: nn.Module, loader: RemoteLoader, args: argparse.Namespace, log: "IndexLog", epoch: int,
             step: int) -> float:
    """One validation pass (the first ``--val-batches`` batches, or all): this rank's mean loss.
    Leaving the loop early is fine: the next pass's ``iter()`` starts the loader's epoch again."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for k, batch in enumerate(loader):
            if args.val_batches and k == args.val_batches:
                break
            keep = len(batch.indices) - batch.padding  # padding repeats samples: left out of the metric
            images, labels = batch
            total += F.cross_entropy(model(images[:keep]), labels[:keep], reduction="sum").item()
            n += keep
            log.val(epoch, step, batch)
    log.end_val()
    model.train(was_training)
    return total / max(n, 1)


def attempt() -> int:
    """torchrun's restart count: 0 for the first attempt (and without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)


class IndexLog:
    """This rank's index log (see the module docstring); does nothing without a folder."""

    def __init__(self, folder: Optional[str], rank: int):
        self.path = self.val_path = None
        self.val_pass = 0
        if folder:
            os.makedirs(folder, exist_ok=True)
            self.path = os.path.join(folder, f"attempt{attempt()}-rank{rank}.jsonl")
            self.val_path = os.path.join(folder, f"val-attempt{attempt()}-rank{rank}.jsonl")

    def write(self, path: Optional[str] = None, **row) -> None:
        path = path or self.path
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def val(self, epoch: int, step: int, batch, sanity: bool = False) -> None:
        """One validation batch of the current validation pass (padding left out)."""
        keep = len(batch.indices) - batch.padding
        self.write(self.val_path, epoch=epoch, step=step, sanity=sanity, **{"pass": self.val_pass},
                   indices=[int(i) for i in batch.indices[:keep]])

    def end_val(self) -> None:
        self.val_pass += 1

    def start(self, resumed_from: Optional[int], **info) -> None:
        self.write(event="start", resumed_from=resumed_from, **info)

    def step(self, epoch: int, step: int, batch) -> None:
        keep = len(batch.indices) - batch.padding  # the last `padding` samples repeat earlier ones
        self.write(epoch=epoch, step=step, indices=[int(i) for i in batch.indices[:keep]])


def hang_if_asked(args: argparse.Namespace, step: int, log: IndexLog, rank: int) -> None:
    """At ``--hang-after``: say so and make no more progress until killed."""
    if args.hang_after and step == args.hang_after:
        log.write(event="hang", step=step)
        print(f"rank {rank}: hanging after step {step} (--hang-after), waiting to be killed", flush=True)
        time.sleep(600)
        raise SystemExit(f"rank {rank}: nobody killed this job within 10 minutes of --hang-after")
