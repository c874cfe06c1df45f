"""The compose stack co-located (docker-compose.colocated.yml): the demo trainer joins the loader's
IPC namespace and reads every batch from the service's shared memory, exactly once per epoch from
the trainer image; a trainer container on the same host network but with a /dev/shm of its own
gets every batch over the socket instead, and says so (host networking does not share /dev/shm).

    python -m pytest tests/container -q -m container

Runs on the private dockerd of harness.py, after the other stacks are down (file order).
"""

from __future__ import annotations

import os

import pytest

from tests.container import harness

pytestmark = [pytest.mark.container, pytest.mark.timeout(1200)]

DEMO_SIZE = 256
BATCH = 32
FILES = ("docker-compose.yml", "docker-compose.airgap.yml", "docker-compose.hostnet.yml",
         "docker-compose.colocated.yml")


@pytest.fixture(scope="module")
def colocated_stack(engine, images):
    env, data_port, _ = harness.stack_env(images, "colocated-test", LOADER_DEMO_SIZE=str(DEMO_SIZE),
                                          LOADER_WORKERS="2", TRAINER_EPOCHS="2", TRAINER_BATCH_SIZE=str(BATCH))
    compose = harness.Compose(engine, f"loadercoloc{os.getpid()}", env, files=FILES)
    try:
        compose("up", "-d", "--no-build", "--pull", "never", timeout=400, what="docker compose up -d (co-located)")
        yield {"compose": compose, "endpoint": f"tcp://127.0.0.1:{data_port}", "images": images}
    finally:
        compose.teardown("co-located stack")


def test_the_demo_trainer_reads_every_batch_from_the_loaders_shared_memory(colocated_stack):
    compose = colocated_stack["compose"]
    logs = compose.trainer_finished(2 * DEMO_SIZE)
    batches = 2 * (DEMO_SIZE // BATCH)
    assert f"co-located: all {batches} batches read from the service's shared memory" in logs, logs[-2000:]
    loader = compose.inspect("loader")
    assert loader["HostConfig"]["IpcMode"] == "shareable"
    assert compose.inspect("trainer")["HostConfig"]["IpcMode"] == f"container:{loader['Id']}"


def _verify(colocated_stack, shared_ipc: bool, world_size: int, epoch: int) -> dict:
    """verify_epoch.py --local in the trainer image on the host network: exactly once, and how many
    batches came in place. ``shared_ipc``: as the compose trainer (the loader's IPC namespace), else
    a container of its own (`docker run`, /dev/shm its own)."""
    script, inside = harness.VERIFY_SCRIPT, harness.VERIFY_IN_IMAGE
    check = ["python3", inside, "--endpoint", colocated_stack["endpoint"], "--local", "--world-size",
             str(world_size), "--epoch", str(epoch), "--expect", str(DEMO_SIZE)]
    if shared_ipc:
        p = colocated_stack["compose"]("run", "--rm", "--no-deps", "-T", "-v", f"{script}:{inside}:ro", "trainer",
                                       *check, timeout=300, check=False, what="verify_epoch.py --local")
    else:
        p = colocated_stack["compose"].engine.cli("run", "--rm", "--network", "host", "-v", f"{script}:{inside}:ro",
                                                  colocated_stack["images"]["trainer"], *check, timeout=300,
                                                  check=False, what="verify_epoch.py --local (own /dev/shm)")
    return harness.verified_epoch(p, DEMO_SIZE)


def test_exactly_once_in_place_from_the_trainer_image_and_over_the_socket_without_the_shared_ipc(colocated_stack):
    shared = _verify(colocated_stack, shared_ipc=True, world_size=2, epoch=3)
    assert sum(shared["per_rank"]) == DEMO_SIZE
    assert shared["local_batches"] == shared["batches"] == 2 * (DEMO_SIZE // (2 * BATCH)), shared
    # the same image and host network, but an IPC namespace (and /dev/shm) of its own
    alone = _verify(colocated_stack, shared_ipc=False, world_size=1, epoch=4)
    assert alone["local_batches"] == 0 and alone["batches"] == DEMO_SIZE // BATCH, alone
