"""The decode worker process: take a Task, write its images into shared memory, report Done;
drop a segment's mapping when told it was unlinked (Unmap), so no deleted segment stays pinned.

Workers hold no state that matters: the dispatcher knows every task it handed out, so a
worker can be stopped, killed or added at any time without losing or doubling a sample.
Errors are reported in-band (``Done.ok=False`` with the formatted traceback), never by dying.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
import traceback
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import zmq

from wire import protocol as P
from loader_service.decode.jpeg import DEFAULT_OPTIONS, DecodeOptions
from loader_service.shm import Segment
from loader_service.sources import Source, SourceSpec, open_source
from loader_service.sources.base import import_kind_modules
from loader_service.decode.pipelines import Cache, Item, run_one
from loader_service.decode.transforms import sample_rng

SEGMENT_CACHE = 4  # mappings a worker keeps open at most
# glibc malloc: blocks from 32 MiB are mmapped (a camera photo's full decode), smaller ones come
# from the heap, which keeps up to 64 MiB free at its top instead of giving it back at once
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 64 << 20


def keep_freed_memory() -> None:
    """Let glibc keep the memory a sample freed for the next sample. By default it trims the heap
    (and maps decode buffers anew) as a task's samples free their buffers: ~11 page faults and
    ~40 us of system time an ImageNet-size photo in a worker (issue 28), against none in the
    same loop without a task around it. Bounded: at most TRIM_THRESHOLD stays unreturned. No-op
    where the C library has no ``mallopt`` (musl)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    mallopt(-1, TRIM_THRESHOLD)  # M_TRIM_THRESHOLD


def worker_main(worker_id: int, endpoint: str, specs: List[SourceSpec], death_conn,
                decode: DecodeOptions = DEFAULT_OPTIONS, progress=None, kind_modules: Sequence[str] = (),
                nice: int = 0) -> None:
    """Entry point of a worker process. Returns when told to stop or when the service dies.
    ``progress``: shared ``[position, since]`` of the sample being worked on (see pool.py);
    ``kind_modules``: the modules that registered the specs' source kinds in the service
    (``sources.base.kind_modules``), imported before the specs are opened; ``nice``: how much
    nicer than the service this process runs (``--worker-nice``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the service, which stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if nice:
        os.nice(nice)  # lowering one's own priority needs no privilege
    keep_freed_memory()
    segments: "OrderedDict[str, Segment]" = OrderedDict()
    sources: Dict[str, Source] = {}
    pipelines = Cache()
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{worker_id}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        import_kind_modules(kind_modules)
        for spec in specs:
            sources[spec.name] = open_source(spec)
    except Exception as exc:
        sock.setsockopt(zmq.LINGER, 2000)  # let the report reach the dispatcher before we exit
        sock.send_multipart(P.encode(P.Ready(worker=worker_id, pid=os.getpid(), error=f"{type(exc).__name__}: {exc}",
                                             traceback=traceback.format_exc())))
        sock.close()
        ctx.term()
        return
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(death_conn.fileno(), zmq.POLLIN)  # EOF when the service process is gone
    try:
        sock.send_multipart(P.encode(P.Ready(worker=worker_id, pid=os.getpid())))
        while True:
            events = dict(poller.poll())
            if death_conn.fileno() in events:
                return
            msg, _ = P.decode(sock.recv_multipart(), expect=(P.Task, P.Stop, P.Unmap))
            if isinstance(msg, P.Stop):
                return
            if isinstance(msg, P.Unmap):
                seg = segments.pop(msg.shm, None)
                if seg is not None:
                    seg.close()
                continue
            done = run_task(msg, worker_id, sources, segments, decode, progress, pipelines)
            if progress is not None:
                progress[2] = -1  # between tasks: a death now is no task's fault
            sock.send_multipart(P.encode(done))
            if not sock.poll(0):  # nothing queued behind it: what the task held open may be let go
                sources[msg.dataset].idle()
    finally:
        for seg in segments.values():
            seg.close()
        for src in sources.values():
            src.close()
        sock.close(0)
        ctx.term()


def run_task(task: P.Task, worker_id: int, sources: Dict[str, Source], segments,
             decode: DecodeOptions = DEFAULT_OPTIONS, progress=None, pipelines: Optional[Cache] = None) -> P.Done:
    """Run ``task``'s pipeline over its samples, writing each output into its block of the slot.
    ``progress`` (if given) is kept at [position, start time, task id] of the sample being read
    or processed, and position -1 once the task is done (the pool reads the task id of a
    worker that died: the task it died on; :func:`worker_main` clears it between tasks)."""
    if progress is None:
        progress = [-1.0, 0.0, -1.0]
    progress[2] = task.task
    t_read = t_decode = 0.0
    try:
        source = sources[task.dataset]
        seg = _segment(segments, task.shm)
        pipe = (pipelines or Cache()).get(task.pipeline, task.target, task.pipeline_args)
        n = len(task.indices)
        blocks = {name: seg.array("uint8", (task.capacity, *shape), task.offset + off)[task.position: task.position + n]
                  for name, shape, off in pipe.layout(task.capacity)}
    except Exception as exc:
        return P.Done(task=task.task, worker=worker_id, ok=False, error=f"task setup failed: {exc}",
                      traceback=traceback.format_exc())
    skipped: list = []
    k = 0
    for pos, idx in enumerate(task.indices):
        progress[1] = time.monotonic()
        progress[0] = pos
        t0 = time.perf_counter()
        try:
            data = source.read(idx)
            t1 = time.perf_counter()
            item = Item(data, int(source.labels[idx]), idx, sample_rng(task.seed, task.epoch, idx), source.describe,
                        decode)
            run_one(task.pipeline, pipe, item, {name: block[k] for name, block in blocks.items()})
            t_read += t1 - t0
            t_decode += time.perf_counter() - t1
            k += 1
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if task.on_error == "skip":  # the reason names the file, as the raise policy's error does
                skipped.append([pos, idx, f"{_describe(source, idx)}: {reason}"])
                continue
            return P.Done(task=task.task, worker=worker_id, ok=False,
                          error=f"sample {idx} ({_describe(source, idx)}) failed in pipeline {task.pipeline!r}: {reason}",
                          traceback=traceback.format_exc())
    del blocks
    progress[0] = -1
    return P.Done(task=task.task, worker=worker_id, ok=True, read_s=t_read, decode_s=t_decode, skipped=skipped)


def _describe(source: Source, idx: int) -> str:
    try:
        return source.describe(idx)
    except Exception as exc:  # an index the source cannot name: still report the sample's failure
        return f"sample {idx} (no name: {type(exc).__name__}: {exc})"


def _segment(cache: "OrderedDict[str, Segment]", name: str) -> Segment:
    # A mapping kept here would pin an unlinked segment's memory (past max_shm_mb): the
    # dispatcher sends Unmap when it unlinks one, and the cache holds a few at most.
    seg = cache.get(name)
    if seg is not None:
        cache.move_to_end(name)
        return seg
    seg = cache[name] = Segment.attach(name)
    while len(cache) > SEGMENT_CACHE:
        cache.popitem(last=False)[1].close()
    return seg
