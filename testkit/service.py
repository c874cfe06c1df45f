"""A loader service in its own process, on known or free ports: for tests, chaos runs and the
benchmarks (one helper for all of them)."""

from __future__ import annotations

import collections
import functools
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_RE = re.compile(r"loader-service ready: data (tcp://\S+)\s+REST (http://\S+)")
STOP_TIMEOUT_S = 30.0
CUT_STOP = re.compile(r"\S+ \S+ ERROR loader_service: exiting 1: ")  # the log line of a stop past its deadline


def free_port() -> int:
    """A port free on 127.0.0.1 right now (bind-and-release; fine for tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_shm(cmd: Sequence[str], size_mb: int) -> List[str]:
    """``cmd`` in a private mount namespace whose /dev/shm is a fresh tmpfs of ``size_mb``, as in a
    container of its own: what it makes there is seen by no other process and goes with it. The
    command is exec'd (same pid: signals reach it)."""
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size_mb}m tmpfs /dev/shm && exec "$@"', "sh", *cmd]


@functools.lru_cache(maxsize=None)
def can_own_shm() -> bool:
    """Whether :func:`own_shm` is permitted here (Linux, ``unshare``, the right to mount)."""
    if not shutil.which("unshare") or sys.platform != "linux":
        return False
    return subprocess.run(own_shm(["true"], 1), capture_output=True, timeout=30).returncode == 0


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class ServiceProcess:
    """``python -m loader_service serve`` on 127.0.0.1 as a child process, so it can be
    signalled, SIGKILLed and restarted on the same data port. The constructor returns once the
    service has printed its ready line; it raises (the process stopped) if the service exits
    first or, with ``ready_timeout``, takes longer.

    ``data_port`` / ``http_port``: 0 (the default) lets the service pick (read back from its ready
    line), so no port chosen here can be taken by another process before the service binds it (a
    service's bulk-lane port, say). ``env``: variables set on top of this process's environment
    (a None value removes one); the child also gets ``PYTHONPATH`` with the checkout first and
    ``LOADER_API_TOKEN=token``. ``nofile``: the child's descriptor limit (soft and hard), to test
    what exhausts it.

    ``drain`` (the benchmarks): threads read the child's stdout and stderr as it runs, so a long
    run never blocks on a full pipe; the last 100 stderr lines are kept for error messages
    (``stderr_tail``). Without it the pipes are the caller's (``proc.stderr.read()``,
    ``proc.communicate()``). ``sweep`` (the benchmarks): :meth:`stop` also kills workers that
    outlive the service and unlinks shared memory it left, with a warning, so one run's leftovers
    cannot skew the next; tests leave it off, so that such a leak is found rather than swept.
    ``own_shm_mb``: the service gets a /dev/shm of its own, that size (:func:`own_shm`), as on
    another host or in a container without the shared IPC namespace."""

    def __init__(self, data_port: int = 0, args: Sequence[str] = (), env: Optional[Dict[str, Optional[str]]] = None,
                 token: str = "chaos", nofile: Optional[int] = None, *, http_port: int = 0,
                 drain: bool = False, sweep: bool = False, ready_timeout: Optional[float] = None,
                 log_level: str = "warning", own_shm_mb: int = 0):
        if ready_timeout is not None and not drain:
            raise ValueError("ready_timeout needs drain=True (a blocking read of the ready line has no timeout)")
        self.token, self.sweep = token, sweep
        self.data_port = data_port
        self.http_port = http_port
        self.cmd = [sys.executable, "-m", "loader_service", "serve", "--host", "127.0.0.1",
                    "--data-port", str(data_port), "--http-port", str(self.http_port), "--log-level", log_level, *args]
        if own_shm_mb:
            self.cmd = own_shm(self.cmd, own_shm_mb)
        self.stderr_tail: "collections.deque[str]" = collections.deque(maxlen=100)
        self.stderr_lines = 0  # how many lines the service wrote to stderr (its log), with drain
        self._lines: "queue.Queue[str]" = queue.Queue()
        self._threads: List[threading.Thread] = []
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep)
                                                             if p and p != ROOT])
        child_env["LOADER_API_TOKEN"] = token
        for key, value in (env or {}).items():
            if value is None:
                child_env.pop(key, None)
            else:
                child_env[key] = value

        def limit() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        # same process group: a Ctrl-C in the terminal reaches it too, and it stops itself
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, cwd=ROOT, env=child_env,
                                     preexec_fn=limit if nofile else None)
        if drain:
            self._threads = [threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True),
                             threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True)]
            for t in self._threads:
                t.start()
        try:
            line = self._wait_ready(ready_timeout) if drain else self._read_ready()
        except BaseException:
            self.stop()
            raise
        m = READY_RE.search(line)
        self.endpoint, self.url = m.group(1), m.group(2)
        self.data_port, self.http_port = int(self.endpoint.rsplit(":", 1)[1]), int(self.url.rsplit(":", 1)[1])

    def _pump(self, stream, is_stdout: bool) -> None:
        for line in stream:
            if is_stdout:
                self._lines.put(line)
            else:
                self.stderr_tail.append(line.rstrip("\n"))
                self.stderr_lines += 1

    def _read_ready(self) -> str:
        """The ready line, read from the pipe (the service prints it, and nothing else, on stdout)."""
        for line in self.proc.stdout:
            if READY_RE.search(line):
                return line
        self.proc.wait()
        raise RuntimeError(f"the service did not start (exit code {self.proc.returncode}): {self.proc.stderr.read()}")

    def _wait_ready(self, timeout: Optional[float]) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    for t in self._threads:
                        t.join(5.0)
                    raise RuntimeError(f"the service did not start (exit code {self.proc.returncode}; "
                                       f"{shlex.join(self.cmd)}); its stderr:\n" + "\n".join(self.stderr_tail))
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the service printed no 'loader-service ready:' line within {timeout:.0f}s "
                                       f"({shlex.join(self.cmd)}); its stderr:\n" + "\n".join(self.stderr_tail))
                continue
            if READY_RE.search(line):
                return line

    def assert_alive(self) -> None:
        """Fail with the exit code and the log's tail if the process has exited."""
        assert self.proc.poll() is None, f"the service exited {self.proc.returncode}:\n" + "\n".join(self.stderr_tail)

    def status(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/v1/status", timeout=10) as r:
            return json.loads(r.read())

    def scale(self, n: int) -> dict:
        req = urllib.request.Request(f"{self.url}/v1/workers", data=json.dumps({"count": n}).encode(), method="PUT",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def worker_pids(self) -> List[int]:
        return [w["pid"] for w in self.status()["workers"]["list"] if w["pid"]]

    def processes(self) -> list:
        """The service process and everything it started (its decode workers), as psutil.Process."""
        import psutil

        root = psutil.Process(self.proc.pid)
        return [root] + root.children(recursive=True)

    def kill(self, sig: int = signal.SIGKILL) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(60)

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL if needed (and with ``sweep`` the safety nets); close the pipes.
        Idempotent."""
        import psutil

        running = self.proc.poll() is None
        tree = []
        if self.sweep and running:
            try:
                tree = self.processes()[1:]
            except psutil.Error:
                pass
        if running:
            self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _warn(f"warning: the service did not stop within {STOP_TIMEOUT_S:.0f}s of SIGTERM; killing it")
            self.proc.kill()
            self.proc.wait()
        if self.sweep:
            self._sweep(tree)
        for t in self._threads:
            t.join(5.0)
        if any(t.is_alive() for t in self._threads):
            # closing a pipe a thread still reads would wait for that read (for ever)
            _warn("warning: a process the service started still holds its output pipes open (a worker that "
                  "outlived it?); leaving them")
        else:
            for f in (self.proc.stdout, self.proc.stderr):
                if f and not f.closed:
                    f.close()
        if running and self._threads and self.proc.returncode not in (0, -signal.SIGTERM, -signal.SIGINT):
            tail = "\n".join(self.stderr_tail)
            if any(CUT_STOP.match(line) for line in self.stderr_tail):
                # its stop gave up on a thread at the deadline: a bug to see, not a slow machine
                raise AssertionError(f"the service's stop ran past its deadline; its stderr:\n{tail}")
            _warn(f"warning: the service exited with code {self.proc.returncode}; its stderr:\n{tail}")

    def _sweep(self, tree: list) -> None:
        import psutil

        from loader_service import shm

        _, alive = psutil.wait_procs(tree, timeout=10)
        for p in alive:  # workers exit when the service does; this is only a safety net
            _warn(f"warning: service worker {p.pid} outlived the service; killing it")
            p.kill()
        psutil.wait_procs(alive, timeout=5)
        for name in shm.list_segments(self.proc.pid):  # a stopped service owns nothing
            _warn(f"warning: the stopped service left shared-memory segment {name} behind; removing it")
            try:
                os.unlink(os.path.join(shm.SHM_DIR, name))
            except FileNotFoundError:
                pass
