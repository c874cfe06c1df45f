#!/usr/bin/env python
"""Hugging Face accelerate fed by the loader service, the loader's position saved and restored
by ``accelerator.save_state`` / ``load_state``::

    loader-service serve --demo --demo-size 256
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py --cpu --ckpt-dir /tmp/acc
    # kill it mid-epoch, then go on with 3 processes from the last saved state:
    accelerate launch --multi_gpu --num_processes 3 examples/train_accelerate.py --cpu --ckpt-dir /tmp/acc

(``--multi_gpu`` is accelerate's torchrun-based launcher, the one that starts several local
processes; ``--cpu`` here makes each of them a gloo rank on the CPU. ``accelerate launch --cpu
--num_processes N`` starts one process unless MPI is set up. A plain
``torchrun --nproc_per_node N examples/train_accelerate.py --cpu`` does the same.)

The loader is *not* passed through ``accelerator.prepare()``: prepare() is for torch
DataLoaders, which it rebuilds around a sampler or dispatcher of its own (``DataLoaderShard`` /
``DataLoaderDispatcher``) to shard the dataset across processes. ``RemoteLoader`` is not a
torch DataLoader and already yields this rank's share (``rank=accelerator.process_index,
world_size=accelerator.num_processes``), on the device it was given; sharding it again, or
wrapping it, would be wrong. Only the model and the optimizer go through prepare().

Its state: ``accelerator.register_for_checkpointing(loader, progress)``: accelerate saves the
``state_dict()`` of registered objects in ``save_state(dir)`` as ``custom_checkpoint_{i}.pkl``,
from the main process only (so rank 0's loader state), and ``load_state(dir)`` calls each
object's ``load_state_dict`` on every process. The loader state is job-level (issue 27): every
rank of the resumed job, at any world size, loads rank 0's state and the rest of the epoch is
dealt out across them, each sample once. ``progress`` (the step and epoch) is registered the
same way.

``--validate``: a second loader in each process, for validation at each epoch's end
(``train=False, shuffle=False``), not registered for checkpointing (each validation starts its
pass again). Its default job is the launcher's id followed by a digest of its settings, another
job than the training loader's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate import Accelerator

from framework_common import IndexLog, TinyNet, add_common_args, hang_if_asked, loss_of, make_loader, \
    make_val_loader, validate


class Progress:
    """Where the training is, saved with the loader: the step and the epoch in progress."""

    def __init__(self):
        self.step, self.epoch = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])


def main() -> int:
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--ckpt-dir", required=True, help="save_state() into CKPT_DIR/step-N every --checkpoint-every "
                                                     "steps and at each epoch's end (CKPT_DIR/latest names the "
                                                     "last whole one); load_state() from it if there is one")
    p.add_argument("--cpu", action="store_true", help="train on the CPU (gloo) even if CUDA is there")
    args = p.parse_args()

    accelerator = Accelerator(cpu=args.cpu)
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(args.seed)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader (see above)
    device = accelerator.device
    loader = make_loader(args, rank, world, "cpu" if device.type == "cpu" else str(device))  # <-
    val_loader = (make_val_loader(args, rank, world, "cpu" if device.type == "cpu" else str(device))
                  if args.validate else None)  # <- a second loader, its own job
    progress = Progress()
    accelerator.register_for_checkpointing(loader, progress)  # <- saved/loaded by save_state/load_state

    resumed_from = None
    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            state_dir = os.path.join(args.ckpt_dir, f.read().strip())
        accelerator.load_state(state_dir)  # <- model, optimizer, RNG, loader, progress
        resumed_from = progress.step
        if accelerator.is_main_process:
            print(f"resumed from {state_dir}: epoch {progress.epoch}, step {progress.step}, {world} rank(s)",
                  flush=True)

    def save() -> None:
        """save_state() into a folder of its own, then (every process done) point `latest` at it,
        so a kill mid-save leaves the previous state whole."""
        name = f"step-{progress.step}"
        accelerator.save_state(os.path.join(args.ckpt_dir, name))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            with open(latest + ".tmp", "w") as f:
                f.write(name)
            os.replace(latest + ".tmp", latest)
    log = IndexLog(args.log_indices, rank)
    log.start(resumed_from, world_size=world, job=loader.config.job,
              val_job=val_loader.config.job if val_loader is not None else None)

    loss = None
    try:
        for epoch in range(progress.epoch, args.epochs):
            progress.epoch = epoch
            loader.set_epoch(epoch)
            for batch in loader:
                loss = loss_of(model, batch)
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss)
                optimizer.step()
                progress.step += 1
                log.step(epoch, progress.step, batch)
                if progress.step % args.checkpoint_every == 0:
                    save()
                hang_if_asked(args, progress.step, log, rank)
            if val_loader is not None:
                val_loss = validate(accelerator.unwrap_model(model), val_loader, args, log, epoch, progress.step)
                print(f"rank {rank}: epoch {epoch} validation loss {val_loss:.3f}", flush=True)
            if progress.step % args.checkpoint_every:  # else just saved
                save()
            if accelerator.is_main_process:
                print(f"epoch {epoch} done at step {progress.step}" + (f", last loss {loss.item():.3f}"
                                                                       if loss is not None else ""), flush=True)
    finally:
        loader.close()
        if val_loader is not None:
            val_loader.close()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()  # leave without the interpreter's finalization (see train_ddp.py)
    sys.stderr.flush()
    os._exit(code)
