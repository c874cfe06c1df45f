"""The torch-free consumer behind ``loader-service demo``: every sample once per epoch, labels as
the dataset has them, and the demo command runs where torch cannot be imported."""

from __future__ import annotations

from testkit.paths import REPO_ROOT
import io
import os
import subprocess
import sys

import numpy as np

from loader_service.cli.consumer import Consumer, consume

from tests.conftest import DEMO_SIZE

ROOT = REPO_ROOT


def test_every_sample_once_per_epoch(make_service, demo_source):
    svc = make_service(workers=2)
    with Consumer(svc.endpoint, batch_size=32, image_size=32, prefetch=3, timeout=60) as c:
        for epoch in range(2):
            seen = []
            for images, labels, indices in c.epoch(epoch):
                assert images.shape == (len(indices), 32, 32, 3) and images.dtype == np.uint8
                assert labels.tolist() == demo_source.labels[indices].tolist()
                seen += indices
            assert sorted(seen) == list(range(DEMO_SIZE))
            assert c.num_batches == -(-DEMO_SIZE // 32)


def test_consume_prints_progress_and_totals(make_service):
    svc = make_service(workers=1)
    out = io.StringIO()  # not a terminal: a line per quarter instead of a bar
    totals = consume(svc.endpoint, epochs=1, batch_size=40, image_size=16, out=out, timeout=60)
    assert totals["samples"] == DEMO_SIZE and totals["epochs"] == 1
    lines = out.getvalue().splitlines()
    assert lines[-2].startswith(f"epoch 0: {DEMO_SIZE} images in ")
    assert lines[-1].startswith(f"done: {DEMO_SIZE} images in ")
    assert any(line.startswith("epoch 0 [   6/6]") for line in lines)


def test_demo_command_runs_without_torch():
    # `import torch` fails in this process, as in the service image
    code = ("import sys; sys.modules['torch'] = None; from loader_service.cli.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "demo", "--demo-size", str(DEMO_SIZE), "--workers", "1",
                        "--epochs", "1", "--batch-size", "48", "--image-size", "16", "--status-log", "0"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert "status page: http://127.0.0.1:" in r.stdout
    assert f"done: {DEMO_SIZE} images" in r.stdout


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_client_demo_draws_a_progress_bar_on_a_terminal(make_service):
    """The compose file's trainer (python -m client.demo, tty: true) shows a tqdm bar."""
    from client.demo import consume as client_consume

    svc = make_service(workers=1)
    out = _Terminal()
    totals = client_consume(svc.endpoint, epochs=1, batch_size=40, image_size=16, out=out, timeout=60)
    assert totals["samples"] == DEMO_SIZE
    text = out.getvalue()
    assert "epoch 0: 100%" in text and "6/6" in text and "img/s" in text


def test_client_demo_says_whether_its_batches_came_from_shared_memory(make_service, monkeypatch):
    """``--local`` (or TRAINER_LOCAL=1, as docker-compose.colocated.yml sets): the demo ends by
    saying how many batches came from the service's shared memory; where that memory is not
    shared (another container without the loader's IPC namespace) it says so and where to look."""
    from client import local as client_local
    from client.demo import build_parser, consume as client_consume

    assert build_parser().parse_args([]).local is False
    monkeypatch.setenv("TRAINER_LOCAL", "1")
    assert build_parser().parse_args([]).local is True
    monkeypatch.setenv("TRAINER_LOCAL", "0")
    assert build_parser().parse_args([]).local is False

    svc = make_service(workers=1)
    out = io.StringIO()
    totals = client_consume(svc.endpoint, epochs=2, batch_size=40, image_size=16, out=out, timeout=60, local=True)
    assert totals["samples"] == 2 * DEMO_SIZE
    assert "co-located: all 12 batches read from the service's shared memory" in out.getvalue().splitlines()

    monkeypatch.setattr(client_local, "SHM_DIR", "/nonexistent-shm")  # as from a container of its own
    out = io.StringIO()
    totals = client_consume(svc.endpoint, epochs=1, batch_size=40, image_size=16, out=out, timeout=60, local=True)
    assert totals["samples"] == DEMO_SIZE
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("co-located:"))
    assert line.startswith("co-located: 0 of 6 batches read from the service's shared memory, the rest over the "
                           "socket: this container or host does not share the service's /dev/shm"), line
