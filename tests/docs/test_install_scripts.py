"""The set-up scripts say what works on the machine they run on (issue 40): without systemd
the engine hint is dockerd, not `systemctl start docker`; the air-gapped route points to text
the README has; the two set-up scripts parse."""

from __future__ import annotations

import os
import subprocess

import pytest

from testkit.paths import REPO_ROOT


@pytest.mark.parametrize("script", ["install.sh", "run-tests.sh", ".ci/run"])
def test_set_up_scripts_parse(script):
    p = subprocess.run(["bash", "-n", os.path.join(REPO_ROOT, script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr


@pytest.mark.skipif(os.path.isdir("/run/systemd/system"), reason="this machine runs systemd")
def test_engine_hint_without_systemd_starts_dockerd(tmp_path):
    stub = tmp_path / "docker"
    stub.write_text('#!/bin/sh\n[ "$1" = compose ] && { echo 2.40.3; exit 0; }\nexit 1\n')  # engine not answering
    stub.chmod(0o755)
    p = subprocess.run(["sh", os.path.join(REPO_ROOT, "deploy/install-prerequisites.sh"), "--check"],
                       capture_output=True, text=True, timeout=30, env=dict(os.environ, DOCKER=str(stub)))
    assert p.returncode == 1 and "missing: engine-running" in p.stdout
    assert "no systemd here: sudo sh -c 'nohup dockerd" in p.stdout and "systemctl" not in p.stdout


def test_airgap_next_step_names_readme_text():
    with open(os.path.join(REPO_ROOT, "deploy/install-prerequisites.sh")) as f:
        script = f.read()
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(REPO_ROOT, "docs/deployment.md")) as f:
        deployment = f.read()
    assert "Air-gapped hosts" not in script
    assert '\\"No internet or no registry\\"' in script and "**No internet or no registry**" in readme
    assert '\\"Air-gapped build\\"' in script and "### Air-gapped build" in deployment
