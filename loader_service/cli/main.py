"""``loader-service``: serve datasets, run the demo, talk to a running service."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from loader_service.config import Loaded, ServiceConfig

# The operator commands talk HTTP and import nothing else: no pydantic, numpy or config module
# (a fraction of the start-up of the other commands; docs/benchmarks.md "CLI start-up").
OPERATOR_COMMANDS = ("status", "scale")


def add_operator_parsers(sub) -> None:
    for name, doc in (("status", "show a running service's workers, clients and throughput"),
                      ("scale", "set a running service's worker count (needs the API token: env LOADER_API_TOKEN "
                                "or a file, never on the command line)")):
        p = sub.add_parser(name, help=doc, description=doc)
        if name == "scale":
            p.add_argument("count", type=int)
            from loader_service.cli.operator import add_token_options

            add_token_options(p)
        p.add_argument("--url", default=os.environ.get("LOADER_URL", "http://127.0.0.1:8080"),
                       help="the service's REST address (env LOADER_URL)")
        p.add_argument("--json", action="store_true", help="print the raw JSON")


def build_parser(only_operator: bool = False) -> argparse.ArgumentParser:
    """Every subcommand's arguments (nothing runs); ``only_operator``: just status and scale."""
    parser = argparse.ArgumentParser(prog="loader-service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    if only_operator:
        add_operator_parsers(sub)
        return parser
    from loader_service.cli.settings import add_config_options


    serve = sub.add_parser("serve", help="run the service (every option also reads LOADER_<NAME> from the environment)")
    add_config_options(serve)

    show = sub.add_parser("config", help="print the effective configuration (defaults < --config file < LOADER_* "
                                         "< flags) as TOML with each value's source; the API token is redacted")
    add_config_options(show)

    demo = sub.add_parser("demo", help="serve the embedded demo dataset and stream it into a consumer that "
                                       "prints throughput (no dataset or GPU needed)")
    add_config_options(demo)
    demo.add_argument("--epochs", type=int, default=2)
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--image-size", type=int, default=224)

    add_operator_parsers(sub)

    from loader_service.cli.keys import add_keys_parser

    add_keys_parser(sub)

    from loader_service.sources.pack import add_pack_parser

    add_pack_parser(sub)

    from loader_service.decode.jpeg_prepare import add_prepare_parser

    add_prepare_parser(sub)
    return parser


# Set on the one re-execution below, so the new process knows it is that one.
_REEXEC_MARK = "LOADER_SERVICE_MALLOC_REEXEC"


def _reexec_with_malloc(argv: Optional[List[str]]) -> None:
    """Start ``serve`` again in this process with Python's objects in glibc's malloc
    (``PYTHONMALLOC=malloc``) unless the user chose an allocator. Python's own allocator gives a
    1 MiB arena back only once every object in it is gone, so a few long-lived objects made during
    a connection flood keep tens of MB of arenas resident for good; malloc's free pages go back
    page by page when the dispatcher trims (:mod:`loader_service.dispatch.heap`). Measured after
    8,000 connections: +45 MB resident with Python's allocator, +13 with malloc. The variable is
    taken out of the environment again here, so decode processes keep Python's faster
    allocator. Only for the program itself (``argv`` None), and where ``sys.orig_argv`` (3.10+)
    says how it was started."""
    if os.environ.pop(_REEXEC_MARK, None) is not None:
        os.environ.pop("PYTHONMALLOC", None)  # this process has it; its children need not
        return
    orig = getattr(sys, "orig_argv", None)
    if argv is not None or "PYTHONMALLOC" in os.environ or not orig or not sys.executable:
        return
    env = dict(os.environ, PYTHONMALLOC="malloc", **{_REEXEC_MARK: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, orig, env)


def main(argv: Optional[List[str]] = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(only_operator=bool(words) and words[0] in OPERATOR_COMMANDS)
    args = parser.parse_args(argv)
    if args.command == "serve":
        _reexec_with_malloc(argv)
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if args.command == "pack":
        logging.basicConfig(level="INFO", format=log_format)
        from loader_service.sources.pack import run_pack

        return run_pack(args)
    if args.command == "prepare-jpegs":
        from loader_service.decode.jpeg_prepare import run_prepare

        return run_prepare(args)
    if args.command == "keys":
        from loader_service.cli.keys import run_keys

        return run_keys(args)
    if args.command in ("status", "scale"):
        from loader_service.cli.operator import run_operator

        return run_operator(args)
    from loader_service.cli.settings import format_config

    try:
        loaded = _config(args)
    except ValueError as exc:
        parser.error(str(exc))
    config = loaded.config
    if args.command == "config":
        print(format_config(loaded))
        return 0
    logging.basicConfig(level=config.log_level.upper(), format=log_format)
    if args.command == "serve":
        return _serve(config)
    return _demo(config, args)


def _config(args) -> "Loaded":
    from loader_service.cli.settings import config_from_args

    if args.command != "demo":
        return config_from_args(args)
    # `demo` runs everything in one process on the demo dataset, on free ports unless told otherwise
    return config_from_args(args, demo=True, data=(), data_port=args.data_port or 0, http_port=args.http_port or 0)


def _serve(config: "ServiceConfig") -> int:
    """Run until SIGTERM/SIGINT. Exit code 0 after a clean stop; 1 if the service failed (its
    dispatcher died, or no worker could start) or its stop ran past ``stop_deadline_s``; 2 if it
    could not start at all."""
    import time

    from loader_service.service import Service

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
        print(f"loader-service: {exc.strerror if isinstance(exc, OSError) and exc.strerror and not exc.filename else exc}",
              file=sys.stderr)
        return 2
    # What start-up made (the REST app, the imports: ~74,000 tracked objects) lives as long as the
    # process; frozen, the full collections after a flood (dispatch/heap.py) pass over it: 60 ms
    # of the dispatcher's time per collection becomes under 1 ms.
    gc.freeze()
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
    # The backstop under the stop's own deadline: should this thread itself be stuck, a C thread
    # (no GIL needed) prints every thread's stack and ends the process.
    faulthandler.dump_traceback_later(config.stop_deadline_s + 5.0, exit=True)
    svc.stop()
    faulthandler.cancel_dump_traceback_later()
    if svc.cut:
        # threads that did not stop still hold sockets and mappings: leave now, not through the
        # interpreter's exit (which may wait on them)
        log.error("exiting 1: %s", svc.cut)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 1 if problem else 0


def _demo(config: "ServiceConfig", args) -> int:
    from loader_service.cli.consumer import run  # no torch: the demo runs in the service image too
    from loader_service.service import Service

    with Service(config) as svc:
        print(f"demo: service on {svc.endpoint} with {config.workers} workers, {len(svc.sources['demo'])} demo "
              f"images; status page: {svc.http_url}/ (up while the demo runs: it closes when the demo ends; "
              f"`loader-service serve --demo` keeps one up until stopped)", flush=True)
        return run(svc.endpoint, args.epochs, args.batch_size, args.image_size, name="loader-service demo")


if __name__ == "__main__":
    sys.exit(main())
