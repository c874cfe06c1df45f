"""Test helpers: drive loaders and wait for service state without sleeping blindly."""

from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional

import numpy as np

from client import RemoteLoader


def collect(loader: RemoteLoader, limit: int = -1) -> List[dict]:
    """Iterate one epoch (or ``limit`` batches); keep indices, image bytes and labels."""
    out = []
    for batch in loader:
        out.append({"index": batch.index, "indices": list(batch.indices), "images": batch.raw.numpy().tobytes(),
                    "labels": batch.labels.tolist(), "padding": batch.padding, "skipped": batch.skipped,
                    "shape": tuple(batch.raw.shape)})
        if len(out) == limit:
            break
    return out


def indices_of(batches: List[dict]) -> List[int]:
    return [i for b in batches for i in b["indices"]]


def train_beside_validation(train: RemoteLoader, val: RemoteLoader, epochs: int = 2, every: int = 10) -> List:
    """``epochs`` training epochs with a whole validation pass before every ``every``-th training
    batch: per epoch, (the training batches' indices, each validation pass's batches as
    :func:`collect` keeps them)."""
    out = []
    for epoch in range(epochs):
        train.set_epoch(epoch)
        seen, passes = [], []
        for k, b in enumerate(train):
            seen += b.indices
            if k % every == 0:  # a validation pass in the middle of the training epoch
                passes.append(collect(val))
        out.append((seen, passes))
    return out


def run_ranks(endpoint: str, world: int, steps: int = -1, state: Optional[dict] = None, states: bool = False,
              **kw) -> List:
    """One loader per rank, all at once (threads), one epoch each (or ``steps`` batches), from
    ``state`` if given. Each rank's batches, or with ``states`` (batches, state_dict afterwards)."""
    results: List = [None] * world
    errors: List = []

    def one(rank):
        try:
            with RemoteLoader(endpoint, rank=rank, world_size=world, **kw) as ld:
                if state is not None:
                    ld.load_state_dict(state)
                got = collect(ld, limit=steps)
                results[rank] = (got, ld.state_dict()) if states else got
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def taken_across_a_resize(endpoint: str, job: str, **kw) -> List[int]:
    """Rank 1 of 2 takes 4 batches and saves its state; the job resumes from that state at 3
    ranks, each an epoch: the samples all five loaders took (padding left out), to be each once."""
    first = run_ranks(endpoint, 2, 4, states=True, job=job, **kw)
    second = run_ranks(endpoint, 3, -1, state=first[1][1], states=True, job=f"{job}-resumed", **kw)
    return [i for got, _ in first + second for b in got for i in b["indices"][: len(b["indices"]) - b["padding"]]]


def restart_while_holding(loader: RemoteLoader, hold: int = 2) -> tuple:
    """Take ``hold`` batches and keep them, then start a new ``iter()``: (the held batches, their
    indices and bytes as taken, the new pass's batches as :func:`collect` keeps them)."""
    it = iter(loader)
    held = [next(it) for _ in range(hold)]
    kept = [(b.indices, b.raw.clone()) for b in held]
    return held, kept, collect(loader)


def wait_for(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Wait until ``cond()`` holds, checking on each short interval; fail clearly at ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def status(svc) -> dict:
    from loader_service.control.operate import status_json

    return svc.dispatcher.call(status_json, svc.dispatcher, svc.autoscaler).result(timeout=10)


def holdings(svc) -> tuple:
    """What an in-process service holds for clients, read on its dispatcher's thread: (sessions,
    retiring streams, what each live stream lends in place, bulk-lane sets)."""
    d = svc.dispatcher
    return d.call(lambda: (len(d.state.sessions), len(d.state.memory.retiring),
                           [dict(s.borrowed) for s in d.state.sessions.streams()], len(d.lane_sets))).result(10)


def image_array(batch: dict) -> np.ndarray:
    return np.frombuffer(batch["images"], np.uint8).reshape(batch["shape"])


def dealer(endpoint: str):
    """A bare DEALER connected to ``endpoint`` with an identity of its own: a client speaking the
    protocol by hand (close it with ``close(0)``)."""
    import uuid

    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    s.connect(endpoint)
    return s
