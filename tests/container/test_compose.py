"""The compose stack for real: images built offline (the air-gapped build, opted into
explicitly: --network none, WHEELS=required, the debootstrapped base), service + demo trainer up
on host networking with the air-gapped override files, exactly-once delivery checked from inside
the trainer image, workers scaled over REST, and a graceful `docker compose down`.

    deploy/install-prerequisites.sh --container-test      # once per machine
    python -m pytest tests/container -q -m container       # ~5 min cold, less warm

Runs on a private dockerd (see harness.py); skipped, with the reason, where that cannot run.
The tests share one stack and run in file order; the last one takes it down.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.error
import urllib.request

import pytest

from tests.container import harness

pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

DEMO_SIZE = 512
WORKERS = 2
SCALED = 3


def http(method: str, url: str, body=None, token: str = None, timeout: float = 10):
    """(status, parsed JSON or text). Loopback only."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@pytest.fixture(scope="module")
def stack(engine, images):
    """`docker compose up -d` (service + trainer) on free loopback ports; down at the end."""
    token = secrets.token_urlsafe(16)
    env, data_port, http_port = harness.stack_env(images, token, LOADER_DEMO_SIZE=str(DEMO_SIZE),
                                                  LOADER_WORKERS=str(WORKERS), TRAINER_EPOCHS="1",
                                                  TRAINER_BATCH_SIZE="64")
    compose = harness.Compose(engine, f"loadertest{os.getpid()}", env)
    s = {"compose": compose, "token": token, "data_port": data_port, "url": f"http://127.0.0.1:{http_port}",
         "endpoint": f"tcp://127.0.0.1:{data_port}", "down": False}
    try:
        t0 = time.monotonic()
        # --no-build: the images were just built; compose must not try to build or pull.
        compose("up", "-d", "--no-build", "--pull", "never", timeout=400,
                what="docker compose up -d")
        s["up_s"] = round(time.monotonic() - t0, 1)
        yield s
    finally:
        if not s["down"]:
            print("\n--- compose logs (stack torn down by the fixture) ---\n" + compose.logs(tail="80"))
            compose("down", "-v", "--timeout", "30", timeout=120, check=False)
        left = engine.cli("ps", "-a", "-q", timeout=30).stdout.split()
        assert not left, f"containers left behind: {left}"


def test_compose_resolves_the_airgapped_build(engine, images):
    """Compose itself merges the override files into the offline build that harness.build_images
    ran with `docker build`; without them it is the ordinary, online build."""
    def build_settings(*files):
        cfg = json.loads(harness.Compose(engine, "loaderconfig", {}, files=files)(
            "config", "--format", "json", timeout=60, what="docker compose config").stdout)
        return {name: cfg["services"][name]["build"] for name in ("loader", "trainer")}

    for name, b in build_settings("docker-compose.yml", "docker-compose.airgap.yml",
                                  "docker-compose.hostnet.yml").items():
        assert b.get("network") == "none", (name, b)
        assert b["args"]["WHEELS"] == "required" and b["args"]["BASE_IMAGE"] == images["base"], (name, b)
    for name, b in build_settings("docker-compose.yml").items():
        assert "network" not in b and "WHEELS" not in b["args"], (name, b)
        assert b["args"]["BASE_IMAGE"] == "python:3.11-slim-bookworm", (name, b)
    assert b["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_service_is_healthy_with_the_intended_settings(stack):
    compose = stack["compose"]
    info = compose.wait_state("loader", lambda st: st.get("Health", {}).get("Status") == "healthy", 240, "healthy")
    assert info["Config"]["User"] == "10001:10001", "the service must not run as root"
    assert info["HostConfig"]["ShmSize"] == 1 << 30, "shm_size must reach the container"
    assert info["HostConfig"]["NetworkMode"] == "host"
    assert info["HostConfig"]["ReadonlyRootfs"] is True, "read-only root filesystem, as in Kubernetes"
    assert info["Config"]["Healthcheck"]["Test"][0] == "CMD"
    assert info["Path"] == "/usr/bin/tini", "tini must be PID 1"
    status, body = http("GET", stack["url"] + "/readyz")
    assert status == 200 and body["ready"] is True, body
    status, body = http("GET", stack["url"] + "/v1/status")
    assert status == 200 and body["datasets"]["demo"]["length"] == DEMO_SIZE, body
    assert body["workers"]["target"] == WORKERS
    # the service image carries no torch (the trainer image does)
    p = stack["compose"].engine.cli("run", "--rm", "--network", "none", "--entrypoint", "python3",
                                    info["Config"]["Image"], "-c", "import torch", timeout=60, check=False)
    assert p.returncode != 0 and "No module named 'torch'" in p.stderr, p.stderr[-500:]


def test_demo_trainer_finishes_an_epoch(stack):
    compose = stack["compose"]
    logs = compose.trainer_finished(DEMO_SIZE)
    assert "img/s" in logs
    assert compose.inspect("trainer")["Config"]["User"] == "10001:10001"


def verify(stack, world_size: int, epoch: int):
    """Run verify_epoch.py in the trainer image (compose run: same image, host network)."""
    compose, script, inside = stack["compose"], harness.VERIFY_SCRIPT, harness.VERIFY_IN_IMAGE
    p = compose("run", "--rm", "--no-deps", "-T", "-v", f"{script}:{inside}:ro", "trainer",
                "python3", inside, "--endpoint", stack["endpoint"], "--world-size", str(world_size),
                "--epoch", str(epoch), "--expect", str(DEMO_SIZE), timeout=300, check=False,
                what=f"verify_epoch.py world_size={world_size}")
    return harness.verified_epoch(p, DEMO_SIZE)


def test_exactly_once_per_epoch_from_the_trainer_image(stack):
    one = verify(stack, world_size=1, epoch=0)
    assert one["per_rank"] == [DEMO_SIZE]
    two = verify(stack, world_size=2, epoch=1)
    assert sum(two["per_rank"]) == DEMO_SIZE


def test_scale_workers_over_rest(stack):
    url, token = stack["url"], stack["token"]
    status, _ = http("PUT", url + "/v1/workers", {"count": SCALED})
    assert status == 401, "scaling without a token must be refused"
    status, _ = http("PUT", url + "/v1/workers", {"count": SCALED}, token="not-the-token")
    assert status == 403
    status, body = http("PUT", url + "/v1/workers", {"count": SCALED}, token=token)
    assert status == 200, body
    assert body["previous"] == WORKERS and body["target"] == SCALED, body
    deadline = time.monotonic() + 120
    while True:
        status, body = http("GET", url + "/v1/status")
        counts = body["workers"]["counts"]
        if body["workers"]["target"] == SCALED and counts.get("idle", 0) + counts.get("busy", 0) == SCALED:
            break
        assert time.monotonic() < deadline, f"workers did not reach {SCALED}: {body['workers']}"
        time.sleep(0.5)
    status, text = http("GET", url + "/metrics")
    assert status == 200 and f"loader_workers_target {float(SCALED)}" in text, text[:2000]
    # and still exactly once with the new pool
    verify(stack, world_size=1, epoch=2)


def test_compose_down_is_graceful(stack):
    compose = stack["compose"]
    t0 = time.monotonic()
    compose("stop", "--timeout", "30", timeout=120, what="docker compose stop")
    took = time.monotonic() - t0
    info = compose.inspect("loader")
    logs = compose.logs("loader")
    assert info["State"]["ExitCode"] == 0, f"service exit code {info['State']['ExitCode']} (137 = killed)\n{logs}"
    assert not info["State"]["OOMKilled"]
    assert "SIGTERM: stopping" in logs, logs[-2000:]
    assert took < 30, f"stop took {took:.1f}s: the service did not stop on SIGTERM in time"
    compose("down", "-v", "--timeout", "30", timeout=120, what="docker compose down")
    stack["down"] = True
    assert not compose("ps", "-a", "-q", timeout=30).stdout.split()
    print(f"\ncompose up {stack['up_s']}s, stop {took:.1f}s")
