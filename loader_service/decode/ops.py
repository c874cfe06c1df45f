"""Fast uint8 image ops for pipelines: OpenCV and numpy on ``H x W x 3`` RGB uint8, lookup
tables wherever an op maps each value on its own.

Each op follows torchvision's (v2, tensor) math and is tested against a float numpy version of
that math with a stated tolerance (tests/unit/decode/test_ops.py); the per-op cost is in docs/benchmarks.md.
Random ops take the per-sample generator (``item.rng``), so a sample is the same bytes on any
worker. Ops return a new array unless ``out`` is given; none keeps state.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import cv2
import numpy as np

from loader_service.decode.jpeg import DEFAULT_OPTIONS, DecodeOptions
from loader_service.sources.base import Sample
from loader_service.decode.transforms import TransformSpec, process_sample, resize_into, sample_rng

cv2.setNumThreads(1)  # one worker per core; OpenCV's own threads would oversubscribe

_RAMP = np.arange(256, dtype=np.float64)  # float64: the LUTs equal the float math exactly


# --------------------------------------------------------------------------- geometry
def random_resized_crop(data: Sample, out: np.ndarray, rng: np.random.Generator,
                        scale: Tuple[float, float] = (0.08, 1.0), ratio: Tuple[float, float] = (3 / 4, 4 / 3),
                        flip: bool = False, options: DecodeOptions = DEFAULT_OPTIONS) -> None:
    """RandomResizedCrop into ``out`` (size, size, 3) (+ a random horizontal flip), straight from
    the encoded bytes: a JPEG decodes only the crop, at the largest DCT reduction that keeps the
    output resolution (the service's fused decode). Call it several times on one sample for
    several crops: each decodes only its own region."""
    spec = TransformSpec(out.shape[0], True, tuple(scale), tuple(ratio), flip)
    process_sample(data, spec, rng, out, options)


def hflip(img: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    return cv2.flip(img, 1, dst=out)


def resize(img: np.ndarray, size: Tuple[int, int], out: Optional[np.ndarray] = None) -> np.ndarray:
    """To (height, width): bilinear, the area filter where it shrinks by more than 2x (antialiased)."""
    if out is None:
        out = np.empty((size[0], size[1], *img.shape[2:]), np.uint8)
    resize_into(img, out)
    return out


def resize_shorter(img: np.ndarray, side: int) -> np.ndarray:
    """Resize so the shorter side is ``side`` (torchvision's Resize(int))."""
    h, w = img.shape[:2]
    if h <= w:
        return resize(img, (side, max(1, int(side * w / h))))
    return resize(img, (max(1, int(side * h / w)), side))


def center_crop(img: np.ndarray, size: int) -> np.ndarray:
    """The central ``size`` x ``size`` (a view; torchvision's rounding of the offsets)."""
    h, w = img.shape[:2]
    if h < size or w < size:
        raise ValueError(f"center_crop({size}) of an image of {h}x{w}")
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return img[top: top + size, left: left + size]


def resize_center_crop(data: Sample, out: np.ndarray, fraction: float = 0.875,
                       options: DecodeOptions = DEFAULT_OPTIONS) -> None:
    """Resize(size/fraction) + CenterCrop(size) into ``out``, with the fused decode."""
    spec = TransformSpec(out.shape[0], False, eval_crop_fraction=fraction)
    process_sample(data, spec, sample_rng(0, 0, 0), out, options)  # eval draws nothing


def affine(img: np.ndarray, angle: float = 0.0, translate: Tuple[float, float] = (0.0, 0.0),
           shear: Tuple[float, float] = (0.0, 0.0), center: Optional[Tuple[float, float]] = None,
           fill: int = 0) -> np.ndarray:
    """torchvision's F.affine (scale 1): rotate ``angle`` degrees counter-clockwise about
    ``center`` (default: the image centre), shear (degrees) and translate (pixels); nearest
    neighbour, ``fill`` outside."""
    h, w = img.shape[:2]
    cx, cy = ((w - 1) * 0.5, (h - 1) * 0.5) if center is None else center
    m = affine_matrix(angle, translate, shear, (cx, cy))
    return cv2.warpAffine(img, m, (w, h), flags=cv2.INTER_NEAREST, borderMode=cv2.BORDER_CONSTANT,
                          borderValue=(fill, fill, fill))


def affine_matrix(angle: float, translate: Tuple[float, float], shear: Tuple[float, float],
                  center: Tuple[float, float]) -> np.ndarray:
    """The 2x3 forward map (output = M @ [x, y, 1]) of torchvision's affine: T * C * RS * C^-1."""
    rot, sx, sy = math.radians(-angle), math.radians(shear[0]), math.radians(shear[1])
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    cx, cy = center
    tx, ty = translate
    return np.array([[a, b, cx + tx - a * cx - b * cy], [c, d, cy + ty - c * cx - d * cy]], np.float64)


# --------------------------------------------------------------------------- colour
def _lut(img: np.ndarray, table: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    return cv2.LUT(img, table, dst=out)


def _blend_lut(factor: float, other: float) -> np.ndarray:
    """``factor * x + (1 - factor) * other``, clamped, truncated to uint8 (torchvision's _blend)."""
    return np.clip(factor * _RAMP + (1.0 - factor) * other, 0, 255).astype(np.uint8)


def brightness(img: np.ndarray, factor: float, out: Optional[np.ndarray] = None) -> np.ndarray:
    return _lut(img, _blend_lut(factor, 0.0), out)


def gray(img: np.ndarray) -> np.ndarray:
    """(H, W) luma: 0.299 R + 0.587 G + 0.114 B (torchvision's weights), rounded."""
    return cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)


def grayscale(img: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Grayscale with three equal channels (torchvision's Grayscale(num_output_channels=3))."""
    return cv2.cvtColor(gray(img), cv2.COLOR_GRAY2RGB, dst=out)


def contrast(img: np.ndarray, factor: float, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Blend with the mean of the luma: one LUT once the mean is known."""
    return _lut(img, _blend_lut(factor, float(gray(img).mean())), out)


def saturation(img: np.ndarray, factor: float, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Blend with the luma, per pixel."""
    g = cv2.cvtColor(gray(img), cv2.COLOR_GRAY2RGB)
    return cv2.addWeighted(img, factor, g, 1.0 - factor, 0.0, dst=out)


def hue(img: np.ndarray, shift: float, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Rotate the hue by ``shift`` turns (-0.5..0.5): in OpenCV's full-range HSV (hue in 0..255),
    the rotation is one LUT on the hue channel."""
    if shift == 0:
        out = np.empty_like(img) if out is None else out
        np.copyto(out, img)
        return out
    hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV_FULL)
    table = ((np.arange(256) + int(round(shift * 256))) % 256).astype(np.uint8)
    hsv[..., 0] = cv2.LUT(hsv[..., 0], table)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB_FULL, dst=out)


def color_jitter(img: np.ndarray, rng: np.random.Generator, brightness_: float = 0.0, contrast_: float = 0.0,
                 saturation_: float = 0.0, hue_: float = 0.0) -> np.ndarray:
    """torchvision's ColorJitter: factors drawn uniformly from [max(0, 1-x), 1+x] (hue from
    [-x, x]), applied in a random order; a zero strength skips that op (no draw)."""
    order = rng.permutation(4)
    factors = [None if x == 0 else float(rng.uniform(max(0.0, 1 - x), 1 + x))
               for x in (brightness_, contrast_, saturation_)]
    shift = None if hue_ == 0 else float(rng.uniform(-hue_, hue_))
    ops = [(brightness, factors[0]), (contrast, factors[1]), (saturation, factors[2]), (hue, shift)]
    for k in order:
        fn, f = ops[k]
        if f is not None:
            img = fn(img, f)
    return img


def solarize(img: np.ndarray, threshold: float, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Invert every value >= ``threshold``."""
    table = np.where(_RAMP >= threshold, 255 - _RAMP, _RAMP).astype(np.uint8)
    return _lut(img, table, out)


def posterize(img: np.ndarray, bits: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    table = (np.arange(256) & (0xFF << (8 - bits)) & 0xFF).astype(np.uint8)
    return _lut(img, table, out)


def autocontrast(img: np.ndarray) -> np.ndarray:
    """Stretch each channel to 0..255 (one LUT per channel)."""
    out = np.empty_like(img)
    for c in range(img.shape[2]):
        ch = img[..., c]
        lo, hi = float(ch.min()), float(ch.max())
        if hi == lo:
            out[..., c] = ch
            continue
        table = np.clip((_RAMP - lo) * (255.0 / (hi - lo)), 0, 255).astype(np.uint8)
        out[..., c] = cv2.LUT(ch, table)
    return out


def equalize(img: np.ndarray) -> np.ndarray:
    """Histogram equalisation per channel, PIL's (and torchvision's) rule."""
    out = np.empty_like(img)
    for c in range(img.shape[2]):
        ch = np.ascontiguousarray(img[..., c])
        hist = np.bincount(ch.ravel(), minlength=256)
        nonzero = hist[hist > 0]
        step = (hist.sum() - nonzero[-1]) // 255 if len(nonzero) else 0
        if step == 0:
            out[..., c] = ch
            continue
        table = np.clip((np.concatenate([[0], np.cumsum(hist)[:-1]]) + step // 2) // step, 0, 255).astype(np.uint8)
        out[..., c] = cv2.LUT(ch, table)
    return out


_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13.0


def sharpness(img: np.ndarray, factor: float) -> np.ndarray:
    """Blend with a smoothed copy (torchvision's 3x3 kernel; the border keeps its pixels)."""
    smooth = cv2.filter2D(img, -1, _SMOOTH, borderType=cv2.BORDER_REPLICATE)
    smooth[0], smooth[-1], smooth[:, 0], smooth[:, -1] = img[0], img[-1], img[:, 0], img[:, -1]
    return cv2.addWeighted(img, factor, smooth, 1.0 - factor, 0.0)


def gaussian_blur(img: np.ndarray, kernel: int, sigma: float, out: Optional[np.ndarray] = None) -> np.ndarray:
    """A ``kernel`` x ``kernel`` Gaussian of ``sigma``, reflected borders (torchvision's GaussianBlur)."""
    return cv2.GaussianBlur(img, (kernel, kernel), sigma, dst=out, sigmaY=sigma, borderType=cv2.BORDER_REFLECT_101)


# --------------------------------------------------------------------------- augment policies
def _signed(rng: np.random.Generator, x: float) -> float:
    return -x if rng.random() < 0.5 else x


def _apply(img: np.ndarray, op: str, mag: float) -> np.ndarray:
    if op == "Identity":
        return img
    if op == "ShearX":
        return affine(img, shear=(math.degrees(math.atan(mag)), 0.0), center=(0.0, 0.0))
    if op == "ShearY":
        return affine(img, shear=(0.0, math.degrees(math.atan(mag))), center=(0.0, 0.0))
    if op == "TranslateX":
        return affine(img, translate=(mag, 0.0))
    if op == "TranslateY":
        return affine(img, translate=(0.0, mag))
    if op == "Rotate":
        return affine(img, angle=mag)
    if op == "Brightness":
        return brightness(img, 1.0 + mag)
    if op == "Color":
        return saturation(img, 1.0 + mag)
    if op == "Contrast":
        return contrast(img, 1.0 + mag)
    if op == "Sharpness":
        return sharpness(img, 1.0 + mag)
    if op == "Posterize":
        return posterize(img, int(mag))
    if op == "Solarize":
        return solarize(img, mag)
    if op == "AutoContrast":
        return autocontrast(img)
    if op == "Equalize":
        return equalize(img)
    raise ValueError(f"unknown augment op {op!r}")


SIGNED = {"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast", "Sharpness"}


def _space(policy: str, bins: int, h: int, w: int) -> dict:
    """torchvision's op -> magnitudes per bin (TrivialAugmentWide's wide ranges, RandAugment's)."""
    lin = np.linspace
    wide = policy == "trivial"
    return {
        "Identity": np.zeros(bins),
        "ShearX": lin(0, 0.99 if wide else 0.3, bins), "ShearY": lin(0, 0.99 if wide else 0.3, bins),
        "TranslateX": lin(0, 32.0 if wide else 150.0 / 331.0 * w, bins),
        "TranslateY": lin(0, 32.0 if wide else 150.0 / 331.0 * h, bins),
        "Rotate": lin(0, 135.0 if wide else 30.0, bins),
        "Brightness": lin(0, 0.99 if wide else 0.9, bins), "Color": lin(0, 0.99 if wide else 0.9, bins),
        "Contrast": lin(0, 0.99 if wide else 0.9, bins), "Sharpness": lin(0, 0.99 if wide else 0.9, bins),
        "Posterize": 8 - np.round(np.arange(bins) / ((bins - 1) / (6 if wide else 4))).astype(int),
        "Solarize": lin(255.0, 0.0, bins), "AutoContrast": np.zeros(bins), "Equalize": np.zeros(bins),
    }


def trivial_augment(img: np.ndarray, rng: np.random.Generator, bins: int = 31) -> np.ndarray:
    """TrivialAugmentWide: one op, uniformly, at a uniform magnitude bin (random sign where signed)."""
    space = _space("trivial", bins, *img.shape[:2])
    ops = list(space)
    op = ops[int(rng.integers(len(ops)))]
    mag = float(space[op][int(rng.integers(bins))])
    return _apply(img, op, _signed(rng, mag) if op in SIGNED else mag)


def rand_augment(img: np.ndarray, rng: np.random.Generator, num_ops: int = 2, magnitude: int = 9,
                 bins: int = 31) -> np.ndarray:
    """RandAugment: ``num_ops`` ops drawn uniformly, each at bin ``magnitude``."""
    space = _space("rand", bins, *img.shape[:2])
    ops = list(space)
    for _ in range(num_ops):
        op = ops[int(rng.integers(len(ops)))]
        mag = float(space[op][magnitude])
        img = _apply(img, op, _signed(rng, mag) if op in SIGNED else mag)
    return img


__all__: Sequence[str] = [
    "random_resized_crop", "hflip", "resize", "resize_shorter", "center_crop", "resize_center_crop", "affine",
    "brightness", "contrast", "saturation", "hue", "color_jitter", "grayscale", "gray", "solarize", "posterize",
    "autocontrast", "equalize", "sharpness", "gaussian_blur", "trivial_augment", "rand_augment",
]
