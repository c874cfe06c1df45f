"""GPU path benchmark: H2D bandwidth with and without the receive, and the data stall measured
on the GPU in a real training step.

    python -m bench.gpu --batch-size 128 --json results/gpu-128.json   # NVIDIA GPU
    python -m bench.gpu --batch-size 256 --json results/gpu-256.json

Part 1, one batch (B x S x S x 3 uint8) host -> device, seconds per batch after >= 10 warm-up
iterations (``--warmup``), ended by a synchronize:
  * pageable copy      tensor.to(device) from ordinary memory
  * raw pinned copy    pinned.to(device, non_blocking=True), back to back (the ceiling)
  * pinned ring        client.sinks.CudaSink as the loader drives it: ring wait -> push
                       (side-stream copy, event) -> hand_over (stream wait, record_stream);
                       normalize off (like with like), then on
  * receive only       recv_into a host buffer from a loopback ZeroMQ socket (no GPU)
  * receive + ring     the real path: CudaSink.receive (recv_into the ring's entry) -> push ->
                       hand_over, from the same loopback socket (frames of at most
                       wire.protocol.FRAME_MAX_BYTES, as the service sends them)
  * service -> loader  one client's receive end to end (issue 41): a local loader service with
                       decoding off (bench.doubles' blank pipeline, --workers W) streaming to
                       RemoteLoader(device, normalize off) over loopback TCP, and co-located
                       (local=True: the H2D copy reads the service's slot, page-locked in place
                       with cudaHostRegister; and each batch copied from there into the pinned
                       ring), GB/s of images handed over, the device synchronized at the end
  Targets: pinned ring >= 90% of the raw pinned copy; one client's receive >= 5 GB/s over
  loopback TCP and >= 10 GB/s co-located at batch 256 (issue 41).

Part 2, a training step of a small ResNet (bench.models, bf16 autocast, channels_last):
  * resident     the same batch already on the GPU every step (no data loading at all)
  * fed          batches streamed by a local loader service (subprocess, --workers W)
                 through RemoteLoader(device="cuda", normalize=True)
  Both after >= 10 warm-up steps. Data stall, two ways, both on the GPU's clock:
  * GPU idle     CUDA events recorded on the compute stream at the start and end of every
                 step; the idle time between one step's end and the next one's start (the
                 stream waiting for the CPU or for the batch's copy), over the whole span
  * step ratio   1 - resident step time / fed step time
  Also shown, for comparison only: CPU time blocked in next() / wall time (the old figure; it
  measures CPU blocking, not GPU idle time, since kernel launches are asynchronous).
  Target: stall < 1% when the service outpaces the model (its no-model rate is printed; issue 41,
  after < 2% in issue 14). Each feed in --feeds (tcp, local) is one fed run beside the same resident one.

Without CUDA the GPU rows are skipped with a message and the rest runs on the CPU (receive
only, receive + host sink, the training step with device="cpu", stall by step ratio): that
checks the script end to end (tests/bench/test_bench_gpu_smoke.py runs it so); its figures say nothing
about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Callable, Optional

import torch
import zmq

from bench.harness import command, forever, raise_on_sigterm, start_service, table_head, table_row
from bench.models import SmallResNet
from client import RemoteLoader
from client.config import LoaderConfig
from client.sinks import CudaSink, make_sink
from loader_service.sources.demo import ensure_demo
from wire import protocol as P

MIN_WARMUP = 10


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def per_call(fn: Callable[[], None], iters: int, warmup: int, cuda: bool) -> float:
    """Seconds per call of fn (which may enqueue GPU work), ended by a synchronize."""
    for _ in range(warmup):
        fn()
    sync(cuda)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(cuda)
    return (time.perf_counter() - t0) / iters


def _config(batch: int, size: int, device: str, normalize: bool = False) -> LoaderConfig:
    return LoaderConfig.of("tcp://127.0.0.1:1", batch_size=batch, image_size=size, device=device,
                           normalize=normalize)


def h2d(batch: int, size: int, iters: int, warmup: int) -> dict:
    """Part 1 without the receive (GPU only)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    shape = (batch, size, size, 3)
    nbytes = batch * size * size * 3
    pageable = torch.randint(0, 255, shape, dtype=torch.uint8)
    pinned = pageable.pin_memory()
    out = {}
    out["pageable"] = gbps(nbytes, per_call(lambda: pageable.to(dev), iters, warmup, True))
    out["raw_pinned"] = gbps(nbytes, per_call(lambda: pinned.to(dev, non_blocking=True), iters, warmup, True))
    for normalize in (False, True):
        sink = CudaSink(_config(batch, size, str(dev), normalize), held=2)
        for pinned in sink._ring:  # one output (the images): each entry holds one pinned buffer for it
            pinned.outputs[0].copy_(pageable.view(-1))
        k = [0]

        def one():
            # CudaSink.receive without the socket: a free entry (ring wait), its bytes as they are
            pinned = sink._take_pinned()
            msg = P.Batch(stream=1, epoch=0, index=k[0], indices=list(range(batch)), shape=list(shape))
            k[0] += 1
            sink.hand_over(sink.push(msg, (pinned, [pinned.outputs[0].view(shape)], pinned.labels, False)))

        out["ring_normalize" if normalize else "ring"] = gbps(nbytes, per_call(one, iters, warmup, True))
        sink.close()
    return out


class LoopbackSender:
    """A thread sending the same Batch message (header + images + labels) over loopback TCP,
    as fast as the receiver takes it (PUSH/PULL with a small high-water mark)."""

    def __init__(self, batch: int, size: int):
        self.shape = (batch, size, size, 3)
        self.ctx = zmq.Context(1)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 4)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 4)
        self.push.connect(f"tcp://127.0.0.1:{port}")
        self.images = torch.randint(0, 255, self.shape, dtype=torch.uint8).numpy()
        self.labels = torch.arange(batch, dtype=torch.int64).numpy()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)
        self._thread.start()

    def _send(self) -> None:
        k = 0
        flat = memoryview(self.images.reshape(-1))
        chunk = P.FRAME_MAX_BYTES if flat.nbytes > P.FRAME_MAX_BYTES else 0
        parts, at = [], 0
        for n in P.frame_sizes(flat.nbytes, chunk):  # the image in frames as the service sends it
            parts.append(flat[at:at + n])
            at += n
        while not self._stop.is_set():
            msg = P.Batch(stream=1, epoch=0, index=k, indices=list(range(self.shape[0])), shape=list(self.shape),
                          chunk=chunk)
            frames = P.encode(msg, *parts, self.labels)
            try:
                self.push.send_multipart(frames, copy=False, flags=0)
            except zmq.ZMQError:
                return
            k += 1

    def recv_header(self) -> P.Batch:
        return P.decode_header(self.pull.recv(copy=False))

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a send waiting on the high-water mark
            while self.pull.poll(10):
                self.pull.recv(copy=False)
            self._thread.join(0.1)
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


def receive(batch: int, size: int, iters: int, warmup: int, cuda: bool) -> dict:
    """Part 1 rows with the receive: into a host buffer, and through the loader's sink."""
    nbytes = batch * size * size * 3
    out = {}
    sender = LoopbackSender(batch, size)
    try:
        host = torch.empty(sender.shape, dtype=torch.uint8)
        labels = torch.empty(batch, dtype=torch.int64)

        flat = host.numpy().reshape(-1)

        def recv_only():
            msg = sender.recv_header()
            at = 0
            for n in P.frame_sizes(flat.nbytes, msg.chunk):
                sender.pull.recv_into(flat[at:at + n])
                at += n
            sender.pull.recv_into(labels.numpy())

        out["recv_only"] = gbps(nbytes, per_call(recv_only, iters, warmup, False))
        device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
        sink = make_sink(_config(batch, size, device), held=2)

        def through_sink():
            msg = sender.recv_header()
            sink.hand_over(sink.push(msg, sink.receive(sender.pull, msg)))

        out["recv_sink"] = gbps(nbytes, per_call(through_sink, iters, warmup, cuda))
        sink.close()
    finally:
        sender.close()
    return out


def sink_counters(ld: RemoteLoader) -> dict:
    """What the loader's CUDA sink counted of the co-located path and the lanes' page-locked
    buffers (zeros for another sink)."""
    return {k: getattr(ld._sink, k, 0) for k in ("lent", "lanes_in_place", "pinned", "pinning_s", "settled",
                                                 "settle_s")}


def service_receive(args, cuda: bool, local: bool, register: bool = True, lanes: int = 0) -> float:
    """One client's receive from a real service with decoding off: GB/s of images handed over
    (into the pinned ring and onto the device with CUDA; host tensors without). ``register``
    False: a co-located CUDA loader copies each batch into its pinned ring instead of reading the
    service's page-locked slot. ``lanes``: over TCP, the batches' bytes on that many bulk lanes."""
    from bench import doubles

    CudaSink.register = register

    B, S = args.batch_size, args.image_size
    dev = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    svc = start_service(["--demo", "--demo-size", str(args.demo_size), "--workers", str(args.workers),
                         "--pipeline", doubles.BLANK, *(["--lane-port", "0"] if lanes else [])])
    try:
        with RemoteLoader(svc.endpoint, batch_size=B, image_size=S, device=dev, prefetch=args.prefetch, timeout=300,
                          drop_last=True, pipeline="blank", pipeline_args={"size": S},
                          **({"local": True} if local else {}), **({"lanes": lanes} if lanes else {})) as ld:
            batches = forever(ld)
            for _ in range(args.warmup):
                next(batches)
            sync(cuda)
            t0 = time.perf_counter()
            for _ in range(args.h2d_iters):
                next(batches)
            sync(cuda)
            seconds = time.perf_counter() - t0
            batches.close()
            sink = sink_counters(ld)
            print(f"# receive, {'co-located' if local else f'tcp, {lanes} lanes' if lanes else 'tcp'}"
                  f"{'' if register else ' (copied)'}: {sink}, "
                  f"loader {ld.stats()}")
    finally:
        svc.stop()
        CudaSink.register = True
    return gbps(B * S * S * 3 * args.h2d_iters, seconds)


class StepClock:
    """CUDA events at the start and end of every step on the current stream: the GPU's own
    account of how long it sat idle between steps."""

    def __init__(self):
        self.starts, self.ends = [], []

    def start(self) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.starts.append(e)

    def end(self) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.ends.append(e)

    def idle_fraction(self) -> float:
        torch.cuda.synchronize()
        span = self.starts[0].elapsed_time(self.ends[-1])
        idle = sum(e.elapsed_time(s) for e, s in zip(self.ends[:-1], self.starts[1:]))
        return idle / span


def train(args, cuda: bool) -> dict:
    """The training step with data resident, then fed by a service once per feed in
    ``args.feeds`` (``tcp``: over loopback TCP; ``local``: co-located; ``lanes``: over loopback TCP,
    the bytes on ``args.lanes`` bulk lanes)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = SmallResNet(num_classes=10).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()

    def step(images, labels):
        for _ in range(args.model_passes):  # a model this many times heavier, on the same batch
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = lossf(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    B, S = args.batch_size, args.image_size
    x = torch.randn(B, 3, S, S, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (B,), device=dev)
    resident = per_call(lambda: step(x, y), args.steps, args.warmup, cuda)
    out = {"resident_step_s": resident, "model_rate": B / resident}
    for feed in args.feeds:
        out[feed] = fed(args, cuda, dev, step, resident, local=feed == "local",
                        lanes=args.lanes if feed == "lanes" else 0)
    return out


def fed(args, cuda: bool, dev: torch.device, step, resident: float, local: bool, lanes: int = 0) -> dict:
    B, S = args.batch_size, args.image_size
    svc = start_service(["--demo", "--demo-size", str(args.demo_size), "--workers", str(args.workers),
                         *(["--lane-port", "0"] if lanes else [])])
    try:
        with RemoteLoader(svc.endpoint, batch_size=B, image_size=S, device=str(dev), normalize=True,
                          prefetch=args.prefetch, timeout=300, drop_last=True,
                          **({"local": True} if local else {}), **({"lanes": lanes} if lanes else {})) as ld:
            batches = forever(ld)
            # the service alone: how fast it delivers with no model
            for _ in range(args.warmup):
                next(batches)
            n, t0 = 0, time.perf_counter()
            while n < args.steps * B:
                n += len(next(batches))
            sync(cuda)
            service_rate = n / (time.perf_counter() - t0)
            # training fed by the service: warm-up steps, then measured steps
            for _ in range(args.warmup):
                b = next(batches)
                step(b.images, b.labels)
            sync(cuda)
            clock = StepClock() if cuda else None
            wait, t_start = 0.0, time.perf_counter()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                b = next(batches)  # hand-over: the compute stream waits for this batch's copy here
                wait += time.perf_counter() - t0
                if clock:
                    clock.start()  # recorded after the wait: idle before it counts as stall
                step(b.images, b.labels)
                if clock:
                    clock.end()
            sync(cuda)
            wall = time.perf_counter() - t_start
            batches.close()
            stats = ld.stats()
            sink = sink_counters(ld)
    finally:
        svc.stop()
    step_s = wall / args.steps
    return {"service_rate": service_rate, "fed_step_s": step_s, "stall_step_ratio": max(0.0, 1 - resident / step_s),
            "stall_gpu_idle": clock.idle_fraction() if clock else None,
            "cpu_blocked_in_next": wait / wall, "h2d_s": stats["h2d_s"], "wait_s": stats["wait_s"],
            "lent_from_the_slot": sink["lent"], "sink": sink}


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=128, help="128 and 256 are the recorded runs")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=MIN_WARMUP, help=f"warm-up iterations, at least {MIN_WARMUP}")
    p.add_argument("--prefetch", type=int, default=8)
    p.add_argument("--demo-size", type=int, default=2000)
    p.add_argument("--h2d-iters", type=int, default=50)
    p.add_argument("--model-passes", type=int, default=1,
                   help="forward + backward passes per batch: a heavier model, so that the service can outpace it "
                        "and the stall measures the client's path rather than the service's rate")
    p.add_argument("--feeds", default="tcp,local", type=lambda v: [f for f in v.split(",") if f],
                   help="the training part's loaders, one run each: tcp (loopback), local (co-located), lanes "
                        "(loopback, the bytes on --lanes bulk lanes)")
    p.add_argument("--lanes", type=int, default=2, help="bulk lanes of the lanes receive row and feed (1-8)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.warmup < MIN_WARMUP:
        p.error(f"--warmup must be at least {MIN_WARMUP}")
    if not args.feeds or set(args.feeds) - {"tcp", "local", "lanes"}:
        p.error("--feeds takes tcp, local, lanes or several (comma-separated)")
    if not 1 <= args.lanes <= 8:
        p.error("--lanes must be in [1, 8]")
    if args.model_passes < 1:
        p.error("--model-passes must be at least 1")
    if args.demo_size < args.batch_size:
        p.error("--demo-size must be at least --batch-size (the loader drops the last partial batch)")
    raise_on_sigterm()  # unwind through every finally: the service stops
    cuda = torch.cuda.is_available()
    B, S = args.batch_size, args.image_size
    print(f"# {'GPU: ' + torch.cuda.get_device_name() if cuda else 'no CUDA: GPU rows skipped, CPU rows only'}"
          f"  torch {torch.__version__}  CPUs {os.cpu_count()}")
    print(f"# command: {command('bench.gpu', argv)}\n")
    ensure_demo(args.demo_size).close()  # generate it now if needed, not while the service starts

    h = h2d(B, S, args.h2d_iters, args.warmup) if cuda else {}
    h.update(receive(B, S, args.h2d_iters, args.warmup, cuda))
    h["service_tcp"] = service_receive(args, cuda, local=False)
    h["service_lanes"] = service_receive(args, cuda, local=False, lanes=args.lanes)
    h["service_local"] = service_receive(args, cuda, local=True)
    if cuda:
        h["service_local_copy"] = service_receive(args, cuda, local=True, register=False)
    print(f"## One batch host -> {'device' if cuda else 'host tensors'}, {B * S * S * 3 / 2**20:.2f} MiB uint8\n")
    rows = [("pageable", "pageable tensor.to(device)"), ("raw_pinned", "raw pinned, non_blocking"),
            ("ring", "pinned ring (CudaSink: ring wait, push, hand_over)"),
            ("ring_normalize", "pinned ring + normalize on GPU"),
            ("recv_only", "receive only: recv_into a host buffer (loopback tcp)"),
            ("recv_sink", "receive + pinned ring + H2D (CudaSink.receive/push/hand_over)" if cuda
             else "receive + host sink (HostSink.receive/push)"),
            ("service_tcp", f"service (decode off) -> RemoteLoader({'cuda' if cuda else 'cpu'}), loopback TCP"),
            ("service_lanes", f"service (decode off, --lane-port) -> RemoteLoader({'cuda' if cuda else 'cpu'}, "
                              f"lanes={args.lanes}), loopback TCP, bytes on bulk lanes"),
            ("service_local", f"service (decode off) -> RemoteLoader({'cuda' if cuda else 'cpu'}, local=True), "
                              "shared memory" + (", the copy engine reads the service's slot" if cuda else "")),
            ("service_local_copy", "the same, each batch copied into the pinned ring (no cudaHostRegister)")]
    print(table_head(["path", "GB/s", "% of raw pinned"], "lrr"))
    for k, label in rows:
        if k in h:
            pct = f"{100 * h[k] / h['raw_pinned']:.1f}%" if "raw_pinned" in h else "-"
            print(table_row([label, f"{h[k]:.2f}", pct]))
    if cuda:
        print(f"\nring >= 90% of raw pinned: {'PASS' if h['ring'] >= 0.9 * h['raw_pinned'] else 'MISS'}")
        tcp = max(h["service_tcp"], h["service_lanes"])
        print(f"one client over loopback TCP >= 5 GB/s: {'PASS' if tcp >= 5 else 'MISS'} (data frames "
              f"{h['service_tcp']:.2f}, bulk lanes {h['service_lanes']:.2f}); co-located "
              f">= 10 GB/s: {'PASS' if h['service_local'] >= 10 else 'MISS'} (targets at batch 256)\n")
    else:
        print("\nring vs raw pinned: skipped (no CUDA)\n")

    t = train(args, cuda)
    passes = f" x {args.model_passes} passes per batch" if args.model_passes > 1 else ""
    print(f"## Training step, SmallResNet{passes}, batch {B}, {S}px, bf16 autocast, {args.workers} service workers, "
          f"{args.steps} steps after {args.warmup} warm-up\n")
    print(f"step, data resident on the {'GPU' if cuda else 'CPU'}: {1e3 * t['resident_step_s']:.1f} ms "
          f"({t['model_rate']:.0f} img/s)\n")
    feeds = {"tcp": "loopback TCP", "local": "co-located (local=True)", "lanes": f"loopback TCP, {args.lanes} bulk lanes"}
    print(table_head(["feed", *(feeds[f] for f in args.feeds)], "l" + "r" * len(args.feeds)))
    rows = [("service delivery rate, no model", lambda r: f"{r['service_rate']:.0f} img/s"),
            ("step, fed by the service", lambda r: f"{1e3 * r['fed_step_s']:.1f} ms"),
            ("data stall: GPU idle between steps (CUDA events)",
             lambda r: "-" if r["stall_gpu_idle"] is None else f"{100 * r['stall_gpu_idle']:.2f}%"),
            ("data stall: 1 - resident / fed step time", lambda r: f"{100 * r['stall_step_ratio']:.2f}%"),
            ("(CPU blocked in next() / wall, for comparison)", lambda r: f"{100 * r['cpu_blocked_in_next']:.2f}%"),
            ("batches the GPU copied straight from the service's slot", lambda r: str(r["lent_from_the_slot"])),
            ("batches the GPU copied straight from the lanes' page-locked buffer",
             lambda r: str(r["sink"]["lanes_in_place"])),
            ("loader's time: waiting for data / copies (h2d_s), whole run",
             lambda r: f"{r['wait_s']:.2f} s / {r['h2d_s']:.2f} s"),
            ("mappings page-locked (cudaHostRegister), seconds in it; waits for lent copies, seconds",
             lambda r: f"{r['sink']['pinned']}, {r['sink']['pinning_s']:.3f} s; {r['sink']['settled']}, "
                       f"{r['sink']['settle_s']:.3f} s")]
    for label, cell in rows:
        print(table_row([label, *(cell(t[f]) for f in args.feeds)]))
    print()
    for f in args.feeds:
        r = t[f]
        stall = r["stall_gpu_idle"] if r["stall_gpu_idle"] is not None else r["stall_step_ratio"]
        print(f"{feeds[f]}: service outpaces the model: {r['service_rate'] > t['model_rate']}; stall < 1%: "
              f"{'PASS' if stall < 0.01 else 'MISS'}{'' if cuda else ' (CPU run: not the GPU target)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cuda": cuda, "device": torch.cuda.get_device_name() if cuda else None,
                       "h2d": h, "train": t, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
