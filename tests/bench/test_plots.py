"""bench/plots.py draws the benchmark tables' figures: a PNG of the size asked for, where asked."""

from __future__ import annotations

import struct

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is a dev extra")

from bench import plots  # noqa: E402


def _png_size(path) -> tuple:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_bars_and_lines_write_pngs(tmp_path):
    bar = plots.bars(str(tmp_path / "a" / "bars.png"), "images/s", {"DataLoader": 500.0, "service": 900.5},
                     "images/s", note="2 CPUs; demo", reference=("raw limit", 1000.0))
    assert _png_size(bar) == (900, 384)  # 7.5 x 3.2 in at 120 dpi: 2 bars
    line = plots.lines(str(tmp_path / "lines.png"), "scaling", "workers", "images/s",
                       {"raw": ([1, 2, 4], [100, 190, 350]), "service": ([1, 2, 4], [90, 180, 330])})
    assert _png_size(line) == (900, 552)


def test_png_path():
    assert plots.png_path("x/fig.png", "r.json", "bench/b.py") == "x/fig.png"
    assert plots.png_path(None, "out/r.json", "bench/b.py", "-workers") == "out/r-workers.png"
    assert plots.png_path(None, None, "bench/bench_rest.py") == "results/bench_rest.png"
