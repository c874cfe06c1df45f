"""The compose stack with CURVE keys (docker-compose.curve.yml): the one-shot keys service makes
the keys volume, the demo trainer streams an epoch with them, and a client from the host
without keys is refused with a clear error instead of getting batches.

    python -m pytest tests/container -q -m container

Runs on the private dockerd of harness.py, after test_compose.py's stack is down (file order).
"""

from __future__ import annotations

import os
import time

import pytest

from client import RemoteLoader
from client.errors import LoaderError, LoaderTimeout

from tests.container import harness

pytestmark = [pytest.mark.container, pytest.mark.timeout(1200)]

DEMO_SIZE = 256
FILES = ("docker-compose.yml", "docker-compose.airgap.yml", "docker-compose.hostnet.yml", "docker-compose.curve.yml")


@pytest.fixture(scope="module")
def curve_stack(engine, images):
    env, data_port, http_port = harness.stack_env(images, "curve-test", LOADER_DEMO_SIZE=str(DEMO_SIZE),
                                                  LOADER_WORKERS="2", TRAINER_EPOCHS="1", TRAINER_BATCH_SIZE="32")
    compose = harness.Compose(engine, f"loadercurve{os.getpid()}", env, files=FILES)
    try:
        compose("up", "-d", "--no-build", "--pull", "never", timeout=400, what="docker compose up -d (curve)")
        yield {"compose": compose, "endpoint": f"tcp://127.0.0.1:{data_port}", "url": f"http://127.0.0.1:{http_port}"}
    finally:
        compose.teardown("curve stack")


def test_keys_service_made_the_keys(curve_stack):
    info = curve_stack["compose"].wait_state("keys", lambda st: st["Status"] == "exited", 120, "finished")
    assert info["State"]["ExitCode"] == 0, curve_stack["compose"].logs("keys")


def test_trainer_streams_with_keys(curve_stack):
    compose = curve_stack["compose"]
    compose.trainer_finished(DEMO_SIZE)
    loader_logs = compose.logs("loader")
    assert "data port: CURVE on" in loader_logs, loader_logs[-2000:]


def test_client_without_keys_is_refused(curve_stack, monkeypatch):
    monkeypatch.delenv("LOADER_CURVE_KEYS", raising=False)
    t0 = time.monotonic()
    with RemoteLoader(curve_stack["endpoint"], batch_size=32, timeout=60) as ld:
        with pytest.raises(LoaderError) as info:
            len(ld)
    assert not isinstance(info.value, LoaderTimeout) and info.value.code == "auth_failed", info.value
    print(f"refused in {time.monotonic() - t0:.2f}s")
