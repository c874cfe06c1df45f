"""The first run with your own dataset, as the README tells it: `DATASET_DIR=/path docker
compose run --rm trainer` with no other setting (LOADER_DEMO keeps its default, 1). The service
serves that dataset alone, named after its folder; a client that names no dataset gets exactly
its samples, not the demo's; the command returns when the trainer's epoch is done. And the
service image carries the default demo set, so `up` generates nothing.

    python -m pytest tests/container -q -m container

Runs on the private dockerd of harness.py (host networking, loopback ports).
"""

from __future__ import annotations

import json
import os
import urllib.request

import numpy as np
import pytest

from client import LoaderError, RemoteLoader

from tests.container import harness

pytestmark = [pytest.mark.container, pytest.mark.timeout(1200)]

CLASSES = {"ant": 4, "bee": 5, "cat": 6}  # ImageFolder: classes sorted by name, files by name
N = sum(CLASSES.values())
NAME = "user-images"


def write_dataset(root: str) -> str:
    """A small ImageFolder readable by the service's user (uid 10001): per-class flat colours."""
    from loader_service.sources.demo import encode_jpeg

    os.makedirs(root)
    os.chmod(root, 0o755)
    for label, (cls, count) in enumerate(CLASSES.items()):
        d = os.path.join(root, cls)
        os.makedirs(d)
        os.chmod(d, 0o755)
        for i in range(count):
            img = np.full((48, 64, 3), (40 + 80 * label, 30 * i, 200 - 60 * label), np.uint8)
            path = os.path.join(d, f"{i:03d}.jpg")
            with open(path, "wb") as f:
                f.write(encode_jpeg(img, 90))
            os.chmod(path, 0o644)
    return root


@pytest.fixture(scope="module")
def user_stack(engine, images, tmp_path_factory):
    base = tmp_path_factory.mktemp("dataset")
    os.chmod(base, 0o755)
    dataset = write_dataset(str(base / NAME))
    # no LOADER_DEMO: its default (1) must not shadow the user's dataset
    env, data_port, http_port = harness.stack_env(images, "dataset-test", DATASET_DIR=dataset, LOADER_WORKERS="2",
                                                  TRAINER_EPOCHS="1", TRAINER_BATCH_SIZE="4")
    compose = harness.Compose(engine, f"loaderdataset{os.getpid()}", env)
    try:
        yield {"compose": compose, "dataset": dataset, "endpoint": f"tcp://127.0.0.1:{data_port}",
               "url": f"http://127.0.0.1:{http_port}"}
    finally:
        compose.teardown("dataset stack", tail="40")


def test_compose_run_trainer_streams_the_users_dataset_and_returns(user_stack):
    """The README's first-run command: starts the service (waiting for it to be healthy), runs
    the demo trainer in the foreground, and returns with its exit code when the epoch is done."""
    compose = user_stack["compose"]
    p = compose("run", "--rm", "-T", "--pull", "never", "trainer", timeout=600, check=False,
                what="docker compose run --rm trainer")
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert f"done: {N} images" in p.stdout, p.stdout[-3000:]


def test_service_serves_only_the_users_dataset_named_after_its_folder(user_stack):
    with urllib.request.urlopen(user_stack["url"] + "/v1/status", timeout=10) as r:
        status = json.loads(r.read())
    assert list(status["datasets"]) == [NAME], status["datasets"]
    ds = status["datasets"][NAME]
    assert (ds["length"], ds["num_classes"], ds["changed_on_disk"], ds["on_change"]) == (N, len(CLASSES), None,
                                                                                         "restart"), ds
    logs = user_stack["compose"].logs("loader")
    assert "demo dataset not served: datasets are given" in logs, logs[-2000:]
    assert "generating the demo dataset" not in logs


def test_client_naming_no_dataset_gets_exactly_the_users_samples(user_stack):
    with RemoteLoader(user_stack["endpoint"], batch_size=4, image_size=32, seed=1, timeout=60) as ld:
        got = [(int(i), int(lab)) for b in ld for i, lab in zip(b.indices[:len(b.indices) - b.padding],
                                                                  b.labels.tolist())]
    assert sorted(i for i, _ in got) == list(range(N))
    expected = [label for label, count in enumerate(CLASSES.values()) for _ in range(count)]
    assert [lab for _, lab in sorted(got)] == expected
    with RemoteLoader(user_stack["endpoint"], batch_size=4, image_size=32, dataset="data", timeout=60) as bad:
        with pytest.raises(LoaderError, match=rf"unknown dataset 'data'; this service serves \['{NAME}'\]"):
            len(bad)


def test_service_image_carries_the_default_demo_set(engine, images):
    """`docker compose up` on the demo opens this set instead of generating 2000 JPEGs first."""
    code = ("from loader_service.sources.demo import builtin_demo, ensure_demo, DEFAULT_COUNT; "
            "p = builtin_demo(DEFAULT_COUNT); assert p, 'no built-in demo set'; "
            "s = ensure_demo(DEFAULT_COUNT); print(s.path, len(s)); s.close()")
    p = engine.cli("run", "--rm", "--network", "none", "--read-only", "--entrypoint", "python3", images["service"],
                   "-c", code, timeout=120, check=False, what="built-in demo set")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["/usr/share/loader-service/demo/demo-v1-n2000-s0", "2000"], p.stdout
