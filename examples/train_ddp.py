#!/usr/bin/env python
"""Train a small conv net with DDP on batches streamed by the loader service.

The usual ``DataLoader(dataset, sampler=DistributedSampler(...), num_workers=...)`` loop, with
the loader swapped for a ``RemoteLoader`` (marked ``# <-`` below), and a checkpoint that holds
each rank's loader position, so a job that is killed resumes exactly where it stopped::

    loader-service serve --demo                       # on the CPU node (or: docker compose up -d)
    torchrun --nproc_per_node 2 examples/train_ddp.py --endpoint tcp://127.0.0.1:5555 \\
        --epochs 2 --checkpoint /tmp/ckpt.pt
    # kill it mid-epoch, run the same command again: it goes on from the last checkpoint

Without torchrun it runs as a single process (rank 0 of 1). When every rank on the node can
have a GPU of its own, rank r uses cuda:r (NCCL) and the loader copies batches in on a side
stream; otherwise (no GPU, ``--cpu``, or more ranks than GPUs: NCCL cannot share one GPU
between ranks) every rank trains on the CPU with gloo, and rank 0 says why.
``--log-indices DIR`` writes the dataset indices each rank trained on, per epoch (the tests
check them for exactly-once delivery across ranks and restarts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from client import RemoteLoader


class SmallNet(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", help="save here every --checkpoint-every steps and at each epoch's end; "
                                        "resume from it if it exists")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--stop-after", type=int, default=0, help="exit after this many steps (a checkpoint is saved "
                                                             "first): stands in for a job killed mid-epoch")
    p.add_argument("--log-indices", metavar="DIR", help="write the indices each rank trained on, per epoch")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if CUDA is there")
    args = p.parse_args()

    distributed = "WORLD_SIZE" in os.environ  # started by torchrun
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = 0 if args.cpu else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    device, backend, why = pick_device(local_rank, local_world, gpus)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)  # before NCCL starts, so its communicator uses this GPU
    if distributed:
        dist.init_process_group(backend)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    print(f"rank {rank}: device {device}, backend {backend}" + (f" ({why})" if why else ""), flush=True)

    torch.manual_seed(args.seed)
    model = SmallNet(args.num_classes).to(device, memory_format=torch.channels_last)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    loader = RemoteLoader(args.endpoint, batch_size=args.batch_size, rank=rank, world_size=world,  # <-
                          seed=args.seed, image_size=args.image_size, device=str(device), normalize=True,
                          job="examples/train_ddp")

    start_epoch, step = 0, 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loaders"][rank])  # <- this rank's position in its epoch
        start_epoch, step = ckpt["loaders"][rank]["epoch"], ckpt["step"]
        if rank == 0:
            at = ckpt["loaders"][rank]["position"]  # the job's position in the epoch, in samples
            print(f"resumed from {args.checkpoint}: epoch {start_epoch}, batch {at // (args.batch_size * world)}, "
                  f"step {step}", flush=True)

    def save() -> None:
        states = [None] * world
        if distributed:
            dist.all_gather_object(states, loader.state_dict())
        else:
            states = [loader.state_dict()]
        if rank == 0:
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loaders": states,
                        "step": step}, tmp)
            os.replace(tmp, args.checkpoint)  # a kill mid-save leaves the previous checkpoint

    finished = False  # every rank got here: safe to wait for the others before leaving
    try:
        for epoch in range(start_epoch, args.epochs):
            loader.set_epoch(epoch)  # <- as with DistributedSampler.set_epoch
            steps, t0, samples, loss = 0, time.perf_counter(), 0, torch.zeros(())
            for batch in loader:
                images, labels = batch  # normalized NCHW float on `device`, int64 labels
                loss = F.cross_entropy(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step, steps, samples = step + 1, steps + 1, samples + len(labels)
                if args.log_indices:
                    _log_indices(args.log_indices, rank, epoch, step, batch.indices)
                if args.checkpoint and (step % args.checkpoint_every == 0 or step == args.stop_after):
                    save()
                if step == args.stop_after:
                    if rank == 0:
                        print(f"stopping after step {step} (--stop-after)", flush=True)
                    finished = True
                    return 0
            if args.checkpoint:
                save()
            dt = time.perf_counter() - t0
            if rank == 0:
                print(f"epoch {epoch}: {steps} steps, {samples * world / max(dt, 1e-9):.0f} img/s over "
                      f"{world} rank(s), last loss {loss.item():.3f}, data stall "
                      f"{loader.stats()['wait_s']:.1f}s", flush=True)
        finished = True
    finally:
        loader.close()
        if distributed:
            if finished:
                # leave together: a rank destroying its gloo group while a peer still tears its
                # own down can abort in gloo ("terminate called without an active exception")
                dist.barrier()
            dist.destroy_process_group()
    return 0


def pick_device(local_rank: int, local_world: int, gpus: int) -> "tuple[torch.device, str, str]":
    """(device, process-group backend, why not a GPU) for one rank of ``local_world`` on a node
    with ``gpus`` usable GPUs. All ranks of a node decide alike, so they agree on the backend."""
    if gpus == 0:
        return torch.device("cpu"), "gloo", "no GPU (or --cpu)"
    if local_world > gpus:
        return torch.device("cpu"), "gloo", (f"{local_world} ranks on this node but {gpus} GPU(s); NCCL needs "
                                             "one GPU per rank")
    return torch.device("cuda", local_rank), "nccl", ""


def _log_indices(folder: str, rank: int, epoch: int, step: int, indices) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"epoch": epoch, "step": step, "indices": list(indices)}) + "\n")


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's finalization. gloo's worker threads free a finished
    # collective's tensors a moment after it completes, and freeing a tensor Python made needs
    # the interpreter: a thread that tries while Python is finalizing is stopped mid-free and the
    # process aborts ("terminate called without an active exception"; 1 run in 62 here, seen in
    # a core dump: ~AsyncBarrierWork -> ~AsyncAllgatherWork -> take_gil on a gloo thread, as in
    # pytorch/pytorch#179291). Everything is written and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
