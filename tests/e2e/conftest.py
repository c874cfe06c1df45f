"""Fixtures of the end-to-end tests that start service processes of their own."""

from __future__ import annotations

import pytest

from tests.conftest import DEMO_SIZE
from testkit.service import ServiceProcess


@pytest.fixture
def serve_demo(demo_source):
    """Start service processes on the demo set with one decode worker and the extra arguments
    given (``serve_demo("--heartbeat", "0.1")``); all stopped after the test."""
    started = []

    def start(*extra: str) -> ServiceProcess:
        sp = ServiceProcess(args=["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1", *extra], drain=True)
        started.append(sp)
        return sp

    yield start
    for sp in started:
        sp.stop()
