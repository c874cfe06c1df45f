"""Smoke test of ``python -m bench.gpu``: end to end with tiny settings on whatever this machine
has (without CUDA: the receive rows and the training step on the CPU, GPU rows skipped with a
message); every row present, no process left behind. No speed is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from testkit.bench import ROOT, run_bench

SCRIPT = "bench.gpu"


@pytest.mark.slow
def test_gpu_benchmark_runs_and_reports_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    stdout = run_bench(SCRIPT, ["--batch-size", "8", "--image-size", "32", "--steps", "12", "--demo-size", "64",
                           "--workers", "1", "--h2d-iters", "12", "--model-passes", "2", "--feeds", "tcp,local,lanes",
                           "--json", str(out)])
    result = json.loads(out.read_text())
    cuda = torch.cuda.is_available()
    assert result["cuda"] is cuda
    expected_rows = {"recv_only", "recv_sink", "service_tcp", "service_lanes", "service_local"} | (
        {"pageable", "raw_pinned", "ring", "ring_normalize", "service_local_copy"} if cuda else set())
    assert set(result["h2d"]) == expected_rows
    assert all(v > 0 for v in result["h2d"].values()), result["h2d"]
    t = result["train"]
    assert t["resident_step_s"] > 0 and set(t) == {"resident_step_s", "model_rate", "tcp", "local", "lanes"}
    for feed in ("tcp", "local", "lanes"):  # one fed run each
        r = t[feed]
        assert r["fed_step_s"] > 0 and r["service_rate"] > 0
        assert 0 <= r["stall_step_ratio"] < 1 and 0 <= r["cpu_blocked_in_next"] < 1
        assert (r["stall_gpu_idle"] is not None) is cuda
    # a co-located CUDA loader copies every batch to the GPU straight from the service's slot
    assert (t["local"]["lent_from_the_slot"] > 0) is cuda and t["tcp"]["lent_from_the_slot"] == 0
    assert result["args"]["warmup"] >= 10
    assert "| receive only: recv_into a host buffer (loopback tcp) |" in stdout
    assert "| data stall: 1 - resident / fed step time |" in stdout
    assert "| feed | loopback TCP | co-located (local=True) | loopback TCP, 2 bulk lanes |" in stdout
    assert "bytes on bulk lanes |" in stdout  # the lanes receive row (issue 41)
    assert "shared memory |" in stdout  # the co-located receive row (issue 41)
    assert result["args"]["model_passes"] == 2 and "SmallResNet x 2 passes per batch" in stdout
    if not cuda:
        assert "no CUDA: GPU rows skipped" in stdout and "ring vs raw pinned: skipped (no CUDA)" in stdout


def test_gpu_benchmark_refuses_fewer_than_ten_warmup_iterations():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", SCRIPT, "--warmup", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--warmup must be at least 10" in proc.stderr


def test_gpu_benchmark_refuses_an_unknown_feed():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", SCRIPT, "--feeds", "tcp,carrier-pigeon"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--feeds takes tcp, local, lanes or several" in proc.stderr


def test_gpu_benchmark_refuses_fewer_than_one_model_pass():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", SCRIPT, "--model-passes", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--model-passes must be at least 1" in proc.stderr
