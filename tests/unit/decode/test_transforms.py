"""Decode + augment: formats, determinism, geometry, errors."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from loader_service.decode import transforms as T
from wire.jobspec import RATIO_LIMITS
from loader_service.sources.demo import demo_image, encode_jpeg


@pytest.fixture(scope="module")
def jpeg():
    return encode_jpeg(demo_image(0, 1, 1), 90)


def run(data, spec, seed=0, epoch=0, index=0):
    out = np.zeros((spec.image_size, spec.image_size, 3), np.uint8)
    T.process_sample(data, spec, T.sample_rng(seed, epoch, index), out)
    return out


def test_same_seed_epoch_index_gives_identical_bytes(jpeg):
    spec = T.TransformSpec(64)
    assert np.array_equal(run(jpeg, spec, 1, 2, 3), run(jpeg, spec, 1, 2, 3))
    assert not np.array_equal(run(jpeg, spec, 1, 2, 3), run(jpeg, spec, 1, 3, 3))


def test_eval_transform_is_deterministic_and_ignores_rng(jpeg):
    spec = T.TransformSpec(64, train=False)
    assert np.array_equal(run(jpeg, spec, 0, 0, 0), run(jpeg, spec, 5, 6, 7))


def test_eval_center_crop_matches_a_reference_resize():
    import cv2

    img = demo_image(0, 2, 2)
    png = cv2.imencode(".png", img[:, :, ::-1])[1].tobytes()  # lossless: compare pixels exactly
    out = run(png, T.TransformSpec(64, train=False))
    h, w = img.shape[:2]
    side = round(min(h, w) * 0.875)
    ref = cv2.resize(img[(h - side) // 2:(h - side) // 2 + side, (w - side) // 2:(w - side) // 2 + side], (64, 64),
                     interpolation=cv2.INTER_AREA)
    assert np.array_equal(out, ref)


def test_png_gray_and_alpha_decode_to_rgb():
    import cv2

    gray = (np.arange(40 * 50) % 256).astype(np.uint8).reshape(40, 50)
    rgba = np.dstack([gray, gray, gray, np.full_like(gray, 7)])
    for img in (gray, rgba):
        data = cv2.imencode(".png", img)[1].tobytes()
        dec = T.decode(data)
        assert dec.shape == (40, 50, 3) and dec.dtype == np.uint8
        assert np.array_equal(dec[..., 0], gray)


def test_grayscale_jpeg_decodes_to_rgb():
    import cv2

    gray = np.tile(np.linspace(0, 255, 64, dtype=np.uint8), (48, 1))
    data = cv2.imencode(".jpg", gray)[1].tobytes()
    assert T.decode(data).shape == (48, 64, 3)
    assert run(data, T.TransformSpec(16)).shape == (16, 16, 3)


def test_cmyk_jpeg_decodes():
    pil = pytest.importorskip("PIL.Image")
    import io

    buf = io.BytesIO()
    pil.fromarray(demo_image(0, 3, 3)).convert("CMYK").save(buf, "JPEG")
    img = T.decode(buf.getvalue())
    assert img.shape == (375, 500, 3)


@pytest.mark.parametrize("data, match", [
    (b"", "empty file"),
    (b"GIF89a....", r"not an image this service reads \(JPEG, PNG, WebP, BMP, TIFF, PPM/PGM; starts with b'GIF89a"),
    (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not an image this service reads"),  # never Ghostscript
    (b"\xff\xd8\xff\xe0" + b"\x00" * 50, "corrupt JPEG header"),
])
def test_bad_bytes_raise_decode_error_with_reason(data, match):
    with pytest.raises(T.DecodeError, match=match):
        T.decode(data)



def _pillow_bytes(img, fmt, **kw) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, kw", [("BMP", {}), ("TIFF", {}), ("TIFF", {"compression": "tiff_lzw"}), ("PPM", {}),
                                     ("WEBP", {"lossless": True})])
def test_the_other_imagefolder_formats_decode_to_their_pixels(fmt, kw):
    rgb = np.random.default_rng(3).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    data = _pillow_bytes(rgb, fmt, **kw)
    assert T.image_size_of(data) == (37, 53)
    assert np.array_equal(T.decode(data), rgb)
    out = run(data, T.TransformSpec(16, train=False))
    assert out.shape == (16, 16, 3) and out.any()


def test_grey_and_alpha_in_the_other_formats_come_out_rgb():
    grey = (np.arange(30 * 20) % 256).astype(np.uint8).reshape(30, 20)
    for data in (_pillow_bytes(grey, "PPM"), _pillow_bytes(grey, "TIFF"), _pillow_bytes(grey, "BMP")):  # PGM is PPM
        dec = T.decode(data)
        assert dec.shape == (30, 20, 3) and all(np.array_equal(dec[..., c], grey) for c in range(3))
    rgba = np.dstack([np.dstack([grey] * 3), np.full_like(grey, 7)])  # alpha > 0: lossless WebP keeps the colour
    assert np.array_equal(T.decode(_pillow_bytes(rgba, "WEBP", lossless=True)), rgba[..., :3])


def test_a_multi_frame_tiff_gives_its_first_frame():
    import io

    from PIL import Image

    frames = [Image.fromarray(np.full((8, 9, 3), v, np.uint8)) for v in (10, 200)]
    buf = io.BytesIO()
    frames[0].save(buf, "TIFF", save_all=True, append_images=frames[1:])
    assert np.array_equal(T.decode(buf.getvalue()), np.full((8, 9, 3), 10, np.uint8))


def test_a_bmp_claiming_a_huge_size_is_refused_from_its_header():
    import struct
    import tracemalloc

    w = h = 60000  # 3.6 GP: above the pixel limit
    header = b"BM" + struct.pack("<IHHI", 54 + 3 * w * h % (1 << 32), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, 0, 2835, 2835, 0, 0)
    data = header + info + b"\x00" * 64
    tracemalloc.start()
    try:
        with pytest.raises(T.DecodeError, match="pixel"):
            T.decode(data)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20  # nothing of the claimed size was allocated
    finally:
        tracemalloc.stop()


def test_truncated_webp_and_tiff_are_errors_not_garbage():
    rgb = np.random.default_rng(4).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    for data in (_pillow_bytes(rgb, "WEBP", quality=80), _pillow_bytes(rgb, "TIFF")):
        with pytest.raises(T.DecodeError, match="corrupt or truncated image|corrupt image header"):
            T.decode(data[: len(data) // 2])

def test_truncated_jpeg_is_an_error_not_garbage(jpeg):
    with pytest.raises(ValueError):
        run(jpeg[: len(jpeg) // 3], T.TransformSpec(32))


def test_random_resized_crop_params_stay_inside_and_respect_ranges():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        h, w = int(rng.integers(1, 600)), int(rng.integers(1, 600))
        top, left, ch, cw = T.random_resized_crop_params(h, w, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        assert 0 <= top and 0 <= left and 0 < ch and 0 < cw and top + ch <= h and left + cw <= w


@settings(max_examples=400, deadline=None)
@given(h=st.integers(1, 5000), w=st.integers(1, 5000), seed=st.integers(0, 2**32 - 1),
       scale=st.tuples(st.floats(1e-9, 1.0), st.floats(1e-9, 1.0)).map(sorted),
       ratio=st.tuples(st.floats(RATIO_LIMITS[0], RATIO_LIMITS[1]), st.floats(RATIO_LIMITS[0], RATIO_LIMITS[1])).map(sorted))
def test_every_allowed_scale_and_ratio_gives_a_crop_inside_the_image(h, w, seed, scale, ratio):
    """The job's ranges are those every image survives: no empty side, no overflow, at any size."""
    top, left, ch, cw = T.random_resized_crop_params(h, w, scale, ratio, np.random.default_rng(seed))
    assert 0 <= top and 0 <= left and 0 < ch and 0 < cw and top + ch <= h and left + cw <= w


@pytest.mark.parametrize("ratio", [(1e-9, 1e-9), (1e308, 1e308), (1e-4, 1.0), (1.0, 1e4), (0.5, float("inf"))])
def test_an_aspect_ratio_that_would_break_a_crop_is_refused_naming_ratio(ratio):
    with pytest.raises(ValueError, match="ratio"):
        T.TransformSpec(ratio=ratio)


def test_transform_spec_validation():
    with pytest.raises(ValueError, match="scale"):
        T.TransformSpec(scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="ratio"):
        T.TransformSpec(ratio=(0, 1))


# ---------------------------------------------------------------------------- decoded arrays
def _png(img: np.ndarray) -> bytes:
    """Lossless PNG of an RGB (H, W, 3) or grey (H, W) uint8 array."""
    import cv2

    ok, buf = cv2.imencode(".png", img[:, :, ::-1] if img.ndim == 3 else img)
    assert ok
    return buf.tobytes()


def _noise(shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:shape[0], 0:shape[1]]
    base = (xx * 3 + yy * 5) % 256
    if len(shape) == 3:
        base = np.stack([base, (xx + 2 * yy) % 256, (xx * yy) % 256], -1)
    return (base ^ rng.integers(0, 32, size=shape)).astype(np.uint8)


def _both(arr, spec, seed, epoch, index):
    """process_sample of the array and of its PNG, each with a fresh generator; and the generators after."""
    outs, after = [], []
    for data in (arr, _png(arr)):
        out = np.full((spec.image_size, spec.image_size, 3), 17, np.uint8)
        rng = T.sample_rng(seed, epoch, index)
        T.process_sample(data, spec, rng, out)
        outs.append(out)
        after.append(rng.random())
    return outs, after


# 75x101 -> 32: crops shrink by more than 2x (INTER_AREA) or less (bilinear); -> 160: upscale
@pytest.mark.parametrize("size", [32, 160])
def test_rgb_array_gives_the_bytes_of_its_png(size):
    arr = _noise((75, 101, 3))
    for spec in (T.TransformSpec(size), T.TransformSpec(size, scale=(0.01, 0.05)), T.TransformSpec(size, flip=False)):
        for seed in range(12):
            (a, p), (ra, rp) = _both(arr, spec, seed, 1, seed * 7)
            assert a.tobytes() == p.tobytes(), (spec, seed)
            assert ra == rp, "the array path must draw exactly what the PNG path draws"
    spec = T.TransformSpec(size, train=False)
    (a, p), (ra, rp) = _both(arr, spec, 0, 0, 0)
    assert a.tobytes() == p.tobytes() and ra == rp
    # a strided view (a slice of a bigger array) is as good as a C-contiguous one
    big = _noise((90, 120, 3), seed=1)
    view = big[5:80, 7:108]
    assert not view.flags.c_contiguous
    for spec in (T.TransformSpec(size), T.TransformSpec(size, train=False)):
        assert run(view, spec, 3, 0, 4).tobytes() == run(_png(np.ascontiguousarray(view)), spec, 3, 0, 4).tobytes()


def test_grey_array_gives_the_rgb_bytes_of_its_grey_png():
    grey = _noise((61, 47))
    for spec in (T.TransformSpec(24), T.TransformSpec(96), T.TransformSpec(24, train=False)):
        for seed in range(8):
            (a, p), (ra, rp) = _both(grey, spec, seed, 0, seed)
            assert a.tobytes() == p.tobytes(), (spec, seed)
            assert ra == rp
            assert np.array_equal(a[..., 0], a[..., 1]) and np.array_equal(a[..., 0], a[..., 2])
    assert np.array_equal(T.decode(grey), T.decode(_png(grey)))  # decode() of a sample: RGB either way
    assert T.decode(grey).shape == (61, 47, 3)


@pytest.mark.parametrize("bad", [np.zeros((8, 8, 3), np.float32), np.zeros((8, 8, 1), np.uint8),
                                 np.zeros((8, 8, 4), np.uint8), np.zeros((0, 8, 3), np.uint8),
                                 np.zeros((2, 8, 8, 3), np.uint8)])
def test_arrays_outside_the_sample_contract_are_refused(bad):
    with pytest.raises(T.DecodeError, match="uint8 array H x W x 3"):
        run(bad, T.TransformSpec(16))


# ------------------------------------------------------------------ the per-sample draws
def test_the_draws_are_pinned_to_the_protocol_version():
    """Changing what sample_rng draws changes every augmented byte: a service and a client (or
    two replicas) of different draws must not mix, so the change bumps PROTOCOL_VERSION and
    this test is updated with it."""
    from wire.protocol import PROTOCOL_VERSION

    r = T.sample_rng(7, 2, 1234)
    # 5 (Hello.window), 6 (Credit removed, Batch.chunk, co-located mode) and 7 (Accept.decoding,
    # DatasetInfo.decoding) changed the wire, not the draws: the same numbers as under 4
    assert (PROTOCOL_VERSION, r.random(), r.integers(0, 1000), r.uniform(0.5, 2.0)) == \
        (7, 0.9027178898124768, 100, 1.6115158520458217)


@given(st.integers(0, (1 << 63) - 1), st.integers(0, 1 << 20), st.integers(0, 1 << 40))
@settings(max_examples=200, deadline=None)
def test_draws_depend_on_seed_epoch_and_index_only(seed, epoch, index):
    a, b = T.sample_rng(seed, epoch, index), T.sample_rng(seed, epoch, index)
    draws = [(a.random(), a.uniform(2, 3), a.integers(5, 9), a.integers(7)) for _ in range(4)]
    assert draws == [(b.random(), b.uniform(2, 3), b.integers(5, 9), b.integers(7)) for _ in range(4)]
    for u, v, i, j in draws:
        assert 0.0 <= u < 1.0 and 2.0 <= v < 3.0 and 5 <= i < 9 and 0 <= j < 7
    others = {T.sample_rng(seed ^ 1, epoch, index).random(), T.sample_rng(seed, epoch + 1, index).random(),
              T.sample_rng(seed, epoch, index + 1).random()}
    assert draws[0][0] not in others


def test_draws_beyond_one_number_come_from_numpy_with_the_same_key():
    a, b = T.sample_rng(1, 2, 3), T.sample_rng(1, 2, 3)
    assert a.permutation(6).tolist() == b.permutation(6).tolist()
    assert np.array_equal(a.uniform(0, 1, size=3), b.uniform(0, 1, size=3))
    assert a.integers(0, 10, size=4).tolist() == b.integers(0, 10, size=4).tolist() and a.normal() == b.normal()
    assert sorted(T.sample_rng(1, 2, 3).permutation(6).tolist()) == list(range(6))
    with pytest.raises(ValueError, match="low >= high"):
        a.integers(5, 5)
    counts = np.bincount([T.sample_rng(5, 1, i).integers(0, 4) for i in range(8000)], minlength=4)
    assert counts.min() > 1800  # about 2000 each: no value favoured
