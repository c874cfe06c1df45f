"""The JPEG kernel (loader_service/decode/jpeg.py, _jpegroi.c): fused crop at power-of-two scales,
header checks before allocation, strict errors.

Real photo: tests/data/grace_hopper.jpg (512x600, 4:2:0; the public-domain US Navy portrait that
matplotlib ships as sample data). Grey, CMYK, progressive, restart-marker, 4:4:4, 4:2:2,
arithmetic-coded and odd-sized variants are made from it here.
"""


import cv2
import numpy as np
import pytest
import simplejpeg

from loader_service.decode import jpeg as J
from loader_service.decode import transforms as T
from testkit.jpegs import PHOTO, _pil, _restart_markers, bomb_jpeg, photo, variants  # noqa: F401 (fixtures)

native = pytest.mark.skipif(J._jpegroi is None, reason="the native kernel is not built (pip install -e .)")


def _full(data: bytes, d: int) -> np.ndarray:
    """Reference: the whole image at 1/d from simplejpeg (its own libjpeg-turbo), CMYK as OpenCV."""
    h, w, cmyk, _ = J.header(data)
    img = simplejpeg.decode_jpeg(data, colorspace="CMYK" if cmyk else "RGB", min_height=-(-h // d),
                                 min_width=-(-w // d))
    assert img.shape[:2] == (-(-h // d), -(-w // d))
    return J.cmyk_to_rgb(img) if cmyk else img


@native
@pytest.mark.parametrize("fast", [(False, False), (True, False), (False, True)], ids=["accurate", "fastdct", "fastups"])
def test_roi_decode_equals_full_decode_then_crop(variants, fast):
    """Max absolute difference 0: the kernel decodes a 16-pixel margin around the crop so that
    fancy chroma upsampling sees the crop's real neighbours (without it: up to 23 at the crop edge)."""
    opts = J.DecodeOptions(fast_dct=fast[0], fast_upsample=fast[1])
    rng = np.random.default_rng(0)
    checked = 0
    for name, data in variants.items():
        h, w, cmyk, _ = J.header(data)
        for d in (1, 2, 4, 8):
            full = simplejpeg.decode_jpeg(data, colorspace="CMYK" if cmyk else "RGB", fastdct=fast[0],
                                          fastupsample=fast[1], min_height=-(-h // d), min_width=-(-w // d))
            full = J.cmyk_to_rgb(full) if cmyk else full
            sh, sw = full.shape[:2]
            for _ in range(25):
                y0, x0 = int(rng.integers(0, sh)), int(rng.integers(0, sw))
                y1, x1 = int(rng.integers(y0 + 1, sh + 1)), int(rng.integers(x0 + 1, sw + 1))
                out = np.empty((y1 - y0, x1 - x0, 3), np.uint8)
                J._jpegroi.decode(data, d, y0, x0, y1 - y0, x1 - x0, out, J._flags(opts))
                diff = np.abs(out.astype(int) - full[y0:y1, x0:x1]).max()
                assert diff == 0, f"{name} at 1/{d}, box {(y0, y1, x0, x1)}: max diff {diff}"
                checked += 1
    assert checked == len(variants) * 4 * 25


@native
@pytest.mark.parametrize("kind,mcu,per_row", [("restart markers per row", 16, 1), ("restart markers every 8 MCUs", 16, 4),
                                              ("grey, restart markers every 16 MCUs", 8, 4)])
def test_a_crop_is_decoded_without_reading_the_restart_segments_around_it(variants, kind, mcu, per_row):
    """The scan data of every segment in the first 16 MCU rows, and of the first segment of every
    row, is made invalid (all-ones bits: no Huffman code), so a whole decode fails. A crop whose
    context lies below and right of those still decodes, to the original's pixels: the kernel
    reads only the segments around the crop."""
    data = variants[kind]
    marks = _restart_markers(data)
    sos = data.index(b"\xff\xda")
    begins = [sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")] + [m + 2 for m in marks]
    ends = marks + [len(data) - 2]
    assert len(begins) == -(-600 // mcu) * per_row
    spoiled = bytearray(data)
    for k, (a, b) in enumerate(zip(begins, ends)):
        if k < 16 * per_row or (per_row > 1 and k % per_row == 0):
            spoiled[a:b] = b"\xfe" * ((b - a) % 2) + b"\xff\x00" * ((b - a) // 2)
    spoiled = bytes(spoiled)
    with pytest.raises(ValueError, match="Huffman|Corrupt"):
        simplejpeg.decode_jpeg(spoiled, strict=True)
    top, left = 16 * mcu, (512 // per_row if per_row > 1 else 0)  # image pixels spoiled above and left
    for d in (1, 2, 4, 8):
        ref = _full(data, d)
        for y0 in (top // d + 16, top // d + 24):
            x0 = left // d + 16
            w = ref.shape[1] - x0 - 20
            out = np.empty((ref.shape[0] - y0 - 1, w, 3), np.uint8)
            J._jpegroi.decode(spoiled, d, y0, x0, out.shape[0], w, out, 0)
            assert np.array_equal(out, ref[y0:y0 + out.shape[0], x0:x0 + w]), f"1/{d} from row {y0}"
        with pytest.raises(ValueError, match="Huffman|Corrupt"):  # a crop that needs the spoiled rows
            J._jpegroi.decode(spoiled, d, top // d, left // d + 16, 8, 8, np.empty((8, 8, 3), np.uint8), 0)
        if per_row > 1:  # or the spoiled columns
            with pytest.raises(ValueError, match="Huffman|Corrupt"):
                J._jpegroi.decode(spoiled, d, top // d + 24, 0, 8, 8, np.empty((8, 8, 3), np.uint8), 0)


@native
@pytest.mark.parametrize("spoil", ["a marker out of sequence", "markers missing", "a marker cut short"])
def test_broken_restart_markers_are_an_error_never_other_pixels(variants, spoil):
    """The restart-segment path trusts nothing it has not checked: markers out of sequence, a
    DRI whose markers are missing, or a file cut inside a segment take the plain path, where
    libjpeg's strict reading refuses the file for any crop that needs the broken part."""
    data = variants["restart markers every 8 MCUs"]
    marks = _restart_markers(data)
    if spoil == "a marker out of sequence":
        i = marks[len(marks) // 2]
        bad = data[:i + 1] + bytes([0xD0 + (data[i + 1] - 0xD0 + 3) % 8]) + data[i + 2:]
    elif spoil == "markers missing":
        bad = bytearray(data)
        for i in reversed(marks):
            del bad[i:i + 2]
        bad = bytes(bad)
    else:
        bad = data[:marks[len(marks) // 2] - 100] + b"\xff\xd9"  # ends with EOI, inside a segment
    h, w, _, restarts = J.header(bad)
    assert restarts
    out = np.empty((40, 60, 3), np.uint8)
    for d in (1, 2, 4, 8):
        with pytest.raises(ValueError, match="Corrupt JPEG|Premature end|marker"):
            J._jpegroi.decode(bad, d, -(-h // d) - 40, -(-w // d) - 60, 40, 60, out, 0)


def test_cmyk_gives_opencvs_pixels(variants):
    data = variants["cmyk"]
    ref = cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    assert np.array_equal(T.decode(data), ref)


def test_only_power_of_two_scales_with_enough_resolution():
    rng = np.random.default_rng(1)
    for _ in range(2000):
        h, w = int(rng.integers(1, 5000)), int(rng.integers(1, 5000))
        mh, mw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        d = J.pick_scale(h, w, mh, mw)
        assert d in (1, 2, 4, 8) and -(-h // d) >= mh and -(-w // d) >= mw
        assert d == 8 or -(-h // (2 * d)) < mh or -(-w // (2 * d)) < mw  # the largest that fits


def test_process_sample_equals_the_scaled_decode_then_crop_and_resize(variants):
    """The fused path's output equals the plain recipe: decode the whole image at the chosen
    power-of-two scale, slice the crop box, resize; flip."""
    spec = T.TransformSpec(96)
    for name, data in variants.items():
        h, w, _, _ = J.header(data)
        for idx in range(20):
            out = np.empty((96, 96, 3), np.uint8)
            T.process_sample(data, spec, T.sample_rng(3, 0, idx), out)
            rng = T.sample_rng(3, 0, idx)
            top, left, ch, cw = T.random_resized_crop_params(h, w, spec.scale, spec.ratio, rng)
            flip = rng.random() < 0.5
            d = J.pick_scale(h, w, -(-h * 96 // ch), -(-w * 96 // cw))
            img = _full(data, d)
            y, x = T._box(top, left, ch, cw, img.shape[0] / h, img.shape[1] / w, img.shape[:2])
            ref = np.empty_like(out)
            T.resize_into(np.ascontiguousarray(img[y, x]), ref)
            assert np.array_equal(out, ref[:, ::-1] if flip else ref), f"{name} sample {idx}"


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
@pytest.mark.parametrize("kind", ["photo", "progressive", "restart markers", "restart markers every 8 MCUs"])
def test_truncated_jpeg_is_an_error_whatever_the_crop(variants, kind, cut):
    """A JPEG cut short (valid header, no EOI) is refused even when the crop lies in the part
    that is still there: the kernel reads on to the end when the EOI marker is missing."""
    data = variants[kind][: int(len(variants[kind]) * cut)]
    spec = T.TransformSpec(32)
    for idx in range(8):  # crops anywhere, including above the cut
        with pytest.raises(T.DecodeError, match="corrupt or truncated JPEG|Premature end|Corrupt JPEG"):
            T.process_sample(data, spec, T.sample_rng(0, 0, idx), np.empty((32, 32, 3), np.uint8))
    with pytest.raises(T.DecodeError, match="corrupt or truncated JPEG"):
        T.decode(data)


def _bomb_png(w: int, h: int) -> bytes:
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk + b"\x00" * 64


@pytest.mark.parametrize("make", [lambda p: bomb_jpeg(p, 60000, 60000), lambda p: _bomb_png(30000, 30000)],
                         ids=["jpeg-60000x60000", "png-30000x30000"])
def test_decode_bombs_are_refused_from_the_header(photo, make):
    import resource

    data = make(photo)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for fn in (lambda: T.decode(data),
               lambda: T.process_sample(data, T.TransformSpec(32), T.sample_rng(0, 0, 0), np.empty((32, 32, 3), np.uint8))):
        with pytest.raises(T.DecodeError, match=r"above the limit of 178,956,970 \(max_image_pixels\)"):
            fn()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: nothing big allocated


def test_pixel_limit_is_configurable(photo):
    opts = J.DecodeOptions(max_pixels=512 * 600 - 1)
    with pytest.raises(T.DecodeError, match="is 512x600 = 307,200 pixels, above the limit of 307,199"):
        T.decode(photo, opts)
    assert T.decode(photo, J.DecodeOptions(max_pixels=512 * 600)).shape == (600, 512, 3)
    with pytest.raises(ValueError, match="max_image_pixels must be >= 1"):
        J.DecodeOptions(max_pixels=0)


def test_arithmetic_coded_jpeg_decodes_or_fails_clearly(photo):
    """libjpeg-turbo decodes arithmetic-coded JPEGs; check it gives the Huffman version's pixels
    (jpegtran transcodes losslessly) where jpegtran is there."""
    import shutil
    import subprocess

    if shutil.which("jpegtran") is None:
        pytest.skip("jpegtran (libjpeg-turbo-progs) not installed")
    arith = subprocess.run(["jpegtran", "-arithmetic"], input=photo, capture_output=True, check=True).stdout
    assert np.array_equal(T.decode(arith), T.decode(photo))


def test_decode_path_is_reported():
    path = J.decode_path()
    assert path.startswith("native-roi (libjpeg-turbo ") if J._jpegroi is not None else path.startswith("simplejpeg")
