"""The JPEG decode kernel: a crop at a power-of-two DCT scale, with the header checked first.

Two paths give the crop of the image decoded at scale 1/d (d in 1, 2, 4, 8):

* ``native-roi``: the ``_jpegroi`` extension (built from ``_jpegroi.c`` against the system
  libjpeg-turbo by ``pip install``) decodes only the crop's rows and iMCU columns and stops
  after the crop's last row (see the C file). In a baseline file whose restart markers tile
  the MCU grid (``loader-service prepare-jpegs`` adds them losslessly) it decodes only the
  restart segments around the crop: no entropy decoding of the rows above it or the columns
  beside it. Pixels: the same as decoding the whole image at 1/d and slicing, checked by
  tests/unit/decode/test_jpeg.py.
* ``simplejpeg``: the whole image at 1/d, then the slice. Used when the extension is not built
  (no libjpeg-turbo headers); ``LOADER_REQUIRE_NATIVE_JPEG=1`` makes that an import error.

Only powers of two: libjpeg-turbo's other factors (7/8, 6/8, ...) are slower than a full
decode. Every JPEG error is a :class:`~loader_service.decode.transforms.DecodeError`-compatible
``ValueError`` with the library's reason: truncated or corrupt data is refused (strict), never
handed on as grey pixels, and never retried as a full-size decode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Tuple

import numpy as np

try:
    from loader_service.decode import _jpegroi
except ImportError as exc:  # not built: the simplejpeg path
    if os.environ.get("LOADER_REQUIRE_NATIVE_JPEG", "").strip() not in ("", "0"):
        raise ImportError(f"LOADER_REQUIRE_NATIVE_JPEG is set but the native JPEG kernel is missing ({exc}); "
                          "install libjpeg62-turbo-dev and reinstall (pip install -e .)") from exc
    _jpegroi = None
try:
    import simplejpeg
except ImportError:  # pragma: no cover
    simplejpeg = None

DEFAULT_MAX_PIXELS = 178_956_970  # Pillow's decompression-bomb error threshold (2 x MAX_IMAGE_PIXELS)
SCALES = (8, 4, 2, 1)  # denominators tried, largest first
ROI_MIN_SAVING = 0.85  # a crop reaching below this fraction of the rows and wider than it: whole decode


@dataclass(frozen=True)
class DecodeOptions:
    """Service-wide decode settings (``--max-image-pixels``, ``--jpeg-fast-dct``, ``--jpeg-fast-upsample``)."""

    max_pixels: int = DEFAULT_MAX_PIXELS  # images with more pixels are refused from their header
    fast_dct: bool = False  # libjpeg's IFAST DCT; see docs/benchmarks.md for speed vs PSNR
    fast_upsample: bool = False  # no "fancy" chroma upsampling

    def __post_init__(self) -> None:
        if self.max_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_pixels}")


DEFAULT_OPTIONS = DecodeOptions()


def decode_path() -> str:
    """Which path this process decodes JPEGs with (shown at start and in /v1/status)."""
    if _jpegroi is not None:
        v = _jpegroi.LIBJPEG_TURBO_VERSION_NUMBER
        return f"native-roi (libjpeg-turbo {v // 1000000}.{v // 1000 % 1000}.{v % 1000})"
    return "simplejpeg (full decode at the scale, then crop)" if simplejpeg is not None else "none"


def header(data: bytes) -> Tuple[int, int, bool, bool]:
    """(height, width, cmyk, restarts) from the JPEG's markers; ``ValueError`` if they are unreadable.

    ``restarts``: a baseline scan with restart markers, whose segments around a crop the native
    kernel may decode alone (always False without it)."""
    if _jpegroi is not None:
        h, w, _, cmyk, progressive, restart_interval = _jpegroi.header(data)
        return h, w, bool(cmyk), restart_interval > 0 and not progressive
    h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    return h, w, colorspace.upper() in ("CMYK", "YCCK"), False


def check_size(h: int, w: int, options: DecodeOptions) -> None:
    """Refuse an image above the pixel limit before anything is allocated for it."""
    if h * w > options.max_pixels:
        raise ValueError(f"image is {w}x{h} = {h * w:,} pixels, above the limit of {options.max_pixels:,} "
                         "(max_image_pixels)")


def pick_scale(h: int, w: int, min_h: int, min_w: int) -> int:
    """The largest power-of-two denominator whose decode still has >= min_h x min_w pixels."""
    for d in SCALES:
        if -(-h // d) >= min_h and -(-w // d) >= min_w:
            return d
    return 1


def decode_crop(data: bytes, h: int, w: int, cmyk: bool, d: int, box: Tuple[int, int, int, int],
                options: DecodeOptions = DEFAULT_OPTIONS, restarts: bool = False) -> np.ndarray:
    """The (y0, y1, x0, x1) ``box`` of the JPEG decoded at 1/``d`` (box in that image's pixels), RGB uint8.

    ``restarts`` (from :func:`header`): the rows above the crop may cost nothing on the native path."""
    y0, y1, x0, x1 = box
    sh, sw = -(-h // d), -(-w // d)
    # The system libjpeg-turbo (2.1 on Debian 12) decodes a whole image ~15 % slower than the one
    # simplejpeg bundles (3.x); both give the same pixels (tests/unit/decode/test_jpeg.py). So a crop
    # that needs nearly every row and most columns goes the simplejpeg way (thresholds measured
    # on the real-photo set, docs/benchmarks.md).
    big = y1 - (y0 if restarts else 0) > ROI_MIN_SAVING * sh and (x1 - x0) > ROI_MIN_SAVING * sw
    if _jpegroi is not None and not (big and simplejpeg is not None):
        out = np.empty((y1 - y0, x1 - x0, 3), np.uint8)
        _jpegroi.decode(data, d, y0, x0, y1 - y0, x1 - x0, out, _flags(options))
        return out
    return _decode_simplejpeg(data, sh, sw, cmyk, d, options)[y0:y1, x0:x1]


def _flags(options: DecodeOptions) -> int:
    return (_jpegroi.FASTDCT if options.fast_dct else 0) | (_jpegroi.FASTUPSAMPLE if options.fast_upsample else 0)


def decode_scaled(data: bytes, h: int, w: int, cmyk: bool, d: int,
                  options: DecodeOptions = DEFAULT_OPTIONS) -> np.ndarray:
    """The whole JPEG at 1/``d``, RGB uint8 (the native kernel with the full box, else simplejpeg)."""
    sh, sw = -(-h // d), -(-w // d)
    if _jpegroi is not None and simplejpeg is None:
        return decode_crop(data, h, w, cmyk, d, (0, sh, 0, sw), options)
    return _decode_simplejpeg(data, sh, sw, cmyk, d, options)


def _decode_simplejpeg(data: bytes, sh: int, sw: int, cmyk: bool, d: int, options: DecodeOptions) -> np.ndarray:
    img = simplejpeg.decode_jpeg(data, colorspace="CMYK" if cmyk else "RGB", fastdct=options.fast_dct,
                                 fastupsample=options.fast_upsample, min_height=sh, min_width=sw, strict=True)
    if img.shape[:2] != (sh, sw):  # simplejpeg picks the factor itself: make sure it is ours
        raise ValueError(f"decoded {img.shape[1]}x{img.shape[0]}, expected {sw}x{sh} at 1/{d}")
    return cmyk_to_rgb(img) if cmyk else img


def cmyk_to_rgb(cmyk: np.ndarray) -> np.ndarray:
    """OpenCV's CMYK -> RGB (as in _jpegroi.c), so both paths and older releases agree."""
    c = cmyk.astype(np.int32)
    k = c[..., 3:4]
    return (k - (((255 - c[..., :3]) * k) >> 8)).astype(np.uint8)
