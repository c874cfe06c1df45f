"""Running a benchmark module to its end in a test: ``python -m bench.x`` from the repository
root, failing on an error, a hang or a process left behind."""

import os
import subprocess
import sys
import uuid

import psutil
import pytest

from testkit.paths import REPO_ROOT as ROOT


def _tagged_processes(tag: str) -> list:
    """Processes (anyone's children, orphans included) whose environment carries ``tag``."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("BENCH_SMOKE_TAG") == tag:
                found.append((p.pid, " ".join(p.cmdline())[:120]))
        except psutil.Error:
            continue
    return found


def run_bench(script: str, args: list) -> str:
    """Run a benchmark module (``python -m bench.x`` from the repository root) to the end; its
    stdout. Fails on an error, a hang or leftovers."""
    tag = uuid.uuid4().hex
    # conftest put LOADER_CACHE_DIR in os.environ: the benchmark and its service inherit it
    env = dict(os.environ, BENCH_SMOKE_TAG=tag)
    cmd = [sys.executable, "-m", script, *args]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: the benchmark stops its service and workers on the way out
            stdout, stderr = proc.communicate(timeout=60)
            pytest.fail(f"{script} did not finish in 240s:\n{stdout}\n{stderr}")
    assert proc.returncode == 0, f"{script} failed:\n{stdout}\n{stderr}"
    assert not _tagged_processes(tag), f"{script} left processes behind: {_tagged_processes(tag)}"
    return stdout
