"""Benchmark doubles, loaded by the service through its ordinary extension points: nothing here is
in the product, and the product carries no hook for it.

``blank`` is the transport benchmark's pipeline (``serve --pipeline blank=bench.doubles:blank``,
the client asks for ``pipeline="blank"``): it declares the built-in recipe's one output,
``image`` (size x size x 3 uint8, ``size`` its one argument), and writes nothing into it. The
worker's per-sample loop still runs as for any pipeline (it reads the sample's bytes and draws
its random generator) but nothing is decoded, and the slot's bytes stay as they were: zeros in a
new segment, which is how ``bench.transport`` sees that decoding was off.
"""

from __future__ import annotations

from loader_service.decode.pipelines import Args, Item, Pipeline

BLANK = "blank=bench.doubles:blank"  # the --pipeline entry that offers it


def blank(args: Args) -> Pipeline:
    size = args.int("size", 224, 8, 4096)

    def process(item: Item, out: dict) -> None:
        return None  # nothing decoded, nothing written

    return Pipeline({"image": (size, size, 3)}, process)
