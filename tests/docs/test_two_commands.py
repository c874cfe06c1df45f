"""The README's two set-up commands (section "Install") are the ones CI runs: .ci/run runs
exactly those lines, in that order, and the test script ends in the README's test command. A
README that shows other commands than CI proves fails here (issue 40)."""

from __future__ import annotations

import os
import re
import stat

from testkit.paths import REPO_ROOT


def _read(*parts: str) -> str:
    with open(os.path.join(REPO_ROOT, *parts)) as f:
        return f.read()


def _commands(text: str) -> list:
    """The command lines of a script or bash block: no comments, blanks, shebang, set or cd lines."""
    out = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#") or re.match(r"(set|cd|echo|export) ", line):
            continue
        out.append(line)
    return out


def readme_two_commands() -> list:
    install = _read("README.md").split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", install, re.S)
    assert block, "README.md's Install section has no bash block"
    return _commands(block.group(1))


def test_ci_runs_the_readmes_two_commands():
    two = readme_two_commands()
    assert len(two) == 2, f"README.md's first Install block should hold the two set-up commands, not {two}"
    assert _commands(_read(".ci", "run")) == two


def test_the_two_scripts_exist_and_are_executable():
    for line in readme_two_commands():
        path = os.path.join(REPO_ROOT, line.split()[0])
        assert os.path.isfile(path), f"{line}: no such script"
        assert os.stat(path).st_mode & stat.S_IXUSR, f"{line}: not executable (git update-index --chmod=+x)"


def test_the_test_script_runs_the_readmes_test_command():
    readme = _read("README.md")
    assert "`python -m pytest -q`" in readme
    script = _commands(_read("run-tests.sh"))
    assert script[-1] == 'python -m pytest -q "$@"'
    assert "SKIP_DEMO=1 ./install.sh" in script  # the same install as the first command, less the demo


def test_the_install_uses_the_pins_and_never_upgrades_pip():
    for name, lock in (("install.sh", "requirements/user.txt"), ("run-tests.sh", "requirements/test.txt")):
        text = _read(name)
        assert lock in text and "--upgrade" not in text, name
    pins = _read("requirements", "test.txt")
    assert not re.search(r"^(torch|nvidia-|triton)", pins, re.M), "torch must be left to the scripts"
    for line in _commands(pins):
        assert re.fullmatch(r"[A-Za-z0-9._-]+(\[[a-z0-9,_-]+\])?==[^ ]+", line), f"not a pin: {line}"
