"""The operator commands (``loader-service status`` / ``scale``) start without the service's
heavy imports (pydantic, numpy, the config module): they only talk HTTP (issue 40: 4-6 s to
start on a busy machine). What each command imports is checked, not how long it takes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit.paths import REPO_ROOT
from testkit.service import free_port

HEAVY = ("numpy", "pydantic", "loader_service.config", "loader_service.cli.settings", "fastapi", "zmq")

PROBE = """
import json, sys
from loader_service.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = str(exc.code)
print(json.dumps({"exit": code, "heavy": sorted(m for m in %r if m in sys.modules)}))
"""


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["scale", "3"]])
def test_operator_commands_import_nothing_heavy(args):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the command fails after its start-up
    out = subprocess.run([sys.executable, "-c", PROBE % (HEAVY,), *args, "--url", url], cwd=REPO_ROOT,
                         env={"PATH": "/usr/bin:/bin", "LOADER_API_TOKEN": "t", "PYTHONPATH": str(REPO_ROOT)},
                         capture_output=True, text=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["heavy"] == []
    assert f"cannot reach {url}" in got["exit"] and "is the service running?" in got["exit"]


def test_the_full_parser_still_lists_every_command(capsys):
    from loader_service.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    usage = capsys.readouterr().out
    for command in ("serve", "config", "demo", "status", "scale", "keys", "pack", "prepare-jpegs"):
        assert command in usage
