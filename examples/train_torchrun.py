#!/usr/bin/env python
"""Plain PyTorch DDP under torchrun (gloo, CPU), fed by the loader service, with the checkpoint
a real training writes: rank 0 alone saves the model, the optimizer and *its own*
``loader.state_dict()``; on resume every rank, at any world size, loads that one state::

    loader-service serve --demo --demo-size 256
    torchrun --standalone --nproc_per_node 2 examples/train_torchrun.py --checkpoint /tmp/ckpt.pt
    # kill the whole job mid-epoch, then go on with 3 ranks from the last checkpoint:
    torchrun --standalone --nproc_per_node 3 examples/train_torchrun.py --checkpoint /tmp/ckpt.pt

The loader's state is job-level (issue 27): the cursor of the epoch as a whole, so the rest of
the epoch is dealt out again across whatever ranks resume, each sample once. What the job
trained after its last checkpoint is lost with the kill and served again.

``--loader-state per-rank`` keeps the older layout (every rank's state gathered into the
checkpoint, rank r resumes from entry r; the world size must stay the same), which is also
what torchrun's own restarts need (``--max-restarts``: same world size, same job id
``TORCHELASTIC_RUN_ID``, a new ``TORCHELASTIC_RESTART_COUNT``). ``--crash-after STEP`` makes
rank 1 of the first attempt exit with an error there, so torchrun restarts the group. With
gloo, run torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` when it may restart: otherwise
the restarted ranks share the rendezvous store with the previous attempt and can read its
gloo addresses ("Gloo connectFullMesh failed ... Connection refused", pytorch/pytorch#135712).
See framework_common.py for the options shared with the Lightning and accelerate examples.

``--validate``: a second loader in each rank, for validation at each epoch's end
(``train=False, shuffle=False``; ``--val-batches N``: its first N batches only). Both loaders
take the default job, torchrun's run id followed by a digest of each loader's settings, so they
are two jobs to the service and every rank's validation loader meets the others in one.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from framework_common import IndexLog, TinyNet, add_common_args, attempt, hang_if_asked, loss_of, make_loader, \
    make_val_loader, validate


def main() -> int:
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--checkpoint", help="save here (rank 0, atomically) every --checkpoint-every steps and at "
                                        "each epoch's end; resume from it if it exists")
    p.add_argument("--loader-state", choices=["rank0", "per-rank"], default="rank0",
                   help="rank0: the checkpoint holds rank 0's loader state, every rank loads it (any world "
                        "size); per-rank: it holds every rank's, rank r loads entry r (same world size)")
    p.add_argument("--crash-after", type=int, default=0, metavar="STEP",
                   help="rank 1 of torchrun's first attempt exits with an error after this step")
    args = p.parse_args()

    distributed = "WORLD_SIZE" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    torch.manual_seed(args.seed)
    model = TinyNet()
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = make_loader(args, rank, world)  # <- instead of DataLoader(..., sampler=DistributedSampler(...))
    val_loader = make_val_loader(args, rank, world) if args.validate else None  # <- a second loader, its own job
    print(f"rank {rank}/{world}: job {loader.config.job!r}, attempt {attempt()}", flush=True)
    if val_loader is not None:
        print(f"rank {rank}/{world}: validation job {val_loader.config.job!r}", flush=True)

    start_epoch, step, resumed_from = 0, 0, None
    if args.checkpoint and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if args.loader_state == "rank0":
            state = ckpt["loader"]  # <- rank 0's state, whatever this rank and world size are
        else:
            if len(ckpt["loaders"]) != world:
                raise SystemExit(f"--loader-state per-rank: the checkpoint has {len(ckpt['loaders'])} ranks' "
                                 f"states, this job has {world} ranks")
            state = ckpt["loaders"][rank]
        loader.load_state_dict(state)
        start_epoch, step = ckpt["epoch"], ckpt["step"]
        resumed_from = step
        if rank == 0:
            print(f"resumed from {args.checkpoint}: epoch {start_epoch}, step {step} (saved by "
                  f"{ckpt['world_size']} rank(s), resumed by {world})", flush=True)
    log = IndexLog(args.log_indices, rank)
    log.start(resumed_from, world_size=world, job=loader.config.job,
              val_job=val_loader.config.job if val_loader is not None else None)

    def save(epoch: int) -> None:
        if args.loader_state == "rank0":
            loader_part = {"loader": loader.state_dict()}
        else:
            states = [None] * world
            if distributed:
                dist.all_gather_object(states, loader.state_dict())
            else:
                states = [loader.state_dict()]
            loader_part = {"loaders": states}
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                        "step": step, "world_size": world, **loader_part}, tmp)
            os.replace(tmp, args.checkpoint)  # a kill mid-save leaves the previous checkpoint

    finished, loss = False, None
    try:
        for epoch in range(start_epoch, args.epochs):
            loader.set_epoch(epoch)  # <- as with DistributedSampler.set_epoch
            for batch in loader:
                loss = loss_of(model, batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                log.step(epoch, step, batch)
                if args.checkpoint and step % args.checkpoint_every == 0:
                    save(epoch)
                if args.crash_after and step == args.crash_after and attempt() == 0 and rank == 1:
                    print(f"rank {rank}: crashing after step {step} (--crash-after)", flush=True)
                    os._exit(17)
                hang_if_asked(args, step, log, rank)
            if val_loader is not None:
                val_loss = validate(model.module if distributed else model, val_loader, args, log, epoch, step)
                print(f"rank {rank}: epoch {epoch} validation loss {val_loss:.3f}", flush=True)
            if args.checkpoint:
                save(epoch)
            if rank == 0:
                print(f"epoch {epoch} done at step {step}" + (f", last loss {loss.item():.3f}" if loss is not None
                                                              else ""), flush=True)
        finished = True
    finally:
        loader.close()
        if val_loader is not None:
            val_loader.close()
        if distributed:
            if finished:
                dist.barrier()  # leave together (see train_ddp.py)
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()  # leave without the interpreter's finalization (see train_ddp.py)
    sys.stderr.flush()
    os._exit(code)
