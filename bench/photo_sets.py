"""Build the real-photo benchmark sets from photographs that a Debian package ships.

    python -m bench.photo_sets [--out ~/.cache/remote-loader/photos] [--imagenet 500] [--camera 200]
    python -m bench.photo_sets --prepared [--workers 2]   # also imagenet-rst/, camera-rst/
    python -m bench.photo_sets --prepared --mcus 0          # also imagenet-rst-rows/, camera-rst-rows/

Source: the photographs of Debian's ``mate-backgrounds`` package (``usr/share/backgrounds/mate/
nature/*.jpg``: 12 camera photos of 1280-2560 px, plants, water, sky, sand, wood) plus the
5640x3172 scan of ``abstract/Elephants_5640x3172.jpg`` (a detailed painting: camera-size detail
without upscaling). The ``.deb`` is fetched with ``apt-get download`` (or given with ``--deb``)
and unpacked with ``dpkg-deb``; nothing is installed.

Two ImageFolder sets, 4 classes each, the same every run (fixed seed; the bytes depend only on
the OpenCV build's libjpeg):

* ``imagenet/``: ImageNet-like. A random window of a source photo (10-60 % of its area, aspect
  3:4 to 4:3), resized with INTER_AREA so its longer side is 320-640 px (most near 500x375),
  JPEG quality 90, 4:2:0.
* ``camera/``: camera-size, 4000x3000 or 3000x4000 (a third portrait). A random window of at
  least 2/3 of a source's shorter side, resized to the camera size (mostly upscaled: only the
  Elephants scan is that large), light sensor-like grain (Gaussian, sigma 2) so the entropy-coded
  data per pixel is in a phone camera's range rather than an upscale's, JPEG quality 92.

Prints each set's count, mean size and bits per pixel.

``--prepared`` also makes ``imagenet-rst/`` and ``camera-rst/``: the same sets through
``loader-service prepare-jpegs`` (loader_service.decode.jpeg_prepare.prepare_tree: its default, a
restart marker every 8 MCUs or a few less, tiling each MCU row; lossless), for the decode
kernel's restart-segment path; ``--mcus 0``: ``*-rst-rows/`` with a marker at every MCU row,
``--mcus N``: ``*-rst-mcusN/``. Sets already there are
not built again (they are the same every run), and prepared files newer than their source are
kept. Prints the time it took and the mean size before and after.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

import cv2
import numpy as np

PACKAGE = "mate-backgrounds"
MEMBERS = ("usr/share/backgrounds/mate/nature/*.jpg", "usr/share/backgrounds/mate/abstract/Elephants_5640x3172.jpg")


def fetch_sources(deb: str | None, work: str) -> list:
    if deb is None:
        subprocess.run(["apt-get", "download", PACKAGE], cwd=work, check=True, stdout=subprocess.DEVNULL)
        (deb,) = glob.glob(os.path.join(work, f"{PACKAGE}_*.deb"))
    subprocess.run(["dpkg-deb", "-x", deb, os.path.join(work, "x")], check=True)
    files = sorted(f for pat in MEMBERS for f in glob.glob(os.path.join(work, "x", pat)))
    if len(files) < 10:
        raise SystemExit(f"expected >= 10 photos in {deb}, found {len(files)}")
    return [cv2.imread(f, cv2.IMREAD_COLOR) for f in files]


def window(rng: np.random.Generator, h: int, w: int, area: tuple, aspect: tuple) -> tuple:
    for _ in range(100):
        a = h * w * rng.uniform(*area)
        r = np.exp(rng.uniform(np.log(aspect[0]), np.log(aspect[1])))
        cw, ch = int(round(np.sqrt(a * r))), int(round(np.sqrt(a / r)))
        if 0 < cw <= w and 0 < ch <= h:
            y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
            return y, x, ch, cw
    return 0, 0, h, w


def imagenet_like(src: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    y, x, ch, cw = window(rng, *src.shape[:2], (0.10, 0.60), (3 / 4, 4 / 3))
    long_side = int(np.clip(rng.normal(500, 60), 320, 640))
    s = long_side / max(ch, cw)
    size = (max(1, round(cw * s)), max(1, round(ch * s)))
    return cv2.resize(src[y:y + ch, x:x + cw], size, interpolation=cv2.INTER_AREA)


def camera_like(src: np.ndarray, rng: np.random.Generator, portrait: bool) -> np.ndarray:
    h, w = src.shape[:2]
    aspect = 3 / 4 if portrait else 4 / 3
    side = int(min(h, w) * rng.uniform(2 / 3, 1.0))
    ch, cw = (side, int(side * aspect)) if side * aspect <= w else (int(w / aspect), w)
    ch, cw = min(ch, h), min(cw, w)
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    size = (3000, 4000) if portrait else (4000, 3000)
    img = cv2.resize(src[y:y + ch, x:x + cw], size, interpolation=cv2.INTER_CUBIC if size[0] > cw else cv2.INTER_AREA)
    grain = rng.normal(0, 2.0, img.shape).astype(np.float32)
    return np.clip(img.astype(np.float32) + grain, 0, 255).astype(np.uint8)


def build(out: str, name: str, n: int, make, sources: list, quality: int, seed: int) -> None:
    root = os.path.join(out, name)
    rng = np.random.default_rng(seed)
    sizes, pixels = [], []
    for i in range(n):
        img = make(sources[i % len(sources)], rng, i)
        path = os.path.join(root, f"class_{i % 4}", f"{name}_{i:05d}.jpg")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, quality])
        assert ok
        with open(path, "wb") as f:
            f.write(buf.tobytes())
        sizes.append(len(buf))
        pixels.append(img.shape[0] * img.shape[1])
    print(f"{name}: {n} photos in {root}, mean {np.mean(sizes) / 1024:.0f} KiB, "
          f"mean {np.mean(pixels) / 1e6:.2f} MP, {8 * np.sum(sizes) / np.sum(pixels):.2f} bits/pixel")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.expanduser("~/.cache/remote-loader/photos"))
    p.add_argument("--deb", help=f"a downloaded {PACKAGE} .deb (default: apt-get download it)")
    p.add_argument("--imagenet", type=int, default=500, help="ImageNet-like photos")
    p.add_argument("--camera", type=int, default=200, help="camera-size photos")
    p.add_argument("--prepared", action="store_true", help="also make imagenet-rst/ and camera-rst/ with "
                   "prepare-jpegs (restart markers in tiles of <= 8 MCUs, its default); existing sets are not rebuilt")
    p.add_argument("--workers", type=int, default=2, help="--prepared: processes (2)")
    p.add_argument("--mcus", type=int, default=8, help="--prepared: restart tiles of N MCUs (8, prepare-jpegs' "
                   "default: *-rst/), or 0 for whole rows (*-rst-rows/)")
    args = p.parse_args(argv)
    sets = {"imagenet": (args.imagenet, lambda s, r, i: imagenet_like(s, r), 90, 1),
            "camera": (args.camera, lambda s, r, i: camera_like(s, r, portrait=i % 3 == 2), 92, 2)}
    todo = [n for n in sets if not (args.prepared and os.path.isdir(os.path.join(args.out, n)))]
    if todo:
        with tempfile.TemporaryDirectory() as work:
            sources = fetch_sources(os.path.abspath(args.deb) if args.deb else None, work)
        for name in todo:
            n, make, quality, seed = sets[name]
            build(args.out, name, n, make, sources, quality, seed)
    if args.prepared:
        for name in sets:
            prepare(args.out, name, args.workers, args.mcus)
    return 0


def prepare(out: str, name: str, workers: int, mcus: int = 8) -> None:
    from loader_service.decode.jpeg_prepare import prepare_tree

    t = time.perf_counter()
    prepared = {8: f"{name}-rst", 0: f"{name}-rst-rows"}.get(mcus, f"{name}-rst-mcus{mcus}")
    s = prepare_tree(os.path.join(out, name), os.path.join(out, prepared), workers=workers, progress=False, mcus=mcus)
    dt = time.perf_counter() - t
    if s.failed:
        raise SystemExit(f"{name}: {len(s.failed)} files failed: {s.failed[:3]}")
    line = f"{prepared}: {s.converted} JPEGs prepared in {dt:.1f} s with {workers} workers"
    if s.converted:
        line += (f", mean {s.jpeg_bytes_in / s.converted / 1024:.1f} KiB -> {s.jpeg_bytes_out / s.converted / 1024:.1f}"
                 f" KiB ({100 * (s.jpeg_bytes_out / s.jpeg_bytes_in - 1):+.1f} %)")
    print(line + (f"; {s.skipped} already up to date" if s.skipped else ""))


if __name__ == "__main__":
    sys.exit(main())
