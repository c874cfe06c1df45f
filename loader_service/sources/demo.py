"""The embedded demo dataset: deterministic, photographic-looking 500x375 JPEGs with labels.

Generated on first use (both cores, a few seconds per thousand images) into a packed dataset
under the cache directory, then memory-mapped like any packed dataset. A read-only folder of
sets generated beforehand (``LOADER_DEMO_BUILTIN``; the service image makes the default set
there at build time) is looked in first, so a container is ready without generating anything. The same
(count, seed, version) always yields the same bytes, so benchmarks and tests are repeatable.
Each of the 10 classes has its own palette, lighting and shape vocabulary, and every image has
smooth gradients, edges, texture and grain, so JPEG sizes and decode cost resemble photos
(about 40-70 KB at quality 90) rather than flat synthetic blocks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from typing import Iterator, Tuple

import numpy as np

from loader_service.sources.packed import PackedSource, write_packed

VERSION = 1
WIDTH, HEIGHT = 500, 375
NUM_CLASSES = 10
CLASSES = [f"class_{i}" for i in range(NUM_CLASSES)]
DEFAULT_COUNT = 2000


def cache_dir() -> str:
    base = os.environ.get("LOADER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loader-service"
    )
    return base


BUILTIN_ENV = "LOADER_DEMO_BUILTIN"


def demo_path(count: int = DEFAULT_COUNT, seed: int = 0, base: str = "") -> str:
    return os.path.join(base or cache_dir(), f"demo-v{VERSION}-n{count}-s{seed}")


def builtin_demo(count: int = DEFAULT_COUNT, seed: int = 0) -> str:
    """The pre-generated set under ``LOADER_DEMO_BUILTIN`` for (count, seed), or "" if none."""
    base = os.environ.get(BUILTIN_ENV, "")
    path = demo_path(count, seed, base) if base else ""
    return path if path and os.path.exists(os.path.join(path, "meta.json")) else ""


def ensure_demo(count: int = DEFAULT_COUNT, seed: int = 0, processes: int = 0, quiet: bool = False,
                base: str = "") -> PackedSource:
    """Open the demo dataset: the pre-generated one if there is one, else from the cache (``base``
    instead of the cache: generate there), generating it first if it is not there."""
    if count < 1:
        raise ValueError(f"demo dataset size must be >= 1, got {count}")
    path = "" if base else builtin_demo(count, seed)
    path = path or demo_path(count, seed, base)
    if not os.path.exists(os.path.join(path, "meta.json")):
        from tqdm import tqdm

        if not quiet:
            print(f"generating the demo dataset ({count} JPEGs, once) into {path} ...", file=sys.stderr, flush=True)
        samples = _generate(count, seed, processes or os.cpu_count() or 1)
        try:
            with tqdm(samples, total=count, desc="demo dataset", unit="img", disable=quiet, file=sys.stderr,
                      leave=False, dynamic_ncols=True) as bar:
                write_packed(path, bar, CLASSES)
        except OSError:
            if not os.path.exists(os.path.join(path, "meta.json")):  # not a concurrent writer's win
                raise
    return PackedSource(path, name="demo")


def _generate(count: int, seed: int, processes: int) -> Iterator[Tuple[str, bytes, int]]:
    jobs = [(seed, i) for i in range(count)]
    if processes <= 1 or count < 64:
        for job in jobs:
            yield _make_one(job)
        return
    with mp.get_context("spawn").Pool(processes) as pool:
        yield from pool.imap(_make_one, jobs, chunksize=16)


def _make_one(job: Tuple[int, int]) -> Tuple[str, bytes, int]:
    seed, i = job
    label = i % NUM_CLASSES
    img = demo_image(seed, i, label)
    return f"{CLASSES[label]}/{i:06d}.jpg", encode_jpeg(img, quality=90), label


def encode_jpeg(img: np.ndarray, quality: int = 90) -> bytes:
    try:
        import simplejpeg

        return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=quality, colorspace="RGB")
    except ImportError:  # pragma: no cover - simplejpeg is a service dependency
        import cv2

        ok, buf = cv2.imencode(".jpg", img[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, quality])
        assert ok
        return buf.tobytes()


def demo_image(seed: int, i: int, label: int) -> np.ndarray:
    """One RGB uint8 image (HEIGHT, WIDTH, 3), a pure function of (seed, i, label)."""
    import cv2

    rng = np.random.Generator(np.random.PCG64([seed, i, VERSION]))
    cls_rng = np.random.Generator(np.random.PCG64([seed, label, 7919]))
    palette = cls_rng.uniform(30, 225, size=(4, 3))  # the class's colours
    h, w = HEIGHT, WIDTH

    # low-frequency colour field (sky, walls, fields) mixed from the palette
    weights = rng.dirichlet(np.ones(4), size=(5, 7)).astype(np.float32)
    field = cv2.resize(weights @ palette.astype(np.float32), (w, h), interpolation=cv2.INTER_CUBIC)

    # directional lighting and a vignette
    yy, xx = np.ogrid[0:h, 0:w]
    yy, xx = yy.astype(np.float32), xx.astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    light = 0.75 + 0.35 * ((np.cos(angle) * xx / w + np.sin(angle) * yy / h) % 1.0)
    vignette = 1.0 - 0.35 * (((xx - w / 2) / w) ** 2 + ((yy - h / 2) / h) ** 2)
    img = field * (light * vignette)[..., None].astype(np.float32)

    # objects: class-specific shapes with soft edges and their own shading, blended in their box
    for _ in range(int(rng.integers(3, 8))):
        colour = (palette[int(rng.integers(0, 4))] * rng.uniform(0.6, 1.3)).astype(np.float32)
        cx, cy = int(rng.integers(0, w)), int(rng.integers(0, h))
        size = int(rng.integers(20, 140))
        blur = float(rng.uniform(1.0, 4.0))
        pad = size + int(3 * blur) + 2
        x0, x1, y0, y1 = max(cx - pad, 0), min(cx + pad, w), max(cy - pad, 0), min(cy + pad, h)
        m = np.zeros((y1 - y0, x1 - x0), np.uint8)
        c = (cx - x0, cy - y0)
        if label % 3 == 0:
            cv2.ellipse(m, c, (size, int(size * rng.uniform(0.4, 1.0))), float(rng.uniform(0, 180)), 0, 360, 255, -1)
        elif label % 3 == 1:
            pts = rng.integers(-size, size, size=(int(rng.integers(3, 7)), 2)) + c
            cv2.fillPoly(m, [pts.astype(np.int32)], 255)
        else:
            cv2.rectangle(m, (c[0] - size, c[1] - size // 2), (c[0] + size, c[1] + size // 2), 255, -1)
        soft = (cv2.GaussianBlur(m, (0, 0), blur).astype(np.float32) / 255)[..., None]
        ramp = np.linspace(-1, 1, y1 - y0, dtype=np.float32)[:, None, None] * np.float32(rng.uniform(-0.3, 0.3))
        box = img[y0:y1, x0:x1]
        box *= 1 - soft
        box += colour * (1 + ramp) * soft

    # mid-frequency texture and sensor grain
    tex = cv2.resize(rng.standard_normal(size=(h // 6, w // 6), dtype=np.float32), (w, h), interpolation=cv2.INTER_LINEAR)
    img += (tex * np.float32(rng.uniform(4, 12)))[..., None]
    img += rng.standard_normal(size=(h, w, 3), dtype=np.float32) * np.float32(3.0)
    return np.clip(img, 0, 255).astype(np.uint8)
