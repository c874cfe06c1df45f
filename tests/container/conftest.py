"""Fixtures of the container test: a private Docker engine with the images built offline.

The engine (and everything under it) lives for the session and is always stopped, its temp
dir removed, in the fixture's finally. Set LOADER_REQUIRE_CONTAINER=1 (CI does) to turn
"cannot run here" skips into failures.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.container import harness

REQUIRED = os.environ.get("LOADER_REQUIRE_CONTAINER", "") not in ("", "0", "false", "no")
SERVICE_IMAGE = "remote-loader/service:0.1.0"
TRAINER_IMAGE = "remote-loader/trainer:0.1.0"


def _cannot_run(reason: str):
    if REQUIRED:
        pytest.fail(f"container test required (LOADER_REQUIRE_CONTAINER) but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Replaces the suite-wide leak check (which watches this process's children and sockets):
    here the private dockerd and its containerd are meant to outlive single tests. What must
    not outlive a test here is checked by the fixtures themselves: the compose stack is taken
    down and the engine stopped, with its processes and mounts, at the end of the session."""
    yield


@pytest.fixture(scope="session")
def engine():
    missing = harness.missing_prerequisites()
    if missing:
        _cannot_run("container prerequisites missing: " + ", ".join(missing)
                    + " (install them with: deploy/install-prerequisites.sh --container-test)")
    eng = harness.Engine()
    try:
        try:
            eng.start()
        except harness.EngineUnavailable as exc:
            _cannot_run(f"cannot run dockerd on this machine: {exc}")
        yield eng
    finally:
        eng.stop()
        assert not eng.dir.exists(), f"engine dir {eng.dir} left behind"


@pytest.fixture(scope="session")
def images(engine):
    """Base image (debootstrap, cached), wheels (pip), compose plugin, service + trainer images."""
    timings = {}
    t0 = time.monotonic()
    base = harness.build_base_image(engine)
    timings["base image"] = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()
    harness.fetch_wheels()
    timings["wheels"] = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()
    compose_version = harness.install_compose(engine)
    timings["compose"] = round(time.monotonic() - t0, 1)
    timings.update(harness.build_images(engine, {"service": SERVICE_IMAGE, "trainer": TRAINER_IMAGE}, base))
    print(f"\ncontainer images ready (base {base}, compose {compose_version}); seconds: {timings}")
    return {"base": base, "service": SERVICE_IMAGE, "trainer": TRAINER_IMAGE, "compose": compose_version,
            "timings": timings}
