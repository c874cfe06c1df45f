"""The ordinary image build (what `docker compose up` does on a machine with internet access):
no wheels, so every Python package comes from the package index. Opt-in, because it needs the
index (PyPI, and for the trainer PyTorch's CPU index) reachable from this host:

    LOADER_ONLINE_BUILD=1 python -m pytest tests/container -q -m container -k online

It builds on the private dockerd (see harness.py) with ``--network host`` (that engine has no
bridge), from a copy of the build context whose wheels folders are empty, and from the
debootstrapped base image standing in for python:3.11-slim-bookworm (Docker Hub may be out of
reach where this runs): without tini, so the base stage installs it with apt as it does on
python:slim, and trusting this host's CA bundle (harness.online_base_image). Knobs:
LOADER_ONLINE_TORCH_INDEX_URL (torch index for the trainer; default: the Dockerfile's, PyTorch's
CPU index), LOADER_ONLINE_TARGETS (default "service trainer").
"""

from __future__ import annotations

import os
import re

import pytest

from tests.container import harness

pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

ONLINE = os.environ.get("LOADER_ONLINE_BUILD", "") not in ("", "0", "false", "no")
TARGETS = os.environ.get("LOADER_ONLINE_TARGETS", "service trainer").split()
BASE_TAG = "loader-online-base:test"


@pytest.fixture(scope="module")
def online(engine, tmp_path_factory):
    if not ONLINE:
        pytest.skip("the online build needs the package index: set LOADER_ONLINE_BUILD=1 to run it")
    base = harness.build_base_image(engine)
    return {"base": harness.online_base_image(engine, base, BASE_TAG),
            "context": harness.wheel_free_context(tmp_path_factory.mktemp("online") / "context")}


def build(engine, online, target: str) -> str:
    # The torch index goes to every build: the classic builder builds all the stages before the
    # target, so the service's build runs the trainer's too (BuildKit skips them).
    index = os.environ.get("LOADER_ONLINE_TORCH_INDEX_URL")
    p = engine.cli("build", "--network", "host", "--build-arg", f"BASE_IMAGE={online['base']}",
                   *(["--build-arg", f"TORCH_INDEX_URL={index}"] if index else []),
                   "--target", target, "-t", f"remote-loader/{target}:online", str(online["context"]),
                   timeout=1200, what=f"docker build --target {target} (online)")
    out = p.stdout + p.stderr
    # Checked on the output of every online build so far: a stage that an earlier build ran (the
    # base stage, and with the classic builder the trainer's) comes from the cache this time.
    online["log"] = log = online.get("log", "") + out
    assert f"pip-install: {target} dependencies from the package index" in log, out[-3000:]
    assert "--no-index" not in log and "from the wheels" not in log
    assert "Setting up tini" in log, "the base stage must have installed tini with apt"
    shown = re.compile(r"pip-install:|Looking in indexes|Successfully installed|Setting up tini|^Step \d+/\d+ : FROM")
    print(f"\n--- docker build --target {target} (online): what was installed ---\n"
          + "\n".join(ln.strip() for ln in out.splitlines() if shown.search(ln)))
    return out


def run_in(engine, image: str, *args: str, entrypoint: str = None):
    return engine.cli("run", "--rm", "--network", "none", *(["--entrypoint", entrypoint] if entrypoint else []),
                      image, *args, timeout=120, check=False)


@pytest.mark.skipif("service" not in TARGETS, reason="LOADER_ONLINE_TARGETS excludes service")
def test_service_image_from_the_package_index(engine, online):
    build(engine, online, "service")
    image = "remote-loader/service:online"
    p = run_in(engine, image, "--help")  # ENTRYPOINT: tini -- loader-service
    assert p.returncode == 0 and "serve" in p.stdout, p.stdout + p.stderr
    p = run_in(engine, image, "-c", "import fastapi, uvicorn, zmq, msgpack, numpy, cv2, simplejpeg, h5py, "
               "prometheus_client, loader_service.service, loader_service.control.http_api", entrypoint="python3")
    assert p.returncode == 0, p.stderr
    p = run_in(engine, image, "-c", "import torch", entrypoint="python3")
    assert p.returncode != 0 and "No module named 'torch'" in p.stderr, p.stderr[-500:]
    info = engine.cli("image", "inspect", "--format", "{{json .Config.User}} {{json .Config.Entrypoint}}", image,
                      timeout=30).stdout
    assert '"10001:10001"' in info and '["/usr/bin/tini","--","loader-service"]' in info, info


@pytest.mark.skipif("trainer" not in TARGETS, reason="LOADER_ONLINE_TARGETS excludes trainer")
def test_trainer_image_from_the_package_index(engine, online):
    build(engine, online, "trainer")
    assert "pip-install: torch" in online["log"]
    p = run_in(engine, "remote-loader/trainer:online", "python3", "-c",
               "import torch, client; from client.demo import consume; print(torch.__version__, torch.version.cuda)")
    assert p.returncode == 0, p.stderr
    version, cuda = p.stdout.split()[-2:]
    assert cuda == "None", f"torch {version} is a CUDA build: the trainer must get the CPU build"
