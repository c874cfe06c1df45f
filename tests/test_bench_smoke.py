"""Smoke test of the throughput benchmark: it runs end to end with tiny settings, reports all
three contenders with the right sample counts, and leaves no process behind. No speed is
asserted (the machine running the tests may be busy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "bench_throughput.py")


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


@pytest.mark.slow
def test_benchmark_runs_and_reports_three_contenders(tmp_path):
    out = tmp_path / "bench.json"
    tag = uuid.uuid4().hex
    # conftest put LOADER_CACHE_DIR in os.environ: the benchmark and its service inherit it
    env = dict(os.environ, BENCH_SMOKE_TAG=tag)
    demo_size, batch_size, epochs = 64, 16, 1
    cmd = [sys.executable, SCRIPT, "--demo-size", str(demo_size), "--epochs", str(epochs), "--batch-size",
           str(batch_size), "--workers", "1", "--json", str(out)]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: the benchmark stops its service and workers on the way out
            stdout, stderr = proc.communicate(timeout=60)
            pytest.fail(f"the benchmark did not finish in 240s:\n{stdout}\n{stderr}")
    assert proc.returncode == 0, f"benchmark failed:\n{stdout}\n{stderr}"
    assert not _tagged_processes(tag), f"the benchmark left processes behind: {_tagged_processes(tag)}"

    result = json.loads(out.read_text())
    assert result["images"] == demo_size
    assert result["expected_samples"] == epochs * demo_size
    contenders = result["contenders"]
    assert set(contenders) == {"raw_limit", "torch_dataloader", "service_client"}
    for name, c in contenders.items():
        assert c["samples"] == epochs * demo_size, (name, c)
        assert c["images_per_s"] > 0, (name, c)
        assert c["decode_processes"] == 1, (name, c)
    for name in ("torch_dataloader", "service_client"):
        assert contenders[name]["trainer_cpu_s_per_1000_img"] is not None
    assert len(result["targets"]) == 3
    assert "| service + RemoteLoader | 1 |" in stdout
