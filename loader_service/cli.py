"""``loader-service``: serve datasets, run the demo, talk to a running service."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import List, Optional

from .config import ServiceConfig


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="loader-service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the service (every option also reads LOADER_<NAME> from the environment)")
    _service_options(serve)

    demo = sub.add_parser("demo", help="serve the embedded demo dataset and stream it into a consumer that "
                                       "prints throughput (no dataset or GPU needed)")
    _service_options(demo, demo_default=True)
    demo.add_argument("--epochs", type=int, default=2)
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--image-size", type=int, default=224)

    for name, doc in (("status", "show a running service's workers, clients and throughput"),
                      ("scale", "set a running service's worker count (needs the API token: env LOADER_API_TOKEN "
                                "or a file, never on the command line)")):
        p = sub.add_parser(name, help=doc, description=doc)
        if name == "scale":
            p.add_argument("count", type=int)
            from .operator_cli import add_token_options

            add_token_options(p)
        p.add_argument("--url", default=os.environ.get("LOADER_URL", "http://127.0.0.1:8080"),
                       help="the service's REST address (env LOADER_URL)")
        p.add_argument("--json", action="store_true", help="print the raw JSON")

    from .keys_cli import add_keys_parser

    add_keys_parser(sub)

    from .pack import add_pack_parser

    add_pack_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=(getattr(args, "log_level", None) or "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "pack":
        from .pack import run_pack

        return run_pack(args)
    if args.command == "keys":
        from .keys_cli import run_keys

        return run_keys(args)
    if args.command in ("status", "scale"):
        from .operator_cli import run_operator

        return run_operator(args)
    try:
        config = _config(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "serve":
        return _serve(config)
    return _demo(config, args)


def _service_options(p: argparse.ArgumentParser, demo_default: bool = False) -> None:
    src = p.add_mutually_exclusive_group(required=False)
    src.add_argument("--data", action="append", metavar="DIR",
                     help="dataset: an ImageFolder or packed folder, WebDataset .tar shard(s) (a file, a folder, or a "
                          "pattern like shards-{000..009}.tar), or an .h5 file; repeat for several (env LOADER_DATA)")
    src.add_argument("--demo", action="store_true", default=None, help="serve the embedded demo dataset")
    p.add_argument("--demo-size", type=int, help="images in the demo dataset (default 2000)")
    p.add_argument("--workers", type=int, help="decode worker processes (default: CPU count)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 in containers)")
    p.add_argument("--data-port", type=int, help="ZeroMQ data port (default 5555; 0 = any free port)")
    p.add_argument("--http-port", type=int, help="REST port (default 8080; 0 = any free port)")
    p.add_argument("--max-shm-mb", type=int, help="cap on batch slots in shared memory (default 4096)")
    p.add_argument("--on-error", choices=["raise", "skip"], help="a sample that fails to decode: fail the "
                   "client's epoch with the reason (raise, default) or deliver the batch without it (skip)")
    p.add_argument("--task-deadline", type=float, dest="task_deadline_s", metavar="SECONDS",
                   help="a task running longer has its worker killed and replaced, and is redone "
                        "(default 0: derived from measured task times, at least --task-deadline-floor)")
    p.add_argument("--task-deadline-floor", type=float, dest="task_deadline_floor_s", metavar="SECONDS",
                   help="the least a task gets when its deadline is derived (default 10)")
    p.add_argument("--max-skipped", type=int, help="with --on-error skip: samples one stream may skip before it "
                   "fails with the list (default 1000; 0 = no cap)")
    p.add_argument("--max-sample-bytes", type=int, help="a loose image file larger than this is refused through "
                   "--on-error (default 64 MiB)")
    p.add_argument("--max-http-connections", type=int, help="REST connections at once; more are answered 503 "
                   "(default 64)")
    p.add_argument("--http-receipt", type=float, dest="http_receipt_s", metavar="SECONDS",
                   help="a REST request must arrive whole within this, or its connection is closed (default 10)")
    p.add_argument("--max-http-body-bytes", type=int, help="a larger REST body is answered 413 (default 65536)")
    p.add_argument("--autoscale", metavar="MIN:MAX", help="let the autoscaler set the worker count in this range")
    p.add_argument("--autoscale-interval", type=float, dest="autoscale_interval_s", metavar="SECONDS")
    p.add_argument("--curve-keys", metavar="DIR", help="encrypt the data port with CURVE and serve only clients "
                   "whose key is in DIR (made by `loader-service keys DIR`; env LOADER_CURVE_KEYS)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--status-log", type=float, dest="status_log_s", metavar="SECONDS",
                   help="log clients, img/s and workers this often while serving (default 30; 0 = never)")
    p.add_argument("--max-image-pixels", type=int, help="refuse images with more pixels, from their header "
                                                         "(default 178956970)")
    p.add_argument("--jpeg-fast-dct", action="store_true", default=None, help="faster, less accurate JPEG IDCT")
    p.add_argument("--jpeg-fast-upsample", action="store_true", default=None, help="plain JPEG chroma upsampling")
    p.set_defaults(demo_default=demo_default)


def _config(args) -> ServiceConfig:
    overrides = dict(
        data=tuple(args.data) if args.data else None, demo=args.demo, demo_size=args.demo_size,
        workers=args.workers, host=args.host, data_port=args.data_port, http_port=args.http_port,
        max_shm_mb=args.max_shm_mb, on_error=args.on_error, log_level=args.log_level,
        autoscale=args.autoscale, autoscale_interval_s=args.autoscale_interval_s, status_log_s=args.status_log_s,
        task_deadline_s=args.task_deadline_s, task_deadline_floor_s=args.task_deadline_floor_s,
        max_skipped=args.max_skipped, max_image_pixels=args.max_image_pixels, jpeg_fast_dct=args.jpeg_fast_dct,
        jpeg_fast_upsample=args.jpeg_fast_upsample, curve_keys=args.curve_keys, max_sample_bytes=args.max_sample_bytes,
        max_http_connections=args.max_http_connections, http_receipt_s=args.http_receipt_s,
        max_http_body_bytes=args.max_http_body_bytes,
    )
    if args.demo_default:  # `demo` runs everything in one process on free ports
        overrides.update(demo=True, data=())
        overrides["data_port"] = args.data_port if args.data_port is not None else 0
        overrides["http_port"] = args.http_port if args.http_port is not None else 0
    return ServiceConfig.from_env(**overrides)


def _serve(config: ServiceConfig) -> int:
    """Run until SIGTERM/SIGINT. Exit code 0 after a clean stop; 1 if the service failed (its
    dispatcher died, or no worker could start); 2 if it could not start at all."""
    import time

    from .service import Service

    log = logging.getLogger("loader_service")
    svc = Service(config)
    stop = threading.Event()

    def on_signal(signum, _frame):
        if not stop.is_set():
            stop.set()
            log.info("%s: stopping", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        svc.start()
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"loader-service: {exc}", file=sys.stderr)
        return 2
    announced, started = False, time.monotonic()
    # The main thread only watches: for a signal, the first ready worker, a broken pool or a dead
    # dispatcher. Each wait is short and the loop ends on any of them, so SIGTERM is prompt in
    # every state (a pool that cannot start workers included).
    while not stop.is_set():
        problem = svc.problem()
        if problem:
            log.error("stopping: %s", problem)
            break
        if not announced and svc.wait_ready(0.2):
            announced = True
            names = ", ".join(f"{n} ({len(s)} samples)" for n, s in svc.sources.items())
            print(f"loader-service ready: data {svc.endpoint}  REST {svc.http_url}  datasets: {names}  "
                  f"workers: {config.workers}", flush=True)
        elif announced or time.monotonic() - started > 120:
            if not announced:
                log.warning("no worker is up after 120s; see /readyz for why")
                announced = True
            stop.wait(0.5)
    problem = svc.problem()
    svc.stop()
    return 1 if problem else 0


def _demo(config: ServiceConfig, args) -> int:
    from client.demo import consume

    from .service import Service

    with Service(config) as svc:
        print(f"demo: service on {svc.endpoint} (REST {svc.http_url}) with {config.workers} workers, "
              f"{len(svc.sources['demo'])} demo images", flush=True)
        consume(svc.endpoint, epochs=args.epochs, batch_size=args.batch_size, image_size=args.image_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
