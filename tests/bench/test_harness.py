"""bench/ is a package run as ``python -m bench.<name>``: the harness's pieces the scripts share,
and every benchmark command the docs show names a module that exists (no speed is measured)."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest

from bench import harness
from testkit.service import ROOT


def test_tables_are_markdown_with_the_alignment_asked_for():
    assert harness.table_head(["row", "img/s", "runs"], "lrl") == "| row | img/s | runs |\n|---|---:|---|"
    assert harness.table_row(["service", 1, "3 / 4"]) == "| service | 1 | 3 / 4 |"
    with pytest.raises(ValueError):
        harness.table_head(["a", "b"], "l")


def test_medians():
    assert harness.upper_median([3.0, 1.0, 2.0]) == 2.0
    assert harness.upper_median([4.0, 1.0, 3.0, 2.0]) == 3.0  # the upper one: a value that was measured
    assert harness.median_of([{"a": 1, "b": 10}, {"a": 3, "b": 30}]) == {"a": 2, "b": 20}


def test_the_command_line_names_the_module():
    assert harness.command("bench.curve", ["--split", "0:1", "--data", "a b"]) == \
        "python -m bench.curve --split 0:1 --data 'a b'"


def test_parse_split_wants_two_disjoint_cpu_lists():
    assert harness.parse_split("0,1:2") == [{0, 1}, {2}]
    for bad in ("0:0", "0,1:1,2"):
        with pytest.raises(Exception, match="two disjoint CPU lists"):
            harness.parse_split(bad)


def _documented_modules() -> set:
    text = ""
    for path in [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "gpu_session.sh")] + \
            sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path) as f:
            text += f.read()
    return set(re.findall(r"-m (bench(?:\.\w+)+)", text))


def test_every_benchmark_command_in_the_docs_names_a_module():
    modules = _documented_modules()
    assert {"bench.throughput", "bench.transport", "bench.gpu", "bench.reliability.chaos"} <= modules
    missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert not missing, f"README / docs / gpu_session.sh run modules that do not exist: {missing}"


def test_bench_and_tests_reach_the_project_as_packages():
    """No script edits sys.path: bench/ runs with ``-m`` from the repository root."""
    edits = []
    for path in glob.glob(os.path.join(ROOT, "bench", "**", "*.py"), recursive=True) + \
            glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True):
        with open(path) as f:
            edits += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(f, 1)
                      if re.search(r"sys\.path\.(insert|append)", line)]
    assert not edits, edits
