"""Per-image cost on one core, on the real-photo sets: where the time goes, and what
``--jpeg-fast-dct`` / ``--jpeg-fast-upsample`` buy against what they cost in PSNR.

    python -m bench.profile_decode [--photos ~/.cache/remote-loader/photos] [--n 200]

Rows: the naive reference function (bench.throughput.naive_sample), the service's
process_sample, and process_sample's stages (header + crop draw, decode of the crop, resize,
flip) timed separately. Then the decode options: microseconds per image and PSNR of the output
against the accurate path's (same crop boxes). Best of 3 passes.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time

import numpy as np

from bench import throughput as B
from bench.harness import table_head, table_row
from loader_service.decode import jpeg as J
from loader_service.decode import transforms as T


def best_us(fn, datas, passes=3) -> float:
    best = math.inf
    for _ in range(passes):
        t0 = time.perf_counter()
        for i, d in enumerate(datas):
            fn(i, d)
        best = min(best, (time.perf_counter() - t0) / len(datas) * 1e6)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--photos", default=os.path.expanduser("~/.cache/remote-loader/photos"))
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--groups", default="imagenet,camera",
                   help="comma-separated sets under --photos (imagenet-rst, camera-rst: prepared with prepare-jpegs)")
    args = p.parse_args(argv)
    spec = T.TransformSpec(224)
    out = np.empty((224, 224, 3), np.uint8)
    print(f"decode path: {J.decode_path()}")
    for group in args.groups.split(","):
        files = sorted(glob.glob(os.path.join(args.photos, group, "*", "*.jpg")))[: args.n]
        datas = [open(f, "rb").read() for f in files]
        rng = lambda i: T.sample_rng(0, 0, i)  # noqa: E731

        # the stages of process_sample, with its own crop boxes
        boxes = []
        for i, d in enumerate(datas):
            h, w, cmyk, restarts = J.header(d)
            r = rng(i)
            top, left, ch, cw = T.random_resized_crop_params(h, w, spec.scale, spec.ratio, r)
            dd = J.pick_scale(h, w, math.ceil(h * 224 / ch), math.ceil(w * 224 / cw))
            sh, sw = -(-h // dd), -(-w // dd)
            y, x = T._box(top, left, ch, cw, sh / h, sw / w, (sh, sw))
            boxes.append((h, w, cmyk, dd, (y.start, y.stop, x.start, x.stop), J.DEFAULT_OPTIONS, restarts))
        crops = [J.decode_crop(d, *boxes[i]) for i, d in enumerate(datas)]
        rows = {
            "naive function (full decode, slice, resize, flip)": best_us(lambda i, d: B.naive_sample(d, spec, rng(i), out), datas),
            "process_sample (all of it)": best_us(lambda i, d: T.process_sample(d, spec, rng(i), out), datas),
            "  header + crop draw + scale choice": best_us(
                lambda i, d: (J.header(d), T.random_resized_crop_params(boxes[i][0], boxes[i][1], spec.scale, spec.ratio, rng(i))), datas),
            "  decode of the crop (ROI, power-of-two scale)": best_us(lambda i, d: J.decode_crop(d, *boxes[i]), datas),
            "  resize to 224 (cv2, bilinear)": best_us(lambda i, d: T.resize_into(crops[i], out), datas),
            "  flip in place": best_us(lambda i, d: T.cv2.flip(out, 1, dst=out), datas),
            "  naive: full decode alone (simplejpeg)": best_us(lambda i, d: J.simplejpeg.decode_jpeg(d), datas),
        }
        scales = np.bincount([b[3] for b in boxes], minlength=9)
        print(f"\n### {group}: {len(datas)} photos, scales used 1/1 {scales[1]}, 1/2 {scales[2]}, 1/4 {scales[4]}, "
              f"1/8 {scales[8]}\n")
        print(table_head(["per image, one core", "us"], "lr"))
        for k, v in rows.items():
            print(table_row([k, f"{v:.0f}"]))

        ref = []
        for i, d in enumerate(datas):
            o = np.empty_like(out)
            T.process_sample(d, spec, rng(i), o)
            ref.append(o)
        print("\n" + table_head(["decode option", "us / image (process_sample)", "PSNR vs accurate (dB)"], "lrr"))
        for name, opts in (("accurate (default)", J.DecodeOptions()), ("fast DCT", J.DecodeOptions(fast_dct=True)),
                           ("fast upsample", J.DecodeOptions(fast_upsample=True)),
                           ("both", J.DecodeOptions(fast_dct=True, fast_upsample=True))):
            us = best_us(lambda i, d: T.process_sample(d, spec, rng(i), out, opts), datas)
            mse = []
            for i, d in enumerate(datas):
                o = np.empty_like(out)
                T.process_sample(d, spec, rng(i), o, opts)
                mse.append(np.mean((o.astype(np.float64) - ref[i]) ** 2))
            m = float(np.mean(mse))
            psnr = "identical" if m == 0 else f"{10 * math.log10(255 ** 2 / m):.1f}"
            print(table_row([name, f"{us:.0f}", psnr]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
