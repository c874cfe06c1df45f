"""The README's module map ("Development") is how a reader finds the rooms: every module of the
repository's code folders is named there, under its own folder, and every name there exists."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from testkit.paths import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")
CODE = (".py", ".c", ".h", ".sh")
NOT_NAMED = {"__init__.py", "__main__.py", "conftest.py"}  # every package has them; the map names what differs
# top-level folders whose every module the map names (tests/ by its folders: test files are many)
MAPPED = ("wire", "loader_service", "client", "bench", "examples", "testkit")


def _sections() -> dict:
    """The map's text under each top-level folder (a line starting in column 0)."""
    with open(README) as f:
        text = f.read()
    block = re.search(r"## Development\n\n```\n(.*?)```", text, re.S)
    assert block, "README.md has no module map under '## Development'"
    sections: dict = {}
    current = None
    for line in block.group(1).splitlines():
        if line and not line[0].isspace():
            current = line.split()[0].rstrip("/")
            sections[current] = line[len(line.split()[0]):] + "\n"
        elif current is not None:
            sections[current] += line + "\n"
    return sections


def _tracked(folder: str) -> list:
    out = subprocess.run(["git", "ls-files", folder], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return [p for p in out.stdout.split() if p.endswith(CODE) and os.path.basename(p) not in NOT_NAMED]


def _section_of(folder: str, sections: dict) -> str:
    return sections[folder]


@pytest.mark.parametrize("folder", MAPPED)
def test_every_module_is_named_under_its_folder(folder):
    sections = _sections()
    text = _section_of(folder, sections)
    files = _tracked(folder)
    assert files, f"git ls-files finds nothing under {folder}/"
    missing = [p for p in files if not re.search(rf"(?<![\w.]){re.escape(os.path.basename(p))}(?!\w)", text)]
    assert not missing, f"README's module map does not name, under {folder}/: {missing}"
    subfolders = {os.path.dirname(os.path.relpath(p, folder)).split(os.sep)[0] for p in files} - {""}
    unnamed = sorted(d for d in subfolders if not re.search(rf"(?<![\w.]){re.escape(d)}/", text))
    assert not unnamed, f"README's module map does not name these folders of {folder}/: {unnamed}"


def test_every_module_the_map_names_exists_in_its_folder():
    sections = _sections()
    wrong = []
    for folder in MAPPED:
        names = {os.path.basename(p) for p in _tracked(folder)} | NOT_NAMED
        for name in set(re.findall(r"(?<![\w./])(\w+\.(?:py|c|h|sh))\b", _section_of(folder, sections))):
            if name not in names:
                wrong.append(f"{folder}/: {name}")
    assert not wrong, f"README's module map names modules that are not there: {wrong}"


def test_the_map_lists_the_top_level_folders_and_the_test_folders():
    sections = _sections()
    for folder in ("wire", "loader_service", "client", "tests", "testkit", "bench", "examples", "deploy"):
        assert folder in sections and os.path.isdir(os.path.join(REPO_ROOT, folder)), folder
    tests_text = sections["tests"]
    test_dirs = sorted(d for d in os.listdir(os.path.join(REPO_ROOT, "tests"))
                       if os.path.isdir(os.path.join(REPO_ROOT, "tests", d)) and not d.startswith(("_", ".")))
    assert [d for d in test_dirs if not re.search(rf"(?<![\w.]){d}/", tests_text)] == []
    listed = re.search(r"unit/<package>/.*?\(([^)]*)\)", tests_text).group(1)
    unit = sorted(d for d in os.listdir(os.path.join(REPO_ROOT, "tests", "unit"))
                  if os.path.isdir(os.path.join(REPO_ROOT, "tests", "unit", d)) and not d.startswith("_"))
    assert sorted(x.strip() for x in listed.split(",")) == unit


@pytest.mark.parametrize("folder", MAPPED)
def test_a_module_in_a_subfolder_is_named_after_that_subfolder(folder):
    """Named under its own room: ``remote/packed.py`` after the map's ``remote/``, not only
    somewhere in its top-level folder's text (where ``sources/packed.py`` also matches)."""
    text = _section_of(folder, _sections())
    wrong = []
    for p in _tracked(folder):
        rel = os.path.relpath(p, folder).split(os.sep)
        at = 0
        for sub in rel[:-1]:  # each folder on its path, in order
            m = re.compile(rf"(?<![\w.]){re.escape(sub)}/").search(text, at)
            at = m.end() if m else len(text)
        if not re.compile(rf"(?<![\w.]){re.escape(rel[-1])}(?!\w)").search(text, at):
            wrong.append(p)
    assert not wrong, f"README's module map does not name these after their own folder: {wrong}"
