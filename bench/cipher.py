"""What CURVE's cipher costs per byte, apart from the service: the floor under bench.curve.

    python -m bench.cipher [--mb 9.6] [--frames 1,16,64] [--messages 50] [--rounds 5]

Two measures, each the median of ``--rounds``:

* **libsodium alone**: ``crypto_secretbox_xsalsa20poly1305`` (what a CURVE message is sealed
  with) over one batch-sized buffer, from the libsodium that pyzmq bundles; CPU seconds per GB.
* **pyzmq PUSH -> PULL on loopback**, sender in a child process, one I/O thread each, plain
  and CURVE: the sender's and the receiver's CPU seconds per GB (process CPU, so libzmq's I/O
  thread included). The receiver copies each message out once, as RemoteLoader does.
  ``--frames`` sends each message as that many equal frames of one multipart message (does
  sealing cache-sized pieces cost less than one big frame?).

CURVE's extra CPU per GB on a side times the bytes per second a rank receives is what the
service (or the trainer) pays for encryption; bench.curve measures it inside the product.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

import numpy as np
import zmq

from bench.harness import table_head, table_row


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def libsodium() -> ctypes.CDLL:
    """The libsodium next to pyzmq's bundled libzmq (the one CURVE runs on)."""
    found = glob.glob(os.path.join(os.path.dirname(zmq.__file__), os.pardir, "pyzmq.libs", "libsodium*"))
    if not found:
        raise SystemExit("no bundled libsodium next to pyzmq (a pyzmq built against a system libzmq?)")
    lib = ctypes.CDLL(found[0])
    if lib.sodium_init() < 0:
        raise SystemExit("sodium_init failed")
    return lib


def secretbox_s_per_gb(nbytes: int, rounds: int) -> float:
    lib = libsodium()
    # crypto_secretbox's NaCl form: 32 zero bytes in front of the message, as libzmq passes it
    m = np.random.default_rng(0).integers(0, 256, nbytes + 32, dtype=np.uint8)
    m[:32] = 0
    c = np.empty_like(m)
    nonce, key = (ctypes.c_ubyte * 24)(), (ctypes.c_ubyte * 32)(*range(32))

    def seal() -> None:
        rc = lib.crypto_secretbox_xsalsa20poly1305(ctypes.c_void_p(c.ctypes.data), ctypes.c_void_p(m.ctypes.data),
                                                   ctypes.c_ulonglong(nbytes + 32), nonce, key)
        assert rc == 0
    seal()  # touch the pages once
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(5):
            seal()
        times.append((time.process_time() - t0) / 5)
    return statistics.median(times) / nbytes * 1e9


def _sender(curve: bool, server_keys, nbytes: int, frames: int, messages: int, port_q, cpu_q) -> None:
    ctx = zmq.Context(io_threads=1)
    push = ctx.socket(zmq.PUSH)
    if curve:
        push.curve_server = True
        push.curve_publickey, push.curve_secretkey = server_keys
    push.sndhwm = 4
    port_q.put(push.bind_to_random_port("tcp://127.0.0.1"))
    payload = memoryview(np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8))
    step = -(-nbytes // frames)
    parts = [payload[i:i + step] for i in range(0, nbytes, step)]
    push.send_multipart(parts, copy=False)  # the first one waits for the connection (and its handshake)
    c0 = cpu_now()
    for _ in range(messages):
        push.send_multipart(parts, copy=False)
    push.close(linger=-1)  # every message handed to the kernel before the clock stops
    cpu_q.put(cpu_now() - c0)
    ctx.term()


def loopback_s_per_gb(curve: bool, nbytes: int, frames: int, messages: int) -> tuple:
    server_keys, (cpub, csec) = zmq.curve_keypair(), zmq.curve_keypair()
    port_q, cpu_q = mp.Queue(), mp.Queue()
    child = mp.Process(target=_sender, args=(curve, server_keys, nbytes, frames, messages, port_q, cpu_q))
    child.start()
    try:
        ctx = zmq.Context(io_threads=1)
        pull = ctx.socket(zmq.PULL)
        if curve:
            pull.curve_serverkey = server_keys[0]
            pull.curve_publickey, pull.curve_secretkey = cpub, csec
        pull.rcvhwm = 4
        pull.rcvtimeo = 30_000  # a broken sender is an error, not a hang
        pull.connect(f"tcp://127.0.0.1:{port_q.get(timeout=30)}")
        out = np.empty(nbytes, np.uint8)
        pull.recv_multipart(copy=False)
        c0, w0 = cpu_now(), time.perf_counter()
        for _ in range(messages):
            at = 0
            for frame in pull.recv_multipart(copy=False):
                piece = np.frombuffer(frame.buffer, np.uint8)
                out[at:at + piece.size] = piece
                at += piece.size
        wall, recv_cpu = time.perf_counter() - w0, cpu_now() - c0
        send_cpu = cpu_q.get(timeout=60)
        pull.close(0)
        ctx.term()
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    gb = nbytes * messages / 1e9
    return send_cpu / gb, recv_cpu / gb, gb / wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=9.633792, help="message size in MB (default: 64 images of 224x224x3)")
    p.add_argument("--frames", default="1", help="comma-separated frame counts per message (default 1)")
    p.add_argument("--messages", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    nbytes = int(args.mb * 1e6)
    print(f"libzmq {zmq.zmq_version()}, pyzmq {zmq.pyzmq_version()}, {os.cpu_count()} CPUs, "
          f"messages of {nbytes / 1e6:.2f} MB, median of {args.rounds}\n")
    box = secretbox_s_per_gb(nbytes, args.rounds)
    print(table_head(["measure", "sender CPU s / GB", "receiver CPU s / GB", "GB/s"], "lrrr"))
    print(table_row(["libsodium crypto_secretbox alone (one core)", f"{box:.3f}", "-", f"{1 / box:.2f}"]))
    img = 224 * 224 * 3 / 1e9
    extras = []
    for frames in (int(f) for f in args.frames.split(",")):
        rows = {}
        for curve in (False, True):
            runs = [loopback_s_per_gb(curve, nbytes, frames, args.messages) for _ in range(args.rounds)]
            rows[curve] = [statistics.median(r[i] for r in runs) for i in range(3)]
        for curve, name in ((False, "plain"), (True, "CURVE")):
            s, r, g = rows[curve]
            print(table_row([f"pyzmq {name}, {frames} frame(s) of {nbytes / frames / 1e6:.2f} MB", f"{s:.3f}", f"{r:.3f}",
                             f"{g:.2f}"]))
        extra_s, extra_r = rows[True][0] - rows[False][0], rows[True][1] - rows[False][1]
        print(table_row([f"CURVE's extra, {frames} frame(s)", f"{extra_s:.3f}", f"{extra_r:.3f}", "-"]))
        extras.append((frames, extra_s, extra_r))
    print()
    for frames, extra_s, extra_r in extras:
        print(f"per 224x224x3 image, {frames} frame(s): sender +{1000 * extra_s * img:.3f} ms, "
              f"receiver +{1000 * extra_r * img:.3f} ms of CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
