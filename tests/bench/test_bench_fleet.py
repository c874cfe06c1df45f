"""Smoke test of bench.fleet: the benchmark runs end to end with tiny settings against dnsmasq and
three services, and reports the three phases (1, 3, 2 replicas). No speed is asserted."""

from __future__ import annotations

import json

import pytest

from testkit.bench import run_bench
from testkit.dns import dnsmasq_or_skip


@pytest.mark.slow
def test_fleet_benchmark_reports_each_phase(tmp_path):
    dnsmasq_or_skip()
    out = tmp_path / "fleet.json"
    stdout = run_bench("bench.fleet", ["--batches", "4", "--batch-size", "4", "--demo-size", "64",
                                       "--read-delay-ms", "1", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["replicas"] for r in rows] == [1, 3, 2]
    assert all(r["images_per_s"] > 0 for r in rows)
    assert "| 3 replicas (2 joined) | 3 |" in stdout
