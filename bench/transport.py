"""Transport benchmark: the service's data path with decoding switched off, against a raw
pyzmq program that moves the same messages over the same socket types.

    python -m bench.transport [--batch-size 64] [--image-size 224] [--workers 2] [--window W]
                              [--seconds 5 | --batches N] [--warmup 20] [--rounds 3] [--local]
                              [--ceilings] [--json PATH]

Both rows move the same messages: a msgpack header frame shaped like ``protocol.Batch`` (0.1-0.4
KB at batch 64), an image frame of ``batch x size x size x 3`` uint8 bytes (9.63 MB at 64 x 224)
and a labels frame of ``batch`` int64, from a ROUTER in another process to a DEALER in this
one, over ``tcp://127.0.0.1``, with the same flow control: the receiver asks for ``--window``
batches up front and for one more after each batch it receives (the client's credits; window
default ``max(4, 2 x workers)``, what ``bench.throughput`` gives ``RemoteLoader`` as prefetch).

1. **raw pyzmq**: a spawned process binds a ROUTER (``SNDHWM=RCVHWM=0`` like the service's)
   and answers each credit with one batch: the header packed with msgpack, the image frame
   sent zero-copy (``zmq.Frame(buf, track=True)``) from one of ``window`` preallocated
   buffers, each reused only after zmq's tracker says its last send completed (the rule the
   service follows), the labels frame from preallocated bytes. The buffers are filled once,
   so they are real pages like the service's slots (an untouched zeroed buffer maps the
   kernel's shared zero page and flatters the sender). This process receives with a
   DEALER: ``recv`` the header and ``msgpack.unpackb`` it, takes the image and labels frames,
   and sends a one-batch credit. Two receivers, two rows: ``recv_into`` one preallocated numpy
   buffer each (the pyzmq examples' way: one memcpy per frame), and ``recv(copy=False)``
   (zmq's own message buffer, no copy; what the client's CPU path does). The faster of the
   two is the most a pyzmq program moves with this message shape and flow: it is the 100%.
2. **service + RemoteLoader, decode off**: ``python -m loader_service serve --demo
   --workers N --pipeline blank=bench.doubles:blank`` in its own process, consumed by
   ``RemoteLoader(prefetch=window, drop_last=True, pipeline="blank")`` in this process (so every
   batch is full). ``blank`` (bench/doubles.py, registered like any operator pipeline) declares
   the ``image`` output and writes nothing: a worker still runs its per-sample loop (reads the
   sample's bytes, draws its random generator, calls the pipeline) but decodes nothing and leaves
   the slot's bytes untouched. What remains is the real path: the dispatcher's task round trip
   to a worker through its internal socket, the worker's per-sample loop, ordering, the header
   encode, the zero-copy send from a shared-memory slot with its tracker, and on the client
   side header decode, checks, the images tensor wrapping the received message, the credit,
   reordering and epoch boundaries (every ``demo-size // batch`` batches: a new stream, on the
   slots of that connection's previous one; epoch lookahead on, the default). Its first batch
   must arrive all zeros, which shows decoding really was off. (Until the worker lost its
   benchmark hook, LOADER_BENCH_SKIP_DECODE, workers reported each task done without reading
   its samples; the loop now in the row costs some tens of microseconds of worker CPU per
   sample: docs/benchmarks.md section 2.)

3. with ``--local``, **service + RemoteLoader(local=True)**: the same service and loader in the
   co-located mode (issue 41): each batch's image is read from the service's shared-memory slot
   (one copy into a reused host buffer), the slot handed back with a Release; only the header
   and labels cross the socket. The target (the % of raw column) is about the socket rows.

4. with ``--ceilings``, three rows that bound any change to the network path (issue 41: "several
   connections per replica"). They do not set the 100% of the % of raw column.

   * **raw pyzmq over two connections**: the raw pyzmq program with two DEALERs (contexts of two
     I/O threads on both sides), each with the whole window of credits; every batch comes whole
     on one of them, received with ``recv(copy=False)``.
   * **raw TCP sockets**: no ZeroMQ, no header, no Python per frame: a spawned
     process ``sendall``s each batch's image (and labels) from one of ``window`` preallocated
     buffers to this one, which ``recv_into``s them into one preallocated buffer, with the same
     credits (one byte per batch). Over one connection, and striped over two (half the image on
     each, a thread per connection on both sides): what this machine's loopback moves at all.

The service binds tcp only (``Dispatcher`` has no ipc endpoint), so there is no ipc row.

How to read the table:

* Each row is timed from the first batch after ``--warmup`` batches until ``--seconds``
  have passed (or ``--batches`` have arrived); the receiving loop only counts batches, it
  does not touch their pixels. ``MB/s`` is image payload, 10^6 bytes per second.
* ``% of raw``: batches/s over the better raw row's; the target is >= 80% for the service.
  With ``--rounds`` > 1 the rows alternate (raw, raw zero-copy, service, raw, ...) and the
  table shows each row's median; every round's ratio is printed below it.
* ``CPU ms / batch``: user + system CPU per batch of the receiving process (this one, all
  its threads, zmq's I/O thread included) and of the sending side (the raw process, or the
  service process plus its workers). On a machine with few cores these two compete with each
  other and with anything else running, so the CPU columns say more than the rates about
  where the difference comes from.
* ``sending process CPU us / image``: the sending process alone (the service's dispatcher and
  ZeroMQ I/O threads, without its workers; or the raw sender), per image: the service's I/O CPU.

The PASS/MISS line checks the project's target; the exit status does not depend on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import queue
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, List, Optional

import msgpack
import numpy as np
import psutil
import zmq

from bench import doubles, plots
from bench.harness import (START_TIMEOUT_S, command, cpu_seconds, forever, log, machine, raise_on_sigterm,
                           start_service, table_head, table_row)
from client import RemoteLoader
from loader_service.sources.demo import ensure_demo

RAW, RAW_ZC, SERVICE, LOCAL = "raw_pyzmq", "raw_pyzmq_zero_copy", "service_client", "service_client_local"
RAW_ZC2, TCP1, TCP2 = "raw_pyzmq_zero_copy_2", "raw_tcp_1", "raw_tcp_2"
LANES = "service_client_lanes"
LABELS = {RAW: "raw pyzmq ROUTER -> DEALER, recv_into", RAW_ZC: "raw pyzmq ROUTER -> DEALER, recv(copy=False)",
          SERVICE: "service (decode off) + RemoteLoader",
          LOCAL: "service (decode off) + RemoteLoader(local=True), shared memory",
          LANES: "service (decode off, --lane-port) + RemoteLoader(lanes=N), bulk lanes",
          RAW_ZC2: "raw pyzmq ROUTER -> 2 DEALERs, 2 I/O threads, recv(copy=False)",
          TCP1: "raw TCP socket (no ZeroMQ), 1 connection, recv_into",
          TCP2: "raw TCP sockets (no ZeroMQ), 2 connections, a thread each, recv_into"}

# the --ceilings rows: each measured by (settings) -> Run, defined below
CEILINGS: "dict[str, Callable[[Settings], Run]]" = {
    RAW_ZC2: lambda settings: bench_raw(settings, zero_copy=True, connections=2),
    TCP1: lambda settings: bench_raw_tcp(settings, 1),
    TCP2: lambda settings: bench_raw_tcp(settings, 2)}
TARGET = 0.80  # DESIGN.md: transport alone >= 80% of raw pyzmq on the same socket type
STOP_JOIN_S = 10.0


@dataclass(frozen=True)
class Settings:
    batch_size: int
    image_size: int
    workers: int
    window: int
    warmup: int  # batches received before the clock starts
    seconds: float  # timed length of a row, unless batches is set
    batches: int  # > 0: time exactly this many batches instead
    demo_size: int

    @property
    def image_bytes(self) -> int:
        return self.batch_size * self.image_size * self.image_size * 3


@dataclass
class Run:
    """One timed run of one row."""

    batches: int
    seconds: float
    receiver_cpu_s: float
    sender_cpu_s: float
    image_bytes: int
    batch_size: int
    sender_io_cpu_s: float = 0.0  # of the sending process alone (the service's, without its workers)

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def images_per_s(self) -> float:
        return self.batches_per_s * self.batch_size

    @property
    def mb_per_s(self) -> float:
        return self.batches_per_s * self.image_bytes / 1e6

    def cpu_ms_per_batch(self, cpu_s: float) -> float:
        return 1000.0 * cpu_s / self.batches if self.batches else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "batches_per_s": self.batches_per_s, "images_per_s": self.images_per_s,
                "mb_per_s": self.mb_per_s, "receiver_cpu_ms_per_batch": self.cpu_ms_per_batch(self.receiver_cpu_s),
                "sender_cpu_ms_per_batch": self.cpu_ms_per_batch(self.sender_cpu_s),
                "sender_io_cpu_us_per_image": self.io_us_per_image}

    @property
    def io_us_per_image(self) -> float:
        """CPU of the sending process alone per image: the service's dispatcher and ZeroMQ I/O
        threads (its workers apart), or the raw sender."""
        return 1e6 * self.sender_io_cpu_s / (self.batches * self.batch_size) if self.batches else 0.0


def timed(next_batch: Callable[[], None], settings: Settings, senders: Callable[[], List[psutil.Process]]) -> Run:
    """Receive ``warmup`` batches, then time the rest (by seconds or by count)."""
    for _ in range(settings.warmup):
        next_batch()
    me, procs = psutil.Process(), senders()
    cpu0, scpu0, io0 = cpu_seconds([me]), cpu_seconds(procs), cpu_seconds(procs[:1])
    n, t0 = 0, time.perf_counter()
    while True:
        next_batch()
        n += 1
        if settings.batches > 0:
            if n >= settings.batches:
                break
        elif time.perf_counter() - t0 >= settings.seconds:
            break
    t1 = time.perf_counter()
    cpu, scpu, io = cpu_seconds([me]) - cpu0, cpu_seconds(procs) - scpu0, cpu_seconds(procs[:1]) - io0
    return Run(n, t1 - t0, cpu, scpu, settings.image_bytes, settings.batch_size, io)


# ---------------------------------------------------------------------------------- raw pyzmq
def _batch_header(k: int, n: int, size: int) -> bytes:
    """A header with the keys and value types of ``protocol.Batch`` (plain msgpack, no dataclass)."""
    return msgpack.packb({"v": 1, "t": 11, "stream": 1, "epoch": 0, "index": k,
                          "indices": list(range(k * n, k * n + n)), "shape": [n, size, size, 3], "padding": 0,
                          "skipped": [], "dtype": "uint8"}, use_bin_type=True)


def _raw_router(settings: Settings, connections: int, conn) -> None:
    """The raw sender (a spawned process): one batch per credit until the parent says stop;
    a buffer per batch that may be in flight (the window of each connection)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    ctx = zmq.Context(connections)
    sock = ctx.socket(zmq.ROUTER)
    buffers = settings.window * connections
    trackers: List[Optional[zmq.MessageTracker]] = [None] * buffers
    try:
        for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
            sock.setsockopt(opt, val)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        n, size = settings.batch_size, settings.image_size
        # written once, so every page is real memory: an untouched zeroed buffer would map the
        # kernel's one shared zero page and make the send copies unrealistically cache-friendly
        slots = [np.full(settings.image_bytes, 0x5A, np.uint8) for _ in range(buffers)]
        labels = np.zeros(n, np.int64).tobytes()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(conn.fileno(), zmq.POLLIN)  # "stop", or EOF if the parent is gone
        conn.send(("ready", f"tcp://127.0.0.1:{port}"))
        k = 0
        while True:
            events = dict(poller.poll())
            if conn.fileno() in events:
                return
            while True:
                try:
                    ident, header = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for _ in range(msgpack.unpackb(header, raw=False)["n"]):
                    slot = k % buffers
                    t = trackers[slot]
                    if t is not None and not t.done:
                        t.wait()  # never rewrite a buffer zmq may still be sending
                    frame = zmq.Frame(slots[slot], track=True)
                    sock.send_multipart([ident, _batch_header(k, n, size), frame, labels])
                    trackers[slot] = frame.tracker
                    del frame  # as the dispatcher's does: a live Frame object keeps its tracker pending
                    k += 1
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        sock.close(0)
        ctx.term()  # returns once zmq has let go of every zero-copy frame


@contextlib.contextmanager
def _sender(target: Callable, args: tuple, what: str, name: str) -> Iterator["tuple[mp.Process, Any]"]:
    """``target(*args, conn)`` in a spawned process named ``name``, once it has sent ``("ready",
    payload)`` on ``conn``: yields ``(process, payload)``. On exit it is told to stop and joined
    (terminated, then killed, if it will not end)."""
    mpctx = mp.get_context("spawn")
    parent, child = mpctx.Pipe()
    proc = mpctx.Process(target=target, args=(*args, child), name=name)
    try:
        proc.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            raise TimeoutError(f"the {what} process did not start within {START_TIMEOUT_S:.0f}s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            proc.join(STOP_JOIN_S)
            raise RuntimeError(f"the {what} process exited (code {proc.exitcode}) before it was ready") from None
        if kind != "ready":
            raise RuntimeError(f"the {what} process failed:\n{payload}")
        yield proc, payload
    finally:
        if proc.pid is not None:
            with contextlib.suppress(OSError):
                parent.send(("stop", None))
            proc.join(STOP_JOIN_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_JOIN_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        parent.close()


def bench_raw(settings: Settings, zero_copy: bool = False, connections: int = 1) -> Run:
    """The raw program; the receiver takes each image either into a preallocated buffer
    (``recv_into``: one memcpy) or as zmq's own message buffer (``recv(copy=False)``: none).
    ``connections`` DEALERs, each with the whole window, take whichever batch comes first."""
    with _sender(_raw_router, (settings, connections), "raw ROUTER", "raw-pyzmq-router") as (proc, endpoint):
        ctx = zmq.Context(connections)
        socks = [ctx.socket(zmq.DEALER) for _ in range(connections)]
        try:
            poller = zmq.Poller()
            for sock in socks:
                for opt, val in ((zmq.LINGER, 0), (zmq.RCVHWM, 0)):
                    sock.setsockopt(opt, val)
                sock.connect(endpoint)
                poller.register(sock, zmq.POLLIN)
            images = np.empty(settings.image_bytes, np.uint8)
            labels = np.empty(settings.batch_size, np.int64)
            want = (settings.image_bytes, labels.nbytes)
            credit = msgpack.packb({"v": 1, "t": 2, "stream": 1, "n": 1}, use_bin_type=True)
            for sock in socks:
                sock.send(msgpack.packb({"v": 1, "t": 2, "stream": 1, "n": settings.window}, use_bin_type=True))
            turn = [0]

            def next_batch() -> None:
                # one connection: its next batch; several: the first that has one, from the one after
                # the last served (so none waits behind the other)
                sock = socks[0]
                if connections > 1:
                    ready = dict(poller.poll(START_TIMEOUT_S * 1000))
                    order = socks[turn[0]:] + socks[:turn[0]]
                    sock = next((x for x in order if x in ready), None)
                    if sock is None:
                        raise TimeoutError(f"raw: no batch within {START_TIMEOUT_S:.0f}s")
                    turn[0] = (socks.index(sock) + 1) % connections
                header = msgpack.unpackb(sock.recv(), raw=False)
                if zero_copy:
                    got = tuple(sock.recv(copy=False).buffer.nbytes for _ in range(2))
                else:
                    got = (sock.recv_into(images), sock.recv_into(labels))
                if got != want or sock.getsockopt(zmq.RCVMORE) or header["t"] != 11:
                    raise RuntimeError(f"raw: unexpected message: frames {got}, header {header}")
                sock.send(credit)

            return timed(next_batch, settings, lambda: [psutil.Process(proc.pid)])
        finally:
            for sock in socks:
                sock.close(0)
            ctx.term()


# --------------------------------------------------------------------------- raw TCP sockets
def _parts(settings: Settings, connections: int) -> List[tuple]:
    """(offset, bytes) of the image each connection carries: the image cut in ``connections`` pieces."""
    step = -(-settings.image_bytes // connections)
    return [(at, min(step, settings.image_bytes - at)) for at in range(0, settings.image_bytes, step)]


def _raw_tcp_sender(settings: Settings, connections: int, conn) -> None:
    """The raw TCP sender (a spawned process): per connection, a thread that answers each credit
    byte with that connection's piece of the next batch (labels on the first), until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    listener = socket.create_server(("127.0.0.1", 0), backlog=connections)
    socks: List[socket.socket] = []
    try:
        listener.settimeout(START_TIMEOUT_S)
        slots = [np.full(settings.image_bytes, 0x5A, np.uint8) for _ in range(settings.window)]
        labels = np.zeros(settings.batch_size, np.int64).tobytes()
        conn.send(("ready", listener.getsockname()[1]))
        socks = [listener.accept()[0] for _ in range(connections)]
        parts = _parts(settings, connections)

        def serve(j: int) -> None:
            s, (at, nbytes), k = socks[j], parts[j], 0
            with contextlib.suppress(OSError):  # the receiver closed its end: the run is over
                while True:
                    credits = s.recv(4096)
                    if not credits:
                        return
                    for _ in range(len(credits)):
                        s.sendall(memoryview(slots[k % settings.window])[at:at + nbytes])
                        if j == 0:
                            s.sendall(labels)
                        k += 1

        threads = [threading.Thread(target=serve, args=(j,), daemon=True) for j in range(connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        for s in socks:
            s.close()
        listener.close()


def _recv_exactly(s: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = s.recv_into(view)
        if n == 0:
            raise ConnectionError("raw TCP: the sender closed the connection")
        view = view[n:]


def bench_raw_tcp(settings: Settings, connections: int) -> Run:
    """The raw TCP program over ``connections`` connections (see the module's docstring, row 4)."""
    with _sender(_raw_tcp_sender, (settings, connections), "raw TCP", "raw-tcp-sender") as (proc, port):
        socks: List[socket.socket] = []
        try:
            socks = [socket.create_connection(("127.0.0.1", port), timeout=START_TIMEOUT_S)
                     for _ in range(connections)]
            images = np.full(settings.image_bytes, 1, np.uint8)  # touched: real pages, as a reused buffer is
            labels = np.empty(settings.batch_size, np.int64)
            pieces = [memoryview(images)[at:at + n] for at, n in _parts(settings, connections)]
            for s in socks:
                s.sendall(bytes(settings.window))  # the window's credits, one byte each
            if connections == 1:
                def next_batch() -> None:
                    _recv_exactly(socks[0], pieces[0])
                    _recv_exactly(socks[0], memoryview(labels).cast("B"))
                    socks[0].sendall(b"\0")
            else:
                done: "queue.Queue[Optional[BaseException]]" = queue.Queue()

                def receive(j: int) -> None:
                    try:
                        while True:
                            _recv_exactly(socks[j], pieces[j])
                            if j == 0:
                                _recv_exactly(socks[j], memoryview(labels).cast("B"))
                            done.put(None)
                            socks[j].sendall(b"\0")
                    except BaseException as exc:  # the socket closed at the end, or a failure
                        done.put(exc)

                for j in range(connections):
                    threading.Thread(target=receive, args=(j,), daemon=True, name=f"raw-tcp-{j}").start()

                def next_batch() -> None:
                    for _ in range(connections):
                        err = done.get(timeout=START_TIMEOUT_S)
                        if err is not None:
                            raise RuntimeError(f"raw TCP receiver failed: {err!r}")

            return timed(next_batch, settings, lambda: [psutil.Process(proc.pid)])
        finally:
            for s in socks:  # the sender's threads end at EOF
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


# --------------------------------------------------------------- service + RemoteLoader
def bench_service(settings: Settings, local: bool = False, lanes: int = 0) -> "tuple[Run, bool]":
    """Returns the run and whether decoding was really off (the first batch is all zeros).
    ``local``: the co-located mode (batches read from the service's shared memory, one copy);
    ``lanes``: batch bytes on that many bulk lanes (the service with --lane-port 0)."""
    svc = start_service(["--demo", "--demo-size", str(settings.demo_size), "--workers", str(settings.workers),
                         "--pipeline", doubles.BLANK, *(["--lane-port", "0"] if lanes else [])])
    try:
        with RemoteLoader(svc.endpoint, batch_size=settings.batch_size, image_size=settings.image_size,
                          prefetch=settings.window, drop_last=True, pipeline="blank",
                          pipeline_args={"size": settings.image_size}, **({"local": True} if local else {}),
                          **({"lanes": lanes} if lanes else {})) as loader:
            batches = forever(loader)
            try:
                first = next(batches)
                shape = (settings.batch_size, settings.image_size, settings.image_size, 3)
                if tuple(first.images.shape) != shape:
                    raise RuntimeError(f"service: batch of shape {tuple(first.images.shape)}, expected {shape}")
                skipped = not bool(first.raw.any())
                if not skipped:
                    log("warning: the service decoded images: did its workers run the blank pipeline "
                        "(bench/doubles.py)?")
                del first

                def next_batch() -> None:
                    next(batches)

                run = timed(next_batch, settings, lambda: svc.processes())
            finally:
                batches.close()
        return run, skipped
    finally:
        svc.stop()


# ----------------------------------------------------------------------------------- report
def summarize(runs: List[Run]) -> dict:
    """Median of each figure over the rounds."""
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    return {"batches_per_s": med(lambda r: r.batches_per_s), "images_per_s": med(lambda r: r.images_per_s),
            "mb_per_s": med(lambda r: r.mb_per_s),
            "receiver_cpu_ms_per_batch": med(lambda r: r.cpu_ms_per_batch(r.receiver_cpu_s)),
            "sender_cpu_ms_per_batch": med(lambda r: r.cpu_ms_per_batch(r.sender_cpu_s)),
            "sender_io_cpu_us_per_image": med(lambda r: r.io_us_per_image),
            "batches": sum(r.batches for r in runs), "seconds": sum(r.seconds for r in runs)}


def report(results: dict, header: dict) -> dict:
    """Print the table and the target check; return the check."""
    s = header["settings"]
    timing = f"{s['batches']} batches" if s["batches"] > 0 else f"{s['seconds']:g} s"
    print(f"\nmachine: {header['machine']} | batch: {s['batch_size']} x {s['image_size']}x{s['image_size']}x3 uint8 "
          f"({header['image_mb']:.2f} MB image frame + {8 * s['batch_size']} B labels + ~{header['header_bytes']} B "
          f"header) | window: {s['window']} batches | service workers: {s['workers']} | timed: {timing} per row "
          f"per round after {s['warmup']} warm-up batches, {header['rounds']} round(s), median shown | "
          f"transport: tcp://127.0.0.1 (ipc: {header['ipc']}) | command: `{header['command']}`\n")
    print(table_head(["row", "processes (sender -> receiver)", "batches/s", "images/s", "MB/s", "% of raw",
                      "receiver CPU ms / batch", "sender CPU ms / batch", "sending process CPU us / image"],
                     "llrrrrrrr"))
    raw = max(results[RAW]["summary"]["batches_per_s"], results[RAW_ZC]["summary"]["batches_per_s"])
    procs = {RAW: "1 -> 1", RAW_ZC: "1 -> 1", SERVICE: f"1 + {s['workers']} workers -> 1",
             LOCAL: f"1 + {s['workers']} workers -> 1", LANES: f"1 + {s['workers']} workers -> 1", RAW_ZC2: "1 -> 1", TCP1: "1 -> 1", TCP2: "1 -> 1"}
    for name, r in results.items():
        m = r["summary"]
        pct = 100.0 * m["batches_per_s"] / raw if raw else 0.0
        label = LABELS[name].replace("=N", f"={s['lanes']}") if name == LANES else LABELS[name]
        print(table_row([label, procs[name], f"{m['batches_per_s']:.1f}", f"{m['images_per_s']:.0f}",
                         f"{m['mb_per_s']:.0f}", f"{pct:.1f}%", f"{m['receiver_cpu_ms_per_batch']:.2f}",
                         f"{m['sender_cpu_ms_per_batch']:.2f}", f"{m['sender_io_cpu_us_per_image']:.1f}"]))
    ratios = [100.0 * sv.batches_per_s / max(rw.batches_per_s, zc.batches_per_s, 1e-9)
              for rw, zc, sv in zip(results[RAW]["runs"], results[RAW_ZC]["runs"], results[SERVICE]["runs"])]
    if len(ratios) > 1:
        print("\n% of the better raw row, per round: " + ", ".join(f"{x:.1f}%" for x in ratios))
    pct = 100.0 * results[SERVICE]["summary"]["batches_per_s"] / raw if raw else 0.0
    check = {"target": f"transport alone (no decode) >= {100 * TARGET:.0f}% of raw pyzmq", "pass": pct >= 100 * TARGET,
             "pct_of_raw": pct, "pct_of_raw_per_round": ratios,
             "detail": f"{pct:.1f}% ({results[SERVICE]['summary']['batches_per_s']:.1f} vs {raw:.1f} batches/s)"}
    if not all(results[n]["decode_skipped"] for n in (SERVICE, LOCAL, LANES) if n in results):
        check["detail"] += "; WARNING: the service decoded, so this is not the transport alone"
    print(f"\n{'PASS' if check['pass'] else 'MISS'} {check['target']}: {check['detail']}")
    return check


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=2, help="the service's worker processes")
    p.add_argument("--window", type=int, help="batches in flight (credits); default max(4, 2 x workers)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seconds", type=float, default=5.0, help="timed length of each row per round (default 5)")
    g.add_argument("--batches", type=int, default=0, help="time this many batches per row per round instead")
    p.add_argument("--warmup", type=int, default=20, help="batches received before the clock starts")
    p.add_argument("--rounds", type=int, default=3, help="alternate raw and service this many times; medians shown")
    p.add_argument("--demo-size", type=int, default=2000, help="demo images the service serves (its epoch length)")
    p.add_argument("--local", action="store_true", help="add a row: the co-located mode (RemoteLoader(local=True): "
                   "batches read from the service's shared memory instead of the socket)")
    p.add_argument("--lanes", type=int, default=0, metavar="N", help="add a row: the service with bulk lanes "
                   "(--lane-port), its RemoteLoader receiving each batch's bytes on N plain TCP connections")
    p.add_argument("--ceilings", action="store_true", help="add rows that bound the network path: raw pyzmq over "
                   "two connections, raw TCP sockets without ZeroMQ over one connection and striped over two")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--plot", metavar="PNG", help="the table's figure (default: next to --json, else "
                                                 "results/bench_transport.png)")
    args = p.parse_args(argv)
    if args.window is None:
        args.window = max(4, 2 * args.workers)
    for name in ("batch_size", "workers", "window", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.image_size < 8 or args.warmup < 0 or args.batches < 0 or args.seconds <= 0:
        p.error("--image-size must be >= 8, --warmup and --batches >= 0, --seconds > 0")
    if args.demo_size < args.batch_size:
        p.error("--demo-size must be at least --batch-size (the service drops the last partial batch)")
    if args.window > 256:
        p.error("--window must be <= 256 (the client's prefetch limit)")
    if not 0 <= args.lanes <= 8:
        p.error("--lanes must be in [0, 8]")

    settings = Settings(args.batch_size, args.image_size, args.workers, args.window, args.warmup, args.seconds,
                        args.batches, args.demo_size)
    command_line = command("bench.transport", argv)
    header = {"machine": machine(), "command": command_line, "settings": {**asdict(settings), "lanes": args.lanes},
              "rounds": args.rounds,
              "image_mb": settings.image_bytes / 1e6,
              "header_bytes": len(_batch_header(0, args.batch_size, args.image_size)),
              "ipc": "skipped: the service binds tcp only"}
    raise_on_sigterm()  # unwind through every finally: the raw process and the service stop
    results = {RAW: {"runs": []}, RAW_ZC: {"runs": []}, SERVICE: {"runs": [], "decode_skipped": True}}
    if args.local:
        results[LOCAL] = {"runs": [], "decode_skipped": True}
    if args.lanes:
        results[LANES] = {"runs": [], "decode_skipped": True}
    if args.ceilings:
        results.update({name: {"runs": []} for name in CEILINGS})
    try:
        ensure_demo(args.demo_size).close()  # generate it now if needed, not while the service starts
        log(f"transport benchmark: batch {args.batch_size} x {args.image_size}px "
            f"({settings.image_bytes / 1e6:.2f} MB), "
            f"window {args.window}, {args.workers} service workers, {args.rounds} round(s)")
        for i in range(args.rounds):
            for name, zero_copy in ((RAW, False), (RAW_ZC, True)):
                log(f"round {i + 1}/{args.rounds}: {LABELS[name]} ...")
                r = bench_raw(settings, zero_copy)
                results[name]["runs"].append(r)
                log(f"  {r.batches_per_s:.1f} batches/s, {r.mb_per_s:.0f} MB/s ({r.batches} batches in {r.seconds:.2f}s)")
            for name in (SERVICE, *((LOCAL,) if args.local else ()), *((LANES,) if args.lanes else ())):
                log(f"round {i + 1}/{args.rounds}: {LABELS[name]} ...")
                r, skipped = bench_service(settings, local=name == LOCAL, lanes=args.lanes if name == LANES else 0)
                results[name]["runs"].append(r)
                results[name]["decode_skipped"] &= skipped
                log(f"  {r.batches_per_s:.1f} batches/s, {r.mb_per_s:.0f} MB/s ({r.batches} batches in {r.seconds:.2f}s)")
            for name in CEILINGS if args.ceilings else ():
                log(f"round {i + 1}/{args.rounds}: {LABELS[name]} ...")
                r = CEILINGS[name](settings)
                results[name]["runs"].append(r)
                log(f"  {r.batches_per_s:.1f} batches/s, {r.mb_per_s:.0f} MB/s ({r.batches} batches in {r.seconds:.2f}s)")
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    for r in results.values():
        r["summary"] = summarize(r["runs"])
    check = report(results, header)
    plots.bars(plots.png_path(args.plot, args.json, "bench_transport"), "transport alone: MB/s received (median of rounds)",
               {LABELS[n]: r["summary"]["mb_per_s"] for n, r in results.items()}, "MB/s",
               f"{header['machine']}; batch {args.batch_size} x {args.image_size} px, window {args.window}; {command_line}")
    if args.json:
        out = dict(header)
        out["rows"] = {name: {"label": LABELS[name], **r["summary"], "runs": [x.to_json() for x in r["runs"]],
                              **({"decode_skipped": r["decode_skipped"]} if name in (SERVICE, LOCAL) else {})}
                       for name, r in results.items()}
        out["target"] = check
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
