"""GPU path benchmark: pinned-ring H2D bandwidth, and data stall in a real training step.

    python bench/bench_gpu.py                 # on a machine with an NVIDIA GPU

Part 1, host-to-device bandwidth for one batch (B x S x S x 3 uint8):
  * pageable copy      tensor.to(device) from ordinary memory
  * raw pinned copy    pinned.to(device, non_blocking=True), back to back (the ceiling)
  * pinned ring        client.sinks.CudaSink: ring slot -> side stream copy -> event, as the
                       loader does it (normalize off, to compare like with like; also shown on)
  Target: ring >= 90% of the raw pinned copy.

Part 2, a training step of a small ResNet (bench/models.py, bf16 autocast, channels_last):
  * resident     the same batch already on the GPU every step (no data loading at all)
  * service      batches streamed by a local loader service (subprocess, --workers W)
                 through RemoteLoader(device="cuda", normalize=True)
  Data stall = time the step loop spent waiting in next() / wall time. Also printed: the
  service's delivery rate with no model, so one can see whether it outpaces the model.
  Target: stall < 2% when the service outpaces the model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.models import SmallResNet  # noqa: E402
from client import RemoteLoader  # noqa: E402
from client.config import LoaderConfig  # noqa: E402
from client.sinks import CudaSink  # noqa: E402
from loader_service import protocol as P  # noqa: E402


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def time_copies(fn, n: int) -> float:
    """Seconds per call of fn (which enqueues GPU work), measured with a final synchronize."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def h2d(batch: int, size: int, iters: int) -> dict:
    dev = torch.device("cuda")
    shape = (batch, size, size, 3)
    nbytes = batch * size * size * 3
    pageable = torch.randint(0, 255, shape, dtype=torch.uint8)
    pinned = pageable.pin_memory()
    out = {"bytes": nbytes}
    out["pageable"] = gbps(nbytes, time_copies(lambda: pageable.to(dev), iters))
    out["raw_pinned"] = gbps(nbytes, time_copies(lambda: pinned.to(dev, non_blocking=True), iters))
    for normalize in (False, True):
        cfg = LoaderConfig(endpoint="tcp://127.0.0.1:1", batch_size=batch, image_size=size, device="cuda",
                           normalize=normalize)
        sink = CudaSink(cfg, dev)
        msg = P.Batch(stream=1, epoch=0, index=0, indices=list(range(batch)), shape=list(shape))
        for slot in sink._ring:
            slot.images.copy_(pageable.view(-1))

        def one():
            slot = sink._ring[sink._next_slot]
            sink._next_slot = (sink._next_slot + 1) % len(sink._ring)
            if slot.copied is not None:
                slot.copied.synchronize()
            sink.push(msg, (slot, slot.images.view(shape), slot.labels))
            for _ in sink.ready(final=False):
                pass

        out["ring_normalize" if normalize else "ring"] = gbps(nbytes, time_copies(one, iters))
        sink.end()
        sink.close()
    return out


def start_service(workers: int, demo_size: int):
    proc = subprocess.Popen([sys.executable, "-m", "loader_service", "serve", "--demo", "--demo-size", str(demo_size),
                             "--workers", str(workers), "--data-port", "0", "--http-port", "0",
                             "--log-level", "warning"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        m = re.search(r"ready: data (tcp://\S+)", line)
        if m:
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("the loader service did not start")


def train(args) -> dict:
    dev = torch.device("cuda")
    model = SmallResNet(num_classes=10).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()

    def step(images, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lossf(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    B, S = args.batch_size, args.image_size
    x = torch.randn(B, 3, S, S, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (B,), device=dev)
    for _ in range(10):
        step(x, y)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(x, y)
    torch.cuda.synchronize()
    resident = (time.perf_counter() - t0) / args.steps

    proc, endpoint = start_service(args.workers, args.demo_size)
    try:
        with RemoteLoader(endpoint, batch_size=B, image_size=S, device="cuda", normalize=True,
                          prefetch=args.prefetch, timeout=300) as ld:
            # service alone: how fast it delivers with no model (one warm-up epoch first)
            for _ in ld:
                pass
            n, t0 = 0, time.perf_counter()
            for b in ld:
                n += len(b)
            torch.cuda.synchronize()
            service_rate = n / (time.perf_counter() - t0)
            # training fed by the service
            done, wait, t_start = 0, 0.0, time.perf_counter()
            while done < args.steps:
                it = iter(ld)
                while done < args.steps:
                    t0 = time.perf_counter()
                    try:
                        b = next(it)
                    except StopIteration:
                        break
                    wait += time.perf_counter() - t0
                    step(b.images, b.labels)
                    done += 1
            torch.cuda.synchronize()
            wall = time.perf_counter() - t_start
            h2d_s = ld.stats()["h2d_s"]
    finally:
        proc.terminate()
        proc.wait(60)
    return {"resident_step_s": resident, "model_rate": B / resident, "service_rate": service_rate,
            "fed_step_s": wall / args.steps, "stall_fraction": wait / wall, "h2d_s": h2d_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--prefetch", type=int, default=8)
    p.add_argument("--demo-size", type=int, default=2000)
    p.add_argument("--h2d-iters", type=int, default=50)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    cmd = "python bench/bench_gpu.py " + " ".join(sys.argv[1:])
    print(f"# GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  CPUs {os.cpu_count()}")
    print(f"# command: {cmd}\n")
    h = h2d(args.batch_size, args.image_size, args.h2d_iters)
    print(f"## H2D, one batch of {h['bytes'] / 2**20:.1f} MiB uint8\n")
    print("| copy | GB/s | % of raw pinned |\n|---|---:|---:|")
    for k, label in (("pageable", "pageable tensor.to(device)"), ("raw_pinned", "raw pinned, non_blocking"),
                     ("ring", "pinned ring (CudaSink)"), ("ring_normalize", "pinned ring + normalize on GPU")):
        print(f"| {label} | {h[k]:.2f} | {100 * h[k] / h['raw_pinned']:.1f}% |")
    print(f"\nring >= 90% of raw pinned: {'PASS' if h['ring'] >= 0.9 * h['raw_pinned'] else 'MISS'}\n")
    t = train(args)
    print(f"## Training step, SmallResNet, batch {args.batch_size}, {args.image_size}px, bf16, "
          f"{args.workers} service workers\n")
    print("| | value |\n|---|---:|")
    print(f"| step, data resident on GPU | {1e3 * t['resident_step_s']:.1f} ms ({t['model_rate']:.0f} img/s) |")
    print(f"| service delivery rate, no model | {t['service_rate']:.0f} img/s |")
    print(f"| step, fed by the service | {1e3 * t['fed_step_s']:.1f} ms |")
    print(f"| data stall (waiting in next()) | {100 * t['stall_fraction']:.2f}% |")
    outpaces = t["service_rate"] > t["model_rate"]
    print(f"\nservice outpaces the model: {outpaces}; stall < 2%: "
          f"{'PASS' if t['stall_fraction'] < 0.02 else 'MISS'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"h2d": h, "train": t, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
