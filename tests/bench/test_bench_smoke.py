"""Smoke tests of the throughput, transport and pipelines benchmarks: each runs end to end with tiny
settings, reports every row with the right counts, and leaves no process behind. No speed is
asserted (the machine running the tests may be busy)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from testkit.bench import ROOT, run_bench

SCRIPT = "bench.throughput"




@pytest.mark.slow
def test_benchmark_runs_and_reports_three_contenders(tmp_path):
    out = tmp_path / "bench.json"
    demo_size, batch_size, epochs = 64, 16, 1
    stdout = run_bench(SCRIPT, ["--demo-size", str(demo_size), "--epochs", str(epochs), "--batch-size", str(batch_size),
                           "--workers", "1", "--json", str(out)])

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
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the table's figure, next to it



@pytest.mark.slow
def test_benchmark_runs_repeats_and_training_step(tmp_path):
    """--runs 2: every contender and every prefetch depth twice, each run reported; --step-ms:
    the loop sleeps after each batch, so a run lasts at least batches x step."""
    out = tmp_path / "bench.json"
    demo_size, batch_size, step_ms = 32, 16, 40
    stdout = run_bench(SCRIPT, ["--demo-size", str(demo_size), "--epochs", "1", "--batch-size", str(batch_size),
                           "--workers", "1", "--runs", "2", "--step-ms", str(step_ms), "--sweep-prefetch", "1",
                           "--json", str(out)])

    result = json.loads(out.read_text())
    assert result["runs"] == 2 and result["step_ms"] == step_ms
    assert {n: len(v) for n, v in result["runs_images_per_s"].items()} == \
        {"raw_limit": 2, "torch_dataloader": 2, "service_client": 2}
    for name in ("torch_dataloader", "service_client"):  # 2 batches, a 40 ms step after each
        c = result["contenders"][name]
        assert c["samples"] == demo_size and c["seconds"] >= 2 * step_ms / 1000, (name, c)
        assert c["images_per_s"] in result["runs_images_per_s"][name]  # the median run's own figure
    (row,) = result["sweep_prefetch"]
    assert row["prefetch"] == 1 and len(row["runs_stall_pct"]) == 2
    assert "training step: 40 ms per batch | runs: 2 (median)" in stdout


TRANSPORT_SCRIPT = "bench.transport"


def run_transport(tmp_path, batches: int, *extra: str) -> "tuple[dict, str]":
    """bench.transport on tiny batches: 4 x 96 x 96 x 3 = 108 KiB, above the zero-copy threshold;
    32 images = 8 batches per epoch, so the service's row crosses epoch boundaries. Its JSON and output."""
    out = tmp_path / "transport.json"
    stdout = run_bench(TRANSPORT_SCRIPT, ["--batch-size", "4", "--image-size", "96", "--workers", "1", "--batches",
                                     str(batches), "--warmup", "3", "--rounds", "1", "--demo-size", "32",
                                     "--json", str(out), *extra])
    return json.loads(out.read_text()), stdout


@pytest.mark.slow
def test_transport_benchmark_reports_every_row(tmp_path):
    batches = 12
    result, stdout = run_transport(tmp_path, batches)
    rows = result["rows"]
    assert set(rows) == {"raw_pyzmq", "raw_pyzmq_zero_copy", "service_client"}
    for name, row in rows.items():
        assert row["batches"] == batches, (name, row)
        for key in ("batches_per_s", "images_per_s", "mb_per_s"):
            assert row[key] > 0, (name, key, row)
        assert row["images_per_s"] == pytest.approx(4 * row["batches_per_s"]), (name, row)
    assert rows["service_client"]["decode_skipped"] is True  # the workers ran the blank pipeline
    assert result["target"]["pct_of_raw"] > 0
    assert "| raw pyzmq ROUTER -> DEALER, recv_into |" in stdout
    assert "| raw pyzmq ROUTER -> DEALER, recv(copy=False) |" in stdout
    assert "| service (decode off) + RemoteLoader |" in stdout
    assert ("PASS " in stdout) != ("MISS " in stdout)


@pytest.mark.slow
def test_transport_benchmark_ceilings_time_every_batch_over_one_and_two_connections(tmp_path):
    batches = 10
    result, stdout = run_transport(tmp_path, batches, "--ceilings")
    rows = result["rows"]
    assert set(rows) == {"raw_pyzmq", "raw_pyzmq_zero_copy", "service_client", "raw_pyzmq_zero_copy_2",
                         "raw_tcp_1", "raw_tcp_2"}
    for name in ("raw_pyzmq_zero_copy_2", "raw_tcp_1", "raw_tcp_2"):
        assert rows[name]["batches"] == batches, (name, rows[name])
        assert rows[name]["mb_per_s"] == pytest.approx(rows[name]["batches_per_s"] * 4 * 96 * 96 * 3 / 1e6)
    assert "| raw pyzmq ROUTER -> 2 DEALERs, 2 I/O threads, recv(copy=False) |" in stdout
    assert "| raw TCP socket (no ZeroMQ), 1 connection, recv_into |" in stdout
    assert "| raw TCP sockets (no ZeroMQ), 2 connections, a thread each, recv_into |" in stdout


@pytest.mark.slow
def test_pipelines_benchmark_reports_each_contender_and_op(tmp_path):
    out = tmp_path / "pipelines.json"
    stdout = run_bench("bench.pipelines",
                  ["--workers", "1", "--demo-size", "16", "--batch-size", "4", "--repeats", "1", "--op-repeats", "2",
                   "--pipelines", "colorjitter", "--json", str(out)])
    report = json.loads(out.read_text())
    row = report["pipelines"]["colorjitter"]
    assert sorted(row) == ["DataLoader, PIL (torchvision-style)", "DataLoader, same ops", "service + RemoteLoader"]
    assert all(len(r["runs"]) == 1 and r["median"] > 0 for r in row.values())
    assert {"color_jitter(0.4,0.4,0.4,0.1)", "equalize"} <= {r["op"] for r in report["ops"]}
    assert "| colorjitter | " in stdout and "16 images of the demo set" in stdout


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--split needs two CPUs")
def test_curve_benchmark_split_reports_both_rows_with_every_sample(tmp_path):
    out = tmp_path / "curve.json"
    cpus = sorted(os.sched_getaffinity(0))[:2]
    stdout = run_bench("bench.curve",
                  ["--demo-size", "32", "--batch-size", "8", "--epochs", "1", "--rounds", "1", "--workers", "1",
                   "--io-threads", "1", "--split", f"{cpus[0]}:{cpus[1]}", "--json", str(out)])
    report = json.loads(out.read_text())
    assert sorted(report["rounds"]) == ["CURVE, io 1", "plain, io 1"]
    assert all(r["samples"] == 32 for rows in report["rounds"].values() for r in rows)
    assert f"service CPUs [{cpus[0]}], client CPUs [{cpus[1]}]" in stdout
    assert ("PASS:" in stdout) != ("MISS:" in stdout)


def test_curve_benchmark_refuses_overlapping_cpu_lists():
    proc = subprocess.run([sys.executable, "-m", "bench.curve", "--split", "0:0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--split needs two disjoint CPU lists" in proc.stderr


def test_cipher_benchmark_reports_the_floor_and_each_frame_count():
    stdout = run_bench("bench.cipher",
                  ["--mb", "0.5", "--messages", "4", "--rounds", "1", "--frames", "1,4"])
    assert "| libsodium crypto_secretbox alone (one core) |" in stdout
    for frames in (1, 4):
        assert f"| CURVE's extra, {frames} frame(s) |" in stdout
        assert f"per 224x224x3 image, {frames} frame(s): sender +" in stdout


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--split needs two CPUs")
def test_percore_benchmark_reports_both_layouts_and_the_targets(tmp_path):
    from loader_service.sources.demo import demo_image, encode_jpeg

    folder = tmp_path / "photos" / "imagenet" / "class_0"
    folder.mkdir(parents=True)
    for i in range(16):
        (folder / f"{i:02d}.jpg").write_bytes(encode_jpeg(demo_image(0, i, 1), 90))
    cpus = sorted(os.sched_getaffinity(0))[:2]
    stdout = run_bench("bench.percore", ["--photos", str(tmp_path / "photos"), "--groups", "imagenet", "--runs", "1",
                                         "--batch-size", "8", "--epochs", "imagenet:1",
                                         "--split", f"{cpus[0]}:{cpus[1]}"])
    for layout in ("dedicated", "shared"):
        assert "### imagenet (16 photos" in stdout and f", {layout}: service on CPU" in stdout
    assert stdout.count("| service + RemoteLoader (TCP) |") == 2 and stdout.count("| naive loop (") == 2
    assert stdout.count("| service + RemoteLoader(local=True) (co-located, shared memory) |") == 2  # issue 41
    assert stdout.count("service (TCP), CPU per image: decode processes") == 2
    assert stdout.count("service co-located, CPU per image: decode processes") == 2
    assert stdout.count("| service + RemoteLoader(lanes=2) (TCP, bulk lanes) |") == 2
    assert stdout.count("service (TCP, bulk lanes), CPU per image: decode processes") == 2
    assert stdout.count("PASS ") + stdout.count("MISS ") == 6
    assert "co-located: trainer CPU per image <= 10 us" in stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
                    reason="counts instructions under valgrind, not installed here")
def test_trainer_instructions_benchmark_counts_the_timed_epochs_of_each_layout(tmp_path):
    from loader_service.sources.demo import demo_image, encode_jpeg

    folder = tmp_path / "photos" / "imagenet" / "class_0"
    folder.mkdir(parents=True)
    for i in range(16):
        (folder / f"{i:02d}.jpg").write_bytes(encode_jpeg(demo_image(0, i, 1), 90))
    stdout = run_bench("bench.trainer_instructions", ["--photos", str(tmp_path / "photos"), "--layouts", "local,tcp",
                                                      "--epochs", "1", "--batch-size", "8"])
    rows = {line.split(" | ")[0]: line.split(" | ")[1:] for line in stdout.splitlines() if line.startswith("| ")}
    for layout in ("| co-located (local=True)", "| TCP, data frames"):
        images, instructions, per_image = rows[layout]
        assert images == "16" and int(instructions.replace(",", "")) > 16 * 1000  # one epoch counted, and work in it
        assert float(per_image.rstrip(" |").replace(",", "")) == pytest.approx(int(instructions.replace(",", "")) / 16,
                                                                               abs=1)


def test_trainer_instructions_benchmark_says_what_it_needs_without_valgrind(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.trainer_instructions", "--photos", str(tmp_path)], cwd=ROOT,
                          env=dict(os.environ, PATH=str(tmp_path)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "valgrind and callgrind_control not found: this benchmark counts instructions under valgrind" in proc.stderr


@pytest.mark.slow
def test_messages_benchmark_counts_what_a_co_located_trainer_sends_per_batch(tmp_path):
    from loader_service.sources.demo import demo_image, encode_jpeg

    folder = tmp_path / "photos" / "class_0"
    folder.mkdir(parents=True)
    for i in range(16):
        (folder / f"{i:02d}.jpg").write_bytes(encode_jpeg(demo_image(0, i, 1), 90))
    stdout = run_bench("bench.messages", ["--photos", str(tmp_path / "photos"), "--batch-sizes", "4,8",
                                          "--epochs", "2", "--workers", "1"])
    rows = [line.split(" | ") for line in stdout.splitlines() if line.startswith("| 4 |") or line.startswith("| 8 |")]
    assert [r[:2] for r in rows] == [["| 4", "8"], ["| 8", "4"]]  # batches in 2 timed epochs of 16 photos
    for r in rows:  # every figure a number; some batch handed back, in a Request or a Release
        assert all(float(x.split()[0]) >= 0 for x in r[2:8]) and float(r[4]) + float(r[5]) > 0
