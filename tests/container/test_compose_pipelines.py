"""An operator's own pipelines in the service container, as docs/deployment.md shows it: the
folder that holds the pipeline modules mounted read-only on the service's Python path with
docker-compose.pipelines.yml, registered with LOADER_PIPELINE. A host client names a pipeline
and gets its outputs; an unknown name is refused with the list of known ones.

    python -m pytest tests/container -q -m container
"""

from __future__ import annotations

import os

import pytest
import torch

from client import LoaderError, RemoteLoader

from tests.container import harness

pytestmark = [pytest.mark.container, pytest.mark.timeout(1200)]

FILES = ("docker-compose.yml", "docker-compose.airgap.yml", "docker-compose.hostnet.yml",
         "docker-compose.pipelines.yml")


@pytest.fixture(scope="module")
def pipeline_stack(engine, images):
    env, data_port, _ = harness.stack_env(
        images, "pipelines-test", LOADER_WORKERS="2",
        PIPELINES_DIR=str(harness.ROOT / "examples"),  # holds the package `pipelines`
        LOADER_PIPELINE="multicrop=pipelines.multicrop:multicrop,colorjitter=pipelines.colorjitter:colorjitter")
    compose = harness.Compose(engine, f"loaderpipelines{os.getpid()}", env, files=FILES)
    try:
        compose("up", "-d", "--no-build", "--pull", "never", "loader", timeout=400,
                what="docker compose up -d loader (pipelines)")
        compose.wait_state("loader", lambda st: st.get("Health", {}).get("Status") == "healthy", 240, "healthy")
        yield {"compose": compose, "endpoint": f"tcp://127.0.0.1:{data_port}"}
    finally:
        compose.teardown("pipelines stack", tail="40")


def test_a_mounted_pipeline_serves_its_declared_outputs(pipeline_stack):
    with RemoteLoader(pipeline_stack["endpoint"], batch_size=4, seed=1, pipeline="multicrop",
                      pipeline_args={"local_crops": 2}, timeout=120, epoch_lookahead=False) as ld:
        batch = next(iter(ld))
        raw = batch.raw_outputs
        assert sorted(raw) == ["global", "local"]
        assert tuple(raw["global"].shape) == (4, 2, 224, 224, 3) and raw["global"].dtype == torch.uint8
        assert tuple(raw["local"].shape) == (4, 2, 96, 96, 3) and raw["local"].dtype == torch.uint8
        assert int(raw["global"].max()) > 0 and len(batch.labels) == 4


def test_an_unknown_pipeline_is_refused_with_the_known_ones(pipeline_stack):
    with RemoteLoader(pipeline_stack["endpoint"], batch_size=4, pipeline="nope", timeout=60) as ld:
        with pytest.raises(LoaderError, match=r"nope.*colorjitter.*multicrop"):
            len(ld)
