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

Resumed on more devices, one callback is needed: Lightning counts a resumed epoch's batches from
the ones trained before the checkpoint, in the *old* world size's batches, against a limit it
takes from ``len()`` before it loads the loader's state, so it would end the epoch early (2 ranks
checkpointed after 6 of 15 batches, 3 ranks resume: 10 - 6 = 4 more batches per rank where 6
are left). ``client.lightning.ElasticResume`` sets that count from ``loader.batches_left()``
once the state is loaded (docs/frameworks.md).

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

from client.lightning import ElasticResume  # <- a resume on any number of devices
from framework_common import IndexLog, TinyNet, add_common_args, hang_if_asked, loss_of, make_loader


class RemoteDataModule(L.LightningDataModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.loader = None

    def train_dataloader(self):
        # one loader per rank; Lightning sets up the process group before it asks for it
        self.loader = make_loader(self.args, self.trainer.global_rank, self.trainer.world_size)  # <-
        return self.loader

    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()


class LitTinyNet(L.LightningModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.net = TinyNet()
        self.log_file = None

    def on_train_start(self) -> None:
        resumed = self.global_step if self.trainer.ckpt_path else None
        self.log_file = IndexLog(self.args.log_indices, self.global_rank)
        self.log_file.start(resumed, world_size=self.trainer.world_size,
                            job=self.trainer.datamodule.loader.config.job)
        if resumed is not None and self.global_rank == 0:
            print(f"resumed from {self.trainer.ckpt_path}: epoch {self.current_epoch}, step {resumed}, "
                  f"{self.trainer.world_size} rank(s)", flush=True)

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.net, batch)
        # this step's number once it is done (global_step counts the optimizer steps taken)
        self.log_file.step(self.current_epoch, self.global_step + 1, batch)
        return loss

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
    args = p.parse_args()

    L.seed_everything(args.seed, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.checkpoint_every,
                                  save_top_k=-1, save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs,
                        callbacks=[HangAfter(args), checkpoints, ElasticResume()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=args.ckpt_dir, num_sanity_val_steps=0)
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
