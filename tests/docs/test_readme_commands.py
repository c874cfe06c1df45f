"""The README's commands are the first thing a new user runs: every ``loader-service ...`` and
``python -m client.demo ...`` line in the bash blocks of README.md and docs/*.md must parse
with the real argument parsers (a renamed or removed option fails here, not on a user's first
try)."""

from __future__ import annotations

from testkit.paths import REPO_ROOT
import glob
import os
import re
import shlex

import pytest

from client.demo import build_parser as demo_parser
from loader_service.cli.main import build_parser

ROOT = REPO_ROOT
SYNOPSIS = re.compile(r"[\[\]|(]|\.\.\.")  # a usage line ("serve (--data DIR ... | --demo) [--workers N]"), not a command


def _commands() -> list:
    text = ""
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path) as f:
            text += f.read()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():  # continuation lines joined
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
                words = words[1:]
            words = [w for w in words if w != "&"]
            if words[:1] == ["loader-service"] and not SYNOPSIS.search(line.split("#")[0]):
                found.append(("loader-service", words[1:]))
            elif words[:3] == ["python", "-m", "client.demo"]:
                found.append(("client.demo", words[3:]))
    return found


COMMANDS = _commands()


def test_the_readme_has_its_quick_start_commands():
    names = {(tool, args[0] if tool == "loader-service" else "") for tool, args in COMMANDS}
    assert {("loader-service", "demo"), ("loader-service", "serve"), ("loader-service", "scale"),
            ("loader-service", "status"), ("client.demo", "")} <= names


@pytest.mark.parametrize("tool, args", COMMANDS, ids=[" ".join(a)[:60] for _, a in COMMANDS])
def test_each_readme_command_parses(tool, args):
    parser = build_parser() if tool == "loader-service" else demo_parser()
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"README or docs: `{tool} {shlex.join(args)}` does not parse (exit {exc.code})")
    # parsed only to be refused when it runs: the hidden --token of `scale` (a token in ps)
    assert getattr(ns, "token", None) is None, f"README or docs: `{tool} {shlex.join(args)}` passes --token, which is refused"
