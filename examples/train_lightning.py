#!/usr/bin/env python
"""PyTorch Lightning (DDP) fed by the loader service: the ``RemoteLoader`` is what the
``LightningDataModule`` returns from ``train_dataloader()``, and Lightning checkpoints its
position by itself::

    loader-service serve --demo --demo-size 256
    python examples/train_lightning.py --devices 2 --ckpt-dir /tmp/lit      # kill it mid-epoch, then
    python examples/train_lightning.py --devices 3 --ckpt-dir /tmp/lit --resume

How Lightning finds the loader's state (lightning 2.4-2.6): the fit loop keeps what
``train_dataloader()`` returned in a ``CombinedLoader``; ``FitLoop.on_save_checkpoint`` stores
``state_dict()`` of every loader in it that has ``state_dict``/``load_state_dict`` (the
``_Stateful`` protocol) under ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]``,
and ``trainer.fit(ckpt_path=...)`` hands it back to ``load_state_dict`` before the first
``iter()``. No user code saves or loads it. The checkpoint is written by global rank 0, so
it holds rank 0's loader state, and every rank of the resumed job loads that one state: the
loader state is job-level (issue 27), so the rest of the epoch is dealt out across the new
ranks, each sample once.

What else Lightning uses of the loader: ``len()`` (batches per epoch for this rank; with it
Lightning does not prefetch a batch ahead, so the saved cursor is exactly the batches trained
on), and nothing more: it calls ``set_epoch`` only through a ``sampler`` attribute, which
``RemoteLoader`` does not have, so the loader moves to the next epoch by itself each time
Lightning iterates it again after a finished epoch (as a DataLoader does with a fixed
sampler); the epoch numbers stay the same as Lightning's because every epoch runs to its end.
It does not inject a DistributedSampler (it does so only for torch DataLoaders): the ranks'
shares come from ``rank=trainer.global_rank, world_size=trainer.world_size``.

Resumed on another device count, Lightning counts a resumed epoch's batches from the ones
trained before the checkpoint, in the *old* world size's batches, against a limit it takes
from ``len()`` before it loads the loader's state: on more devices it would end the epoch early
(2 ranks checkpointed after 6 of 15 batches, 3 ranks resume: 10 - 6 = 4 more batches per rank
where 6 are left), on fewer the loader would end it before Lightning's count and the epoch-end
validation would never run. The loader sees to it itself: when Lightning's fit loop loads its
state it adds ``client.lightning.ElasticResume`` to the trainer's callbacks, which sets that
count from ``loader.batches_left()`` (docs/frameworks.md). Nothing here asks for it.

``--validate``: ``val_dataloader()`` returns a second ``RemoteLoader`` (``train=False,
shuffle=False``), with the sanity check on (``--sanity-val-steps``, Lightning's 2 by default
then) and ``limit_val_batches=--val-batches``; ``--val-check-interval`` validates mid-epoch
too. Lightning leaves each validation pass after its limit, and iterates the loader again for
the next: the new ``iter()`` ends the old pass and starts the epoch again, as a DataLoader's
would. Both loaders take the default job, ``MASTER_ADDR:MASTER_PORT`` followed by a digest of
each loader's settings: two jobs, each met by every rank.

``--devices N`` CPU processes with ``strategy="ddp"`` (gloo). A checkpoint every
``--checkpoint-every`` steps through Lightning's ``ModelCheckpoint(every_n_train_steps=...)``,
kept as ``last.ckpt``; ``--resume`` continues from it.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from framework_common import IndexLog, TinyNet, add_common_args, hang_if_asked, loss_of, make_loader, make_val_loader


class RemoteDataModule(L.LightningDataModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.loader = self.val_loader = None

    def train_dataloader(self):
        # one loader per rank; Lightning sets up the process group before it asks for it
        self.loader = make_loader(self.args, self.trainer.global_rank, self.trainer.world_size)  # <-
        return self.loader

    def val_dataloader(self):
        if not self.args.validate:
            return []
        self.val_loader = make_val_loader(self.args, self.trainer.global_rank, self.trainer.world_size)  # <-
        return self.val_loader

    def teardown(self, stage: str) -> None:
        for loader in (self.loader, self.val_loader):
            if loader is not None:
                loader.close()


class LitTinyNet(L.LightningModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.net = TinyNet()
        self.log_file = None

    def setup(self, stage: str) -> None:
        self.log_file = IndexLog(self.args.log_indices, self.global_rank)  # before the sanity check

    def on_train_start(self) -> None:
        resumed = self.global_step if self.trainer.ckpt_path else None
        data = self.trainer.datamodule
        self.log_file.start(resumed, world_size=self.trainer.world_size, job=data.loader.config.job,
                            val_job=data.val_loader.config.job if data.val_loader is not None else None)
        if resumed is not None and self.global_rank == 0:
            print(f"resumed from {self.trainer.ckpt_path}: epoch {self.current_epoch}, step {resumed}, "
                  f"{self.trainer.world_size} rank(s)", flush=True)

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.net, batch)
        # this step's number once it is done (global_step counts the optimizer steps taken)
        self.log_file.step(self.current_epoch, self.global_step + 1, batch)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log_file.val(self.current_epoch, self.global_step, batch, sanity=self.trainer.sanity_checking)
        keep = len(batch.indices) - batch.padding  # padding repeats samples: left out of the metric
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(images[:keep]), labels[:keep])
        self.log("val_loss", loss, sync_dist=True, batch_size=keep)

    def on_validation_epoch_end(self) -> None:
        self.log_file.end_val()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.args.lr, momentum=0.9)


class HangAfter(Callback):
    """--hang-after: make no progress after that step (after ModelCheckpoint's save at it, if
    any: Lightning runs checkpoint callbacks last, so this one waits for the next step)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        hang_if_asked(self.args, trainer.global_step, pl_module.log_file, trainer.global_rank)


def main() -> int:
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--devices", type=int, default=2, help="CPU processes (DDP ranks)")
    p.add_argument("--ckpt-dir", required=True, help="ModelCheckpoint's folder (last.ckpt is the latest)")
    p.add_argument("--resume", action="store_true", help="continue from CKPT_DIR/last.ckpt if it exists")
    p.add_argument("--sanity-val-steps", type=int, default=None,
                   help="Lightning's num_sanity_val_steps (default: 2 with --validate, else 0)")
    p.add_argument("--val-check-interval", type=float, default=1.0,
                   help="Lightning's val_check_interval: a fraction of the epoch, or (>= 1, whole) every N steps")
    args = p.parse_args()

    L.seed_everything(args.seed, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.checkpoint_every,
                                  save_top_k=-1, save_last=True)
    sanity = args.sanity_val_steps if args.sanity_val_steps is not None else (2 if args.validate else 0)
    interval = int(args.val_check_interval) if args.val_check_interval > 1 else args.val_check_interval
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs,
                        callbacks=[HangAfter(args), checkpoints], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=args.ckpt_dir, num_sanity_val_steps=sanity,
                        limit_val_batches=(args.val_batches or 1.0) if args.validate else 0,
                        val_check_interval=interval)
    last = os.path.join(args.ckpt_dir, "last.ckpt")
    ckpt_path = last if args.resume and os.path.exists(last) else None
    trainer.fit(LitTinyNet(args), datamodule=RemoteDataModule(args), ckpt_path=ckpt_path)  # <- resume
    if trainer.global_rank == 0:
        print(f"done: {trainer.current_epoch} epoch(s), step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()  # leave without the interpreter's finalization (see train_ddp.py)
    sys.stderr.flush()
    os._exit(code)
