"""PyTorch Lightning: a resume at another device count, set up by the loader itself.

Lightning fixes an epoch's batch count from ``len(loader)`` before it hands the checkpoint's
loader state to ``load_state_dict``, and counts a resumed epoch's batches from the ones trained
before the checkpoint, in the old device count's batches. Resumed on more devices, the rest of
the epoch has more batches per rank than that count allows, so Lightning would end the epoch
early and the samples left would never be trained on; on fewer, the loader ends the epoch
before Lightning's count, and the epoch-end validation (Lightning runs it at its count's last
batch) never runs. :class:`ElasticResume` sets the resumed epoch's count to what was trained
plus what this rank's loader still holds, once the state is loaded, and gives the full count
back for the next epoch.

Nobody needs to add it: when Lightning's fit loop loads a :class:`RemoteLoader`'s state (a fit
resumed from a checkpoint), the loader calls :func:`ensure_elastic_resume`, which adds one to
the trainer's callbacks unless it has one. Passing ``ElasticResume()`` yourself is the same.

Importing this module imports ``lightning``; the rest of ``client`` imports it only when
``lightning.pytorch`` is already imported (a Lightning process) and a state is loaded.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.loops.fit_loop import _FitLoop

from client.loader import RemoteLoader

log = logging.getLogger("client")


class ElasticResume(Callback):
    """``Trainer(callbacks=[ElasticResume()])``: a run resumed from a checkpoint on any number of
    devices trains exactly the rest of the interrupted epoch. It acts only on a resumed fit whose
    training data is one :class:`RemoteLoader`; otherwise it does nothing. A loader whose state
    Lightning loads adds one by itself (:func:`ensure_elastic_resume`)."""

    def __init__(self) -> None:
        self._full: Optional[tuple] = None  # (max_batches, val_check_batch) from len(), given back at the epoch's end

    def on_train_start(self, trainer, pl_module) -> None:
        fit_loop = trainer.fit_loop
        loader = _the_remote_loader(fit_loop)
        if trainer.ckpt_path is None or loader is None:
            return
        fetcher = getattr(fit_loop, "_data_fetcher", None)
        if fetcher is None or not hasattr(fetcher, "length"):
            raise RuntimeError("ElasticResume does not know this Lightning version's fit loop "
                               "(no data fetcher length): the resumed epoch's count cannot be set")
        trained = fit_loop.epoch_loop.batch_progress.current.ready  # this epoch's, before the checkpoint
        count = trained + loader.batches_left()
        if count == fit_loop.max_batches:
            return
        log.warning("ElasticResume: epoch %d resumed after %d batches with %d left on this rank: the epoch "
                    "counts %d batches here (len() says %s)", trainer.current_epoch, trained,
                    count - trained, count, fit_loop.max_batches)
        self._full = fit_loop.max_batches, trainer.val_check_batch
        fit_loop.max_batches = count
        fetcher.length = count
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch not in (None, float("inf")):
            # a fraction of the epoch (1.0: its end) is a fraction of the resumed epoch's count
            trainer.val_check_batch = max(1, int(count * trainer.val_check_interval))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._full is not None:  # the next epoch is whole again; the fetcher re-reads len() on iter()
            (trainer.fit_loop.max_batches, trainer.val_check_batch), self._full = self._full, None


def _the_remote_loader(fit_loop) -> Optional[RemoteLoader]:
    combined = getattr(fit_loop, "_combined_loader", None)
    loaders = list(combined.flattened) if combined is not None else []
    return loaders[0] if len(loaders) == 1 and isinstance(loaders[0], RemoteLoader) else None


FRAMES_UP = 16  # RemoteLoader.load_state_dict <- CombinedLoader._load_state_dicts <- _FitLoop (3 up in 2.4-2.6)


def ensure_elastic_resume(loader: RemoteLoader) -> bool:
    """Called by :meth:`RemoteLoader.load_state_dict` in a process that imported Lightning: if
    Lightning's fit loop is loading ``loader``'s state (``fit(ckpt_path=...)``), make sure its
    trainer has an :class:`ElasticResume` callback, adding one (before the checkpoint callbacks)
    if not. True if the loader was found in a fit loop."""
    frame = sys._getframe(1)
    for _ in range(FRAMES_UP):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, _FitLoop):
            trainer = owner.trainer
            if not any(isinstance(c, ElasticResume) for c in trainer.callbacks):
                at = next((i for i, c in enumerate(trainer.callbacks) if isinstance(c, Checkpoint)),
                          len(trainer.callbacks))
                trainer.callbacks.insert(at, ElasticResume())
                log.info("RemoteLoader: Lightning resumes this fit from a checkpoint; added the ElasticResume "
                         "callback, which counts the resumed epoch's batches at this device count")
            return True
        frame = frame.f_back
    return False
