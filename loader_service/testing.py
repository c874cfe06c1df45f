"""Helpers for tests and chaos runs: a service in its own process, on known ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A port free on 127.0.0.1 right now (bind-and-release; fine for tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    """``loader-service serve`` as a child process, so it can be SIGKILLed and restarted on the
    same data port. Blocks until the service prints its ready line (or fails to start)."""

    def __init__(self, data_port: int, args: List[str], env: Optional[Dict[str, str]] = None, token: str = "chaos",
                 nofile: Optional[int] = None):
        """``nofile``: the child's descriptor limit (soft and hard), to test what exhausts it."""
        self.data_port, self.http_port, self.token = data_port, free_port(), token

        def limit() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loader_service", "serve", "--host", "127.0.0.1", "--data-port", str(data_port),
             "--http-port", str(self.http_port), "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=limit if nofile else None,
            env=dict(os.environ, PYTHONPATH=ROOT, LOADER_API_TOKEN=token, **(env or {})))
        line = self.proc.stdout.readline()  # the service prints one line when ready, or exits
        if "loader-service ready" not in line:
            self.proc.wait()
            raise RuntimeError(f"the service did not start: {self.proc.stderr.read()}")

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.data_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

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

    def kill(self, sig: int = signal.SIGKILL) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(60)

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL if needed; close pipes. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f and not f.closed:
                f.close()
