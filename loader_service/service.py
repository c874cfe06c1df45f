"""The service process: datasets, the dispatcher thread and the REST server, started and
stopped together. ``Service`` is what the CLI runs and what tests and benchmarks embed."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from loader_service.control.auth import resolve_token
from loader_service.control.autoscale import Autoscaler, make_autoscaler
from loader_service.config import ServiceConfig
from loader_service.dispatch.loop import Dispatcher, cannot_bind, thread_stack
from loader_service.decode.jpeg import decode_path
from loader_service.control.http_limits import Counters
from loader_service.control.operate import autoscale_step, first_workers, status_json
from loader_service import shm
from loader_service.sources import Source, open_path
from loader_service.sources.demo import ensure_demo

log = logging.getLogger("loader_service")


def open_datasets(config: ServiceConfig) -> Dict[str, Source]:
    """Open every configured dataset; names must be unique. The demo is served only when no
    dataset is given: it never stands beside (or before) a user's, so a client that names no
    dataset gets the first ``data`` path, never the demo."""
    sources: Dict[str, Source] = {}
    try:
        if config.demo and not config.data:
            sources["demo"] = ensure_demo(config.demo_size)
        elif config.demo:
            log.info("demo dataset not served: datasets are given (--data / LOADER_DATA), and the demo is "
                     "served only when none is")
        for path in config.data:
            src = open_path(path, max_sample_bytes=config.max_sample_bytes, remote=config.remote_settings)  # packed, webdataset, hdf5 or imagefolder (sources/detect.py)
            if src.name in sources:
                src.close()
                raise ValueError(f"two datasets are named {src.name!r}; rename one folder")
            sources[src.name] = src
    except BaseException:
        for s in sources.values():
            s.close()
        raise
    return sources


class Service:
    """Run with ``with Service(cfg) as svc:`` (background thread) or ``Service(cfg).run()``."""

    def __init__(self, config: ServiceConfig, sources: Optional[Dict[str, Source]] = None):
        """``sources``: datasets already open (tests pass a fault-injecting double here), which stay
        the caller's to close (one may serve several services in turn); by default they are opened
        from ``config``, and the service closes them when it stops."""
        self.config = config
        self.dispatcher: Optional[Dispatcher] = None
        self.autoscaler: Optional[Autoscaler] = None  # owns the worker count when --autoscale is set
        self._given_sources = sources
        self.sources: Dict[str, Source] = {}
        self._thread: Optional[threading.Thread] = None
        self._http = None
        self._http_thread: Optional[threading.Thread] = None
        self._http_sock: Optional[socket.socket] = None
        self.http_counters = Counters()  # REST connections refused at the cap or closed at the deadline
        self.http_port = 0
        self._stopped = False
        self._stop_lock = threading.Lock()  # a second stop() waits for the first to finish
        self.api_token = ""
        self._token_file = ""  # a generated token's 0600 file, removed on stop
        self._periodic_stop = threading.Event()
        self._periodic: List[threading.Thread] = []  # the autoscaler and the status log line
        self._progress: Optional[Tuple[float, int, int]] = None  # (time, samples, bytes) at the last line
        self.cut = ""  # what a stop left behind, past its deadline ("" when everything stopped)

    @property
    def endpoint(self) -> str:
        assert self.dispatcher is not None, "service not started"
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "*") else self.config.host
        return f"tcp://{host}:{self.dispatcher.data_port}"

    @property
    def http_url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "*") else self.config.host
        return f"http://{host}:{self.http_port}"

    def _open(self) -> None:
        stale = shm.sweep_stale()
        if stale:
            log.info("removed %d shared-memory segments left by dead services", len(stale))
        token = resolve_token(self.config.api_token, self.config.api_token_file, self.config.http_port, self.config.host)
        self.api_token, self._token_file = token.value, token.generated_file
        self.sources = self._given_sources if self._given_sources is not None else open_datasets(self.config)
        log.info("JPEG decode: %s; images above %d pixels are refused", decode_path(), self.config.max_image_pixels)
        try:
            self.autoscaler = make_autoscaler(self.config)
            self.dispatcher = Dispatcher(self.config, self.sources, first_workers(self.config.workers, self.autoscaler))
            self._start_http()
            d, scaler = self.dispatcher, self.autoscaler
            if scaler is not None:
                self._every(scaler.policy.interval_s, lambda: d.call(autoscale_step, d, scaler).result(timeout=30),
                            "loader-autoscale")
            if self.config.status_log_s > 0:
                self._every(self.config.status_log_s, self._log_progress, "loader-status-log")
            if self.config.watch_s > 0:
                self._every(self.config.watch_s, self.watch_datasets, "loader-dataset-watch")
        except BaseException:
            self.stop()
            raise

    def start(self) -> "Service":
        """Start everything, the dispatcher on a background thread. Returns self."""
        self._open()
        assert self.dispatcher is not None
        self._thread = threading.Thread(target=self._run_dispatcher, name="loader-dispatcher", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        """Serve in this thread until :meth:`stop` is called (from a signal handler, say)."""
        self._open()
        try:
            self._run_dispatcher()
        finally:
            self.stop()

    def _run_dispatcher(self) -> None:
        assert self.dispatcher is not None
        try:
            self.dispatcher.run()
        except BaseException:
            # loud, and kept: Dispatcher.failure makes /healthz answer 503 and `serve` exit 1
            log.exception("the dispatcher crashed")

    def _every(self, interval_s: float, fn: Callable[[], None], name: str) -> None:
        """Run ``fn`` every ``interval_s`` on a thread of its own until :meth:`stop`."""

        def loop() -> None:
            # Event.wait is the interval timer: stop() sets the event and the loop ends at once
            while not self._periodic_stop.wait(interval_s):
                try:
                    fn()
                except RuntimeError:  # the dispatcher stopped
                    return
                except Exception:
                    log.exception("%s failed", name)

        t = threading.Thread(target=loop, name=name, daemon=True)
        t.start()
        self._periodic.append(t)

    def watch_datasets(self) -> None:
        """Look for files added to or removed from the datasets since the scan (off the dispatcher
        thread: a changed folder is walked again); say each new finding once, and keep them for
        ``/v1/status``."""
        d = self.dispatcher
        assert d is not None
        found = {}
        for name, src in self.sources.items():
            change = src.changes_on_disk()
            if change is None:
                continue
            found[name] = change
            if d.disk_changes.get(name) != change:
                log.warning("dataset %r changed on disk since the service scanned it: %s. They are not served: "
                            "the index taken at the start is the dataset's identity; restart the service to serve "
                            "them (loaders in the middle of an epoch then stop with [dataset_changed])",
                            name, change.describe())
        d.disk_changes = found  # one assignment: the dispatcher's snapshot reads whole dicts

    def _log_progress(self) -> None:
        """One log line of what the service did since the last one, while it has work."""
        d = self.dispatcher
        assert d is not None
        st = d.call(status_json, d, self.autoscaler).result(timeout=30)
        t, now = st["totals"], time.monotonic()
        last, self._progress = self._progress, (now, t["samples"], t["bytes"])
        streaming = st["clients_streaming"]
        if last is None or (t["samples"] == last[1] and not streaming):
            return  # nothing to say: keep an idle service's log quiet
        dt = max(now - last[0], 1e-9)
        workers = " ".join(f"{k} {v}" for k, v in sorted(st["workers"]["counts"].items())) or "none"
        log.info("serving %d clients (%d streaming): %.0f img/s, %.1f MiB/s over %.0fs; %d samples delivered, "
                 "%d skipped; workers: %s; batch slots %.0f MiB", st["clients_total"], streaming,
                 (t["samples"] - last[1]) / dt, (t["bytes"] - last[2]) / dt / 2**20, dt, t["samples"],
                 t["skipped"], workers, st["shm_bytes"] / 2**20)

    def _start_http(self) -> None:
        import uvicorn

        from loader_service.control.http_api import make_app
        from loader_service.control.http_limits import guarded_protocol, limit_logs, raise_fd_limit

        c = self.config
        raise_fd_limit(c.max_http_connections)
        limit_logs()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host = "0.0.0.0" if c.host == "*" else c.host
        try:
            sock.bind((host, c.http_port))
            sock.listen(c.max_http_connections)  # connections queue here until uvicorn's loop accepts them
        except OSError as exc:
            sock.close()
            raise cannot_bind("REST", host, c.http_port, exc.errno) from None
        self._http_sock = sock
        self.http_port = sock.getsockname()[1]
        assert self.dispatcher is not None
        d = self.dispatcher
        # backlog = the cap: asyncio accepts up to `backlog` connections per wake-up before any is
        # looked at, so a larger one lets a burst take that many descriptors at once
        cfg = uvicorn.Config(make_app(d, lambda: self.api_token, self.problem, self.autoscaler), log_level="warning", lifespan="off",
                             access_log=False, backlog=c.max_http_connections,
                             http=guarded_protocol(c.max_http_connections, c.http_receipt_s, self.http_counters))
        self._http = uvicorn.Server(cfg)
        self._http_thread = threading.Thread(target=self._http.run, kwargs={"sockets": [sock]},
                                             name="loader-http", daemon=True)
        self._http_thread.start()

    def problem(self) -> str:
        """Why the service is failing ("" when it is not): its dispatcher thread died, its REST
        server stopped, or no worker can start. ``/healthz`` answers 503 with this (while it can
        answer), and ``serve`` exits non-zero."""
        d = self.dispatcher
        if d is None:
            return ""
        if d.failure:
            return d.failure
        stopping = self._stopped or self._stop_lock.locked()
        if self._thread is not None and not self._thread.is_alive() and not stopping:
            return "the dispatcher thread has exited"
        if self._http_thread is not None and not self._http_thread.is_alive() and not stopping:
            return "the REST server has stopped (no /healthz, /v1/status or scaling); see the log"
        if d.pool.state.broken:
            return d.pool.state.broken
        return ""

    def wait_ready(self, timeout: float) -> bool:
        """Wait until a worker is up (or ``timeout``); True if one is."""
        assert self.dispatcher is not None, "service not started"
        return self.dispatcher.ready.wait(timeout)

    def stop(self) -> None:
        """Stop serving and release everything, within ``stop_deadline_s``. Idempotent and safe from
        any thread: a call made while another is stopping the service returns only when the service
        is stopped. :attr:`cut` says what did not stop in time ("" when all did)."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stop(time.monotonic() + self.config.stop_deadline_s)
            self._stopped = True

    def _stop(self, deadline: float) -> None:
        # Every wait ends by the deadline: a stop must finish even if a thread is stuck. What did
        # not stop is logged with its stack and left behind (every thread here is a daemon); the
        # dispatcher's sockets are never closed from this thread while its own still runs (a zmq
        # socket belongs to one thread), so then the stop releases what needs no socket (abandon).
        c = self.config
        self._periodic_stop.set()
        for t in self._periodic:
            if t is not threading.current_thread():
                self._join(t, deadline)
        if self.dispatcher is not None:
            self.dispatcher.stop(c.drain_s)
            t = self._thread
            if t is None or t is threading.current_thread() or self._join(t, deadline):
                self.dispatcher.close()
            else:
                self.abandon()
        if self._http is not None:
            self._http.should_exit = True
            if self._http_thread is not None:
                # what is left of the deadline, and a moment even when none is: uvicorn looks at
                # should_exit every 0.1 s
                self._join(self._http_thread, max(deadline, time.monotonic() + 1.0))
        if self._http_sock is not None:
            self._http_sock.close()
        if self._given_sources is None:  # what it opened; given ones are the caller's
            for src in self.sources.values():
                src.close()
        if self._token_file and self.http_port:  # not when another service holds the port (and the file)
            try:
                os.unlink(self._token_file)
            except OSError:
                pass

    def _join(self, t: threading.Thread, deadline: float) -> bool:
        """Wait for ``t`` until ``deadline``; True if it ended. If it did not, say so with its stack
        and add it to :attr:`cut`."""
        t.join(max(0.0, deadline - time.monotonic()))
        if not t.is_alive():
            return True
        log.error("thread %s did not stop within the stop's deadline (%gs); leaving it behind. It is at:\n%s",
                  t.name, self.config.stop_deadline_s, thread_stack(t.ident, t.name))
        self.cut = (f"{self.cut}, {t.name}" if self.cut
                    else f"thread {t.name} did not stop within {self.config.stop_deadline_s:g}s")
        return False

    def abandon(self) -> None:
        """A stop's last resort, safe from any thread while the dispatcher's loop still runs: kill
        the decode workers and unlink the dispatcher's shared memory (its mappings go with the
        process). Clients see their connections drop, and reconnect elsewhere or later."""
        d = self.dispatcher
        if d is None:
            return
        for pid in d.pool.state.pids():
            try:
                os.kill(pid, signal.SIGKILL)  # works on a stopped (SIGSTOP) process too
            except (ProcessLookupError, PermissionError):
                pass
        removed = shm.unlink(d.segment_names())
        log.error("abandoned the stop: killed the decode workers, removed %d shared-memory segments", len(removed))

    def __enter__(self) -> "Service":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
