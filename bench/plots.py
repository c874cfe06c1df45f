"""Figures for the benchmark tables: one PNG next to each table a script prints.

matplotlib is a dev extra (``pip install -e ".[dev]"``); without it a script prints its tables
and says it drew nothing. The Agg backend draws to files only: no display is needed.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Optional, Sequence, Tuple


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[dev]')", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_path(plot: Optional[str], json_path: Optional[str], script: str, suffix: str = "") -> str:
    """Where a table's figure goes: ``--plot`` as given, else next to the ``--json`` file, else
    ``results/<script>.png`` (ignored by git); ``suffix`` tells a script's tables apart."""
    if plot:
        base = os.path.splitext(plot)[0]
    elif json_path:
        base = os.path.splitext(json_path)[0]
    else:
        base = os.path.join("results", os.path.splitext(os.path.basename(script))[0])
    return f"{base}{suffix}.png"


def _save(fig, ax, path: str, title: str, note: str) -> str:
    ax.set_title(title, fontsize=11, loc="left")
    ax.grid(axis="y", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    if note:  # the setting of the run, so a figure read alone says what it measured
        fig.text(0.01, 0.01, note, fontsize=7, color="#555", ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.14 if note else 0, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"plot: {path}", file=sys.stderr)
    return path


def bars(path: str, title: str, values: Dict[str, float], unit: str, note: str = "",
         reference: Optional[Tuple[str, float]] = None) -> Optional[str]:
    """A horizontal bar per label, its value written at the bar's end; ``reference``: a dashed
    line (label, value) such as a raw limit."""
    plt = _pyplot()
    if plt is None:
        return None
    labels, vals = list(values), [values[k] for k in values]
    fig, ax = plt.subplots(figsize=(7.5, 0.6 * len(labels) + 2.0))
    y = range(len(labels))
    ax.barh(y, vals, color=["#2f6fdf" if i == len(labels) - 1 else "#9db7e8" for i in y])
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    top = max(vals + [reference[1] if reference else 0] + [1e-9])
    for i, v in enumerate(vals):
        ax.text(v + top * 0.01, i, f"{v:,.1f}", va="center", fontsize=9)
    if reference:
        ax.axvline(reference[1], color="#c0362c", ls="--", lw=1, label=reference[0])
        ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    ax.set_xlim(0, top * 1.22)
    ax.set_xlabel(unit)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, ax, path, title, note)


def lines(path: str, title: str, xlabel: str, ylabel: str, series: Dict[str, Tuple[Sequence[float], Sequence[float]]],
          note: str = "", ylim0: bool = True) -> Optional[str]:
    """One line with markers per series, x and y as given; the x ticks are the x values."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    xs_all = set()
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
        xs_all.update(xs)
        for x, yv in zip(xs, ys) if len(series) == 1 else ():  # labels of several lines would collide
            ax.annotate(f"{yv:,.1f}", (x, yv), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xticks(sorted(xs_all))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim0:
        ax.set_ylim(bottom=0)
    if len(series) > 1:
        ax.legend(fontsize=8, frameon=False)
    return _save(fig, ax, path, title, note)
