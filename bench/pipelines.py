"""User pipelines: the service + RemoteLoader against a torch DataLoader doing the same work.

    python -m bench.pipelines [--workers N] [--batch-size 32] [--demo-size 512 | --data DIR]
                              [--epochs 1] [--repeats 3] [--json PATH]

``--data DIR``: a dataset folder (e.g. the real-photo sets of bench.photo_sets) instead of the
embedded demo set.

Two pipelines from examples/pipelines/: ``multicrop`` (2 x 224 global + 6 x 96 local views,
each with colour jitter / grayscale / blur / solarize) and ``colorjitter`` (RandomResizedCrop
224 + flip + ColorJitter(0.4, 0.4, 0.4, 0.1)). Same images (the embedded demo set), same
number N of worker processes for every contender, one warm-up epoch, then ``--epochs`` timed:

1. **service + RemoteLoader**: a Service in this process (its dispatcher is a thread here; its
   N workers are processes) with the pipeline registered, consumed by a RemoteLoader.
2. **DataLoader, same ops**: ``num_workers=N``, ``persistent_workers``; ``__getitem__`` runs
   the very pipeline function (loader_service.decode.ops on uint8) into numpy arrays.
3. **DataLoader, PIL (torchvision-style)**: ``__getitem__`` does what torchvision's PIL backend
   does for the same recipe (PIL decode, crop+resize BILINEAR, ImageEnhance for brightness /
   contrast / saturation, HSV hue shift, ImageFilter.GaussianBlur, ImageOps.solarize), then
   ``np.asarray``. torchvision itself is not installed here; these are its PIL calls.

``img/s``: samples delivered to the consuming loop per second of the timed epochs (median of
``--repeats`` runs). The per-op table times each op on one 224 x 224 RGB image (median of
many calls), ours against the PIL call torchvision makes for it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bench.harness import table_head, table_row
from loader_service.decode import ops
from loader_service.decode.pipelines import Registry
from loader_service.decode.transforms import sample_rng

PIPELINES = {"multicrop": "examples.pipelines.multicrop:multicrop",
             "colorjitter": "examples.pipelines.colorjitter:colorjitter"}


# ----------------------------------------------------------------------------- PIL (torchvision-style)
def _pil_rrc(im, rng, scale, size):
    from PIL import Image

    from loader_service.decode.transforms import random_resized_crop_params

    top, left, h, w = random_resized_crop_params(im.height, im.width, scale, (3 / 4, 4 / 3), rng)
    out = im.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
    return out.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else out


def _pil_hue(im, shift):
    hsv = np.array(im.convert("HSV"))
    hsv[..., 0] = (hsv[..., 0].astype(np.int16) + int(shift * 255)) % 256
    from PIL import Image

    return Image.fromarray(hsv, "HSV").convert("RGB")


def _pil_jitter(im, rng, b, c, s, h):
    from PIL import ImageEnhance

    order = rng.permutation(4)
    f = [float(rng.uniform(max(0, 1 - x), 1 + x)) for x in (b, c, s)]
    shift = float(rng.uniform(-h, h))
    fns = [lambda x: ImageEnhance.Brightness(x).enhance(f[0]), lambda x: ImageEnhance.Contrast(x).enhance(f[1]),
           lambda x: ImageEnhance.Color(x).enhance(f[2]), lambda x: _pil_hue(x, shift)]
    for k in order:
        im = fns[k](im)
    return im


def pil_colorjitter(data: bytes, rng) -> Dict[str, np.ndarray]:
    import io

    from PIL import Image

    im = Image.open(io.BytesIO(data)).convert("RGB")
    im = _pil_jitter(_pil_rrc(im, rng, (0.08, 1.0), 224), rng, 0.4, 0.4, 0.4, 0.1)
    return {"image": np.array(im)}


def pil_multicrop(data: bytes, rng) -> Dict[str, np.ndarray]:
    import io

    from PIL import Image, ImageFilter, ImageOps

    im = Image.open(io.BytesIO(data)).convert("RGB")
    im.load()

    def view(size, scale, blur_p, sol_p):
        v = _pil_rrc(im, rng, scale, size)
        if rng.random() < 0.8:
            v = _pil_jitter(v, rng, 0.4, 0.4, 0.2, 0.1)
        if rng.random() < 0.2:
            v = v.convert("L").convert("RGB")
        if rng.random() < blur_p:
            v = v.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.1, 2.0))))
        if rng.random() < sol_p:
            v = ImageOps.solarize(v, 128)
        return np.array(v)

    g = [view(224, (0.4, 1.0), 1.0 if k == 0 else 0.1, 0.0 if k == 0 else 0.2) for k in range(2)]
    loc = [view(96, (0.05, 0.4), 0.5, 0.0) for _ in range(6)]
    return {"global": np.stack(g), "local": np.stack(loc)}


PIL_FNS = {"multicrop": pil_multicrop, "colorjitter": pil_colorjitter}


# ----------------------------------------------------------------------------- DataLoader contenders
class PipelineDataset(Dataset):
    """``__getitem__``: one sample through the pipeline (``kind="ops"``) or its PIL twin."""

    def __init__(self, n: int, name: str, kind: str, data: str = ""):
        self.n, self.name, self.kind, self.data = n, name, kind, data
        self.source = None
        self.pipe = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.source is None:  # opened in the worker process, like the service's workers do
            self.source = _open(self.data, self.n)
            self.pipe = Registry([f"{self.name}={PIPELINES[self.name]}"]).build(self.name, {})
        data = self.source.read(i)
        rng = sample_rng(0, 0, i)
        if self.kind == "pil":
            out = PIL_FNS[self.name](data, rng)
        else:
            from loader_service.decode.pipelines import Item, run_one

            out = {k: np.empty(s, np.uint8) for k, s in self.pipe.outputs.items()}
            run_one(self.name, self.pipe, Item(data, int(self.source.labels[i]), i, rng), out)
        return {k: torch.from_numpy(v) for k, v in out.items()}, int(self.source.labels[i])


def _open(data: str, n: int):
    """The benchmark's dataset: the folder ``data``, else the demo set of ``n`` images."""
    if data:
        from loader_service.sources.detect import open_path

        return open_path(data)
    from loader_service.sources.demo import ensure_demo

    return ensure_demo(n, quiet=True)


def time_epochs(make_iter: Callable[[int], object], epochs: int) -> float:
    """img/s over ``epochs`` timed epochs after one warm-up epoch."""
    for _ in make_iter(0):
        pass
    n, t0 = 0, time.perf_counter()
    for e in range(1, epochs + 1):
        for batch in make_iter(e):
            n += len(batch[1]) if isinstance(batch, (list, tuple)) else len(batch)
    return n / (time.perf_counter() - t0)


def bench_dataloader(name: str, kind: str, args) -> float:
    loader = DataLoader(PipelineDataset(args.demo_size, name, kind, args.data), batch_size=args.batch_size,
                        shuffle=True, num_workers=args.workers, persistent_workers=True, prefetch_factor=4)
    return time_epochs(lambda e: loader, args.epochs)


def bench_service(name: str, args) -> float:
    from client import RemoteLoader
    from loader_service.config import ServiceConfig
    from loader_service.service import Service

    where = dict(data=(args.data,)) if args.data else dict(demo=True, demo_size=args.demo_size)
    svc = Service(ServiceConfig(**where, workers=args.workers, data_port=0,
                                http_port=0, log_level="warning", status_log_s=0,
                                pipeline=(f"{name}={PIPELINES[name]}",))).start()
    try:
        with RemoteLoader(svc.endpoint, batch_size=args.batch_size, pipeline=name,
                          prefetch=max(4, 2 * args.workers)) as ld:
            def epoch(e):
                ld.set_epoch(e)
                return ld
            return time_epochs(epoch, args.epochs)
    finally:
        svc.stop()


# ----------------------------------------------------------------------------- per-op timings
def per_op(repeats: int = 200) -> List[dict]:
    import io

    from PIL import Image, ImageEnhance, ImageFilter, ImageOps

    from loader_service.sources.demo import encode_jpeg, ensure_demo

    src = ensure_demo(64, quiet=True)
    from loader_service.decode.transforms import decode

    img = ops.resize(decode(src.read(0)), (224, 224))
    big = decode(src.read(1))
    jpg = encode_jpeg(big, 90)
    im, pim_big = Image.fromarray(img), Image.fromarray(big)
    rng = np.random.default_rng(0)
    out = np.empty((224, 224, 3), np.uint8)
    cases = [
        ("random_resized_crop (JPEG bytes, fused decode)", lambda: ops.random_resized_crop(jpg, out, rng),
         lambda: _pil_rrc(Image.open(io.BytesIO(jpg)).convert("RGB"), rng, (0.08, 1.0), 224)),
        ("random_resized_crop (decoded array)", lambda: ops.random_resized_crop(big, out, rng),
         lambda: _pil_rrc(pim_big, rng, (0.08, 1.0), 224)),
        ("hflip", lambda: ops.hflip(img), lambda: im.transpose(Image.FLIP_LEFT_RIGHT)),
        ("resize 224->160", lambda: ops.resize(img, (160, 160)), lambda: im.resize((160, 160), Image.BILINEAR)),
        ("center_crop 160", lambda: ops.center_crop(img, 160).copy(), lambda: im.crop((32, 32, 192, 192))),
        ("brightness", lambda: ops.brightness(img, 1.3), lambda: ImageEnhance.Brightness(im).enhance(1.3)),
        ("contrast", lambda: ops.contrast(img, 1.3), lambda: ImageEnhance.Contrast(im).enhance(1.3)),
        ("saturation", lambda: ops.saturation(img, 1.3), lambda: ImageEnhance.Color(im).enhance(1.3)),
        ("hue", lambda: ops.hue(img, 0.1), lambda: _pil_hue(im, 0.1)),
        ("color_jitter(0.4,0.4,0.4,0.1)", lambda: ops.color_jitter(img, rng, 0.4, 0.4, 0.4, 0.1),
         lambda: _pil_jitter(im, rng, 0.4, 0.4, 0.4, 0.1)),
        ("grayscale", lambda: ops.grayscale(img), lambda: im.convert("L").convert("RGB")),
        ("gaussian_blur k9 s1.5", lambda: ops.gaussian_blur(img, 9, 1.5),
         lambda: im.filter(ImageFilter.GaussianBlur(1.5))),
        ("solarize", lambda: ops.solarize(img, 128), lambda: ImageOps.solarize(im, 128)),
        ("posterize 4", lambda: ops.posterize(img, 4), lambda: ImageOps.posterize(im, 4)),
        ("autocontrast", lambda: ops.autocontrast(img), lambda: ImageOps.autocontrast(im)),
        ("equalize", lambda: ops.equalize(img), lambda: ImageOps.equalize(im)),
        ("sharpness", lambda: ops.sharpness(img, 1.5), lambda: ImageEnhance.Sharpness(im).enhance(1.5)),
        ("rotate 30", lambda: ops.affine(img, angle=30.0), lambda: im.rotate(30, Image.NEAREST)),
        ("trivial_augment", lambda: ops.trivial_augment(img, rng), None),
        ("rand_augment (2 ops, m9)", lambda: ops.rand_augment(img, rng), None),
    ]
    rows = []
    for name, ours, pil in cases:
        rows.append({"op": name, "ours_us": _median_us(ours, repeats),
                     "pil_us": _median_us(pil, repeats) if pil else None})
    return rows


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--demo-size", type=int, default=512)
    p.add_argument("--data", default="", metavar="DIR", help="a dataset folder instead of the demo set")
    p.add_argument("--epochs", type=int, default=1, help="timed epochs after one warm-up epoch")
    p.add_argument("--repeats", type=int, default=3, help="runs per contender; the median is reported")
    p.add_argument("--pipelines", default="multicrop,colorjitter")
    p.add_argument("--op-repeats", type=int, default=200)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    src = _open(args.data, args.demo_size)  # the demo set is generated once, before any worker opens it
    args.demo_size = len(src)  # the DataLoader's length: the folder's size with --data
    src.close()
    load = os.getloadavg()[0]
    results = {}
    for name in args.pipelines.split(","):
        row = {}
        for label, fn in (("service + RemoteLoader", lambda: bench_service(name, args)),
                          ("DataLoader, same ops", lambda: bench_dataloader(name, "ops", args)),
                          ("DataLoader, PIL (torchvision-style)", lambda: bench_dataloader(name, "pil", args))):
            runs = [fn() for _ in range(args.repeats)]
            row[label] = {"median": statistics.median(runs), "runs": runs}
            print(f"# {name} / {label}: {[round(r, 1) for r in runs]} img/s", file=sys.stderr, flush=True)
        results[name] = row
    print(f"\n# load average at start {load:.2f}; workers {args.workers}, batch {args.batch_size}, "
          f"{args.demo_size} images of {args.data or 'the demo set'}, "
          f"{args.epochs} timed epoch(s) after a warm-up, median of {args.repeats}\n")
    print(table_head(["pipeline", "service + RemoteLoader", "DataLoader, same ops", "DataLoader, PIL (torchvision-style)"],
                     "llll"))
    for name, row in results.items():
        print(table_row([name] + [f"{row[k]['median']:.0f} img/s" for k in row]))
    op_rows = per_op(args.op_repeats)
    print("\n" + table_head(["op (224 x 224 RGB)", "loader_service.decode.ops (us)", "PIL, as torchvision calls it (us)"],
                            "lll"))
    for r in op_rows:
        pil = f"{r['pil_us']:.0f}" if r["pil_us"] is not None else "-"
        print(table_row([r["op"], f"{r['ours_us']:.0f}", pil]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "pipelines": results, "ops": op_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
