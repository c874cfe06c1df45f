"""The uint8 ops against float references written from torchvision's math (tolerances stated
per op, in grey levels of 0..255)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loader_service.decode import ops
from loader_service.sources.demo import demo_image
from loader_service.decode.transforms import TransformSpec, process_sample, sample_rng


@pytest.fixture(scope="module")
def img():
    import cv2

    base = cv2.resize(demo_image(0, 3, 1), (80, 64))
    noise = np.random.default_rng(0).integers(-20, 21, base.shape)
    return np.clip(base.astype(int) + noise, 0, 255).astype(np.uint8)  # textured, every channel varied


def luma_trunc(x):  # torchvision's rgb_to_grayscale on uint8: weighted sum, truncated
    x = x.astype(np.float64)
    return np.floor(0.2989 * x[..., 0] + 0.587 * x[..., 1] + 0.114 * x[..., 2])


def blend(x, other, f):  # torchvision's _blend: clamp, truncate
    return np.clip(f * x.astype(np.float64) + (1 - f) * other, 0, 255).astype(np.uint8)


def assert_close(got, want, tol):
    diff = np.abs(got.astype(int) - want.astype(int))
    assert got.shape == want.shape and got.dtype == np.uint8
    assert diff.max() <= tol, f"max error {diff.max()} > {tol}"


@pytest.mark.parametrize("f", [0.0, 0.4, 1.0, 1.7])
def test_brightness_exact(img, f):
    assert_close(ops.brightness(img, f), blend(img, 0.0, f), 0)


@pytest.mark.parametrize("f", [0.3, 1.5])
def test_contrast_within_1(img, f):  # the luma mean is rounded here, truncated there
    assert_close(ops.contrast(img, f), blend(img, luma_trunc(img).mean(), f), 1)


@pytest.mark.parametrize("f", [0.0, 0.5, 1.8])
def test_saturation_within_2(img, f):  # luma rounded vs truncated, result rounded vs truncated
    assert_close(ops.saturation(img, f), blend(img, luma_trunc(img)[..., None], f), 2)


def test_grayscale_within_1(img):
    g = ops.grayscale(img)
    assert (g[..., 0] == g[..., 1]).all() and (g[..., 1] == g[..., 2]).all()
    assert_close(g[..., 0], luma_trunc(img).astype(np.uint8), 1)


def hue_reference(x, shift):
    """torchvision's _rgb2hsv / _hsv2rgb in float."""
    rgb = x.astype(np.float64) / 255
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    maxc, minc = rgb.max(-1), rgb.min(-1)
    cr = maxc - minc
    s = cr / np.where(maxc == 0, 1, maxc)
    crd = np.where(cr == 0, 1, cr)
    rc, gc, bc = (maxc - r) / crd, (maxc - g) / crd, (maxc - b) / crd
    h = np.where(maxc == r, bc - gc, np.where(maxc == g, 2 + rc - bc, 4 + gc - rc))
    h = np.where(cr == 0, 0, h)
    h = ((h / 6 + 1) % 1 + shift) % 1
    v = maxc
    i = np.floor(h * 6) % 6
    f = h * 6 - np.floor(h * 6)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    choices = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)]
    out = np.zeros_like(rgb)
    for k, (a, bb, c) in enumerate(choices):
        m = i == k
        out[m] = np.stack([a[m], bb[m], c[m]], -1)
    return np.clip(out * 255 + 0.5, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("shift", [-0.4, -0.1, 0.0, 0.25])
def test_hue_mean_error_below_1_5_and_max_12(img, shift):
    # 8-bit HSV quantises hue to 1/256 turn and saturation to 1/255: small mean, bounded peaks
    got, want = ops.hue(img, shift), hue_reference(img, shift)
    diff = np.abs(got.astype(int) - want.astype(int))
    assert diff.mean() < 1.5 and diff.max() <= 12, (diff.mean(), diff.max())


def test_solarize_and_posterize_exact(img):
    x = img.astype(int)
    assert_close(ops.solarize(img, 128), np.where(x >= 128, 255 - x, x).astype(np.uint8), 0)
    assert_close(ops.posterize(img, 3), (x & 0b11100000).astype(np.uint8), 0)


def test_autocontrast_exact(img):
    x = img.astype(np.float64)
    lo, hi = x.min((0, 1)), x.max((0, 1))
    assert_close(ops.autocontrast(img), np.clip((x - lo) * (255 / (hi - lo)), 0, 255).astype(np.uint8), 0)


def test_equalize_is_pils(img):
    from PIL import Image, ImageOps

    assert_close(ops.equalize(img), np.asarray(ImageOps.equalize(Image.fromarray(img))), 0)


def conv2d_reflect(x, k, mode):
    r = k.shape[0] // 2
    pad = np.pad(x.astype(np.float64), ((r, r), (r, r), (0, 0)), mode=mode)
    out = np.zeros(x.shape, np.float64)
    for dy in range(k.shape[0]):
        for dx in range(k.shape[1]):
            out += k[dy, dx] * pad[dy: dy + x.shape[0], dx: dx + x.shape[1]]
    return out


@pytest.mark.parametrize("kernel, sigma", [(3, 0.8), (9, 2.0)])
def test_gaussian_blur_within_1(img, kernel, sigma):
    ax = np.arange(kernel) - (kernel - 1) / 2
    g = np.exp(-0.5 * (ax / sigma) ** 2)
    g /= g.sum()
    want = np.clip(np.round(conv2d_reflect(img, np.outer(g, g), "reflect")), 0, 255).astype(np.uint8)
    assert_close(ops.gaussian_blur(img, kernel, sigma), want, 1)


@pytest.mark.parametrize("f", [0.0, 1.9])
def test_sharpness_within_1(img, f):
    k = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float64) / 13
    smooth = np.round(conv2d_reflect(img, k, "edge"))
    smooth[0], smooth[-1], smooth[:, 0], smooth[:, -1] = img[0], img[-1], img[:, 0], img[:, -1]
    assert_close(ops.sharpness(img, f), blend(img, smooth, f), 1)


def affine_reference(x, m):
    """Nearest-neighbour inverse mapping in float: out[y, x] = in[M^-1 (x, y)], 0 outside."""
    h, w = x.shape[:2]
    full = np.vstack([m, [0, 0, 1]])
    inv = np.linalg.inv(full)
    ys, xs = np.mgrid[0:h, 0:w]
    src = inv @ np.stack([xs.ravel(), ys.ravel(), np.ones(h * w)])
    sx, sy = np.round(src[0]).astype(int), np.round(src[1]).astype(int)
    ok = (sx >= 0) & (sx < w) & (sy >= 0) & (sy < h)
    out = np.zeros_like(x).reshape(-1, 3)
    out[ok] = x[sy[ok], sx[ok]]
    return out.reshape(x.shape)


@pytest.mark.parametrize("kw", [dict(angle=30.0), dict(translate=(7.0, -3.0)), dict(shear=(20.0, 0.0)),
                                dict(shear=(0.0, -15.0), angle=-10.0)])
def test_affine_differs_from_the_float_map_only_at_rounding_ties(img, kw):
    # nearest neighbour: a source coordinate at .5 may round either way; < 3% of pixels move by one
    got = ops.affine(img, **kw)
    h, w = img.shape[:2]
    m = ops.affine_matrix(kw.get("angle", 0.0), kw.get("translate", (0, 0)), kw.get("shear", (0, 0)),
                          ((w - 1) / 2, (h - 1) / 2))
    want = affine_reference(img, m)
    assert (got != want).any(-1).mean() < 0.03
    if kw == dict(angle=30.0):  # counter-clockwise: the top-right corner turns towards the top-left
        assert math.isclose(m[0, 0], math.cos(math.radians(30)), abs_tol=1e-9) and m[1, 0] < 0


def resize_reference(x, oh, ow):
    """Bilinear with half-pixel centres (torchvision antialias=False for an upscale)."""
    h, w = x.shape[:2]
    fy = np.clip((np.arange(oh) + 0.5) * h / oh - 0.5, 0, h - 1)
    fx = np.clip((np.arange(ow) + 0.5) * w / ow - 0.5, 0, w - 1)
    y0, x0 = np.floor(fy).astype(int), np.floor(fx).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy, wx = (fy - y0)[:, None, None], (fx - x0)[None, :, None]
    x = x.astype(np.float64)
    top = x[y0][:, x0] * (1 - wx) + x[y0][:, x1] * wx
    bot = x[y1][:, x0] * (1 - wx) + x[y1][:, x1] * wx
    return np.clip(np.round(top * (1 - wy) + bot * wy), 0, 255).astype(np.uint8)


def test_resize_flip_center_crop(img):
    assert_close(ops.resize(img, (100, 120)), resize_reference(img, 100, 120), 1)
    assert np.array_equal(ops.hflip(img), img[:, ::-1])
    assert np.array_equal(ops.center_crop(img, 40), img[12:52, 20:60])
    short = ops.resize_shorter(img, 32)
    assert short.shape == (32, 40, 3)


def test_random_resized_crop_is_the_services_fused_crop(img):
    from loader_service.sources.demo import encode_jpeg

    data = encode_jpeg(img, 90)
    a, b = np.empty((24, 24, 3), np.uint8), np.empty((24, 24, 3), np.uint8)
    ops.random_resized_crop(data, a, sample_rng(1, 2, 3), flip=True)
    process_sample(data, TransformSpec(24), sample_rng(1, 2, 3), b)
    assert np.array_equal(a, b)


def test_color_jitter_is_the_ops_in_the_drawn_order(img):
    rng = np.random.default_rng(7)
    got = ops.color_jitter(img, np.random.default_rng(7), 0.4, 0.4, 0.4, 0.1)
    order = rng.permutation(4)
    fb, fc, fs = (float(rng.uniform(0.6, 1.4)) for _ in range(3))
    fh = float(rng.uniform(-0.1, 0.1))
    want = img
    for k in order:
        want = [lambda x: ops.brightness(x, fb), lambda x: ops.contrast(x, fc), lambda x: ops.saturation(x, fs),
                lambda x: ops.hue(x, fh)][k](want)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("policy", [ops.trivial_augment, ops.rand_augment])
def test_augment_policies_are_deterministic_per_generator(img, policy):
    outs = [policy(img, np.random.default_rng(s)) for s in range(12)]
    again = [policy(img, np.random.default_rng(s)) for s in range(12)]
    assert all(np.array_equal(a, b) for a, b in zip(outs, again))
    assert all(o.shape == img.shape and o.dtype == np.uint8 for o in outs)
    assert len({o.tobytes() for o in outs}) > 3  # different draws, different ops


def test_every_policy_op_runs_at_its_extremes(img):
    for policy in ("trivial", "rand"):
        for op, mags in ops._space(policy, 31, *img.shape[:2]).items():
            for mag in (mags[0], mags[-1]):
                out = ops._apply(img, op, float(mag))
                assert out.shape == img.shape and out.dtype == np.uint8, op
