"""Decode and augment one sample into a uint8 HWC slot. Shared by the service's workers and
by the benchmark's baselines, so every contender does exactly the same work.

A sample is what a source's ``read`` returns (:data:`loader_service.sources.base.Sample`):
encoded bytes, or an already-decoded uint8 array ``H x W x 3`` (RGB) or ``H x W`` (grey).

* JPEG: the kernel in :mod:`loader_service.decode.jpeg`. The crop is chosen from the header's size
  first; the JPEG is decoded at the largest power-of-two DCT scale (1/2, 1/4, 1/8) that still
  gives the crop at least the output resolution (the other n/8 factors are slower than a full
  decode), and only the crop's rows and columns are decoded where the native kernel is built.
  Same pixels as decoding the whole image at that scale and slicing it; same determinism.
* Every image is refused above ``DecodeOptions.max_pixels`` from its header, before anything
  is allocated for it; truncated or corrupt JPEGs are errors, never grey pixels, and a failed
  decode is never retried at full size.
* PNG: OpenCV; Pillow as a last resort.
* WebP, BMP, TIFF, PPM/PGM (the rest of what torchvision's ImageFolder reads): Pillow, which
  is asked for those formats only (it knows others, such as EPS, that would run external
  programs); the size comes from the header, checked against the pixel limit before decoding;
  a multi-frame file gives its first frame.
* Arrays: no decode at all. The crop box, flip and resize (and every random draw) are those
  of a decoded image of the same size, so an array gives the very bytes its PNG would; a grey
  crop becomes RGB (three equal channels, as a grey PNG decodes) before the resize.
* Randomness comes from draws keyed by (seed, epoch, sample index) (:class:`SampleRandom`), never
  from the worker, so a sample is the same bytes whichever worker makes it.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from loader_service.decode import jpeg
from loader_service.decode.jpeg import DEFAULT_OPTIONS, DecodeOptions
from loader_service.sources.base import Sample
from wire.jobspec import check_crop

try:
    import cv2

    cv2.setNumThreads(1)  # one decode process per core; OpenCV's own threads would oversubscribe
except ImportError:  # pragma: no cover - exercised only where OpenCV is absent
    cv2 = None
try:
    import simplejpeg
except ImportError:  # pragma: no cover
    simplejpeg = None

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PILLOW_FORMATS = ("WEBP", "BMP", "TIFF", "PPM")  # read through Pillow; nothing else is tried
READABLE = "JPEG, PNG, WebP, BMP, TIFF, PPM/PGM"


class DecodeError(ValueError):
    """The sample is not an image this service can decode (or, for an array, use)."""


@dataclass(frozen=True)
class TransformSpec:
    """What to do to every sample of a job."""

    image_size: int = 224
    train: bool = True
    scale: Tuple[float, float] = (0.08, 1.0)
    ratio: Tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    eval_crop_fraction: float = 0.875  # eval: resize shorter side to size/0.875, centre-crop size

    def __post_init__(self) -> None:
        if self.image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {self.image_size}")
        check_crop(self.scale, self.ratio)  # the job's rule (a ValueError naming scale or ratio)


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment
_TAG = 0x6175676D  # "augm": these draws apart from any other use of the same seed


def _mix(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit ints that spreads every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class SampleRandom:
    """The per-sample random draws: SplitMix64 over a counter, keyed by a hash of (seed, epoch,
    sample index), so a sample's draws are the same on any worker, restart or replica.

    Keying costs ~1 us and a draw ~0.3 us, where seeding a numpy Generator (SeedSequence
    hashing) cost ~11 us a sample. ``random``, ``uniform`` and ``integers`` of one number are
    drawn here (the built-in recipes use only these); any other use (``size=``, ``normal``,
    ``permutation``, ...) goes to a numpy Generator built on first use from the same key
    (Philox, a counter-based generator whose key is the seed: no SeedSequence), so a pipeline
    may use this as it would a ``np.random.Generator``.
    """

    __slots__ = ("_key", "_n", "_numpy")

    def __init__(self, seed: int, epoch: int, index: int):
        self._key = _mix((_mix((_mix((seed ^ _TAG) & _M64) + epoch) & _M64) + index) & _M64)
        self._n = 0  # draws so far
        self._numpy: Optional[np.random.Generator] = None

    def _next(self) -> int:
        self._n += 1
        return _mix((self._key + self._n * _GOLDEN) & _M64)

    def random(self, size=None):
        """A float in [0, 1) (53 random bits), or numpy's ``random(size)``."""
        if size is not None:
            return self.numpy.random(size)
        return (self._next() >> 11) * 2.0 ** -53

    def uniform(self, low=0.0, high=1.0, size=None):
        if size is not None or not isinstance(low, (int, float)) or not isinstance(high, (int, float)):
            return self.numpy.uniform(low, high, size)
        return low + (high - low) * ((self._next() >> 11) * 2.0 ** -53)

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint=False):
        """An int in [low, high) (Lemire's multiply-shift: bias below 2^-40 for ranges under 2^24),
        or numpy's ``integers`` for anything but one number."""
        if size is not None or dtype is not np.int64 or endpoint or not isinstance(low, int) \
                or not isinstance(high, (int, type(None))):
            return self.numpy.integers(low, high, size, dtype, endpoint)
        if high is None:
            low, high = 0, low
        if high <= low:
            raise ValueError(f"integers: low >= high ({low} >= {high})")
        return low + ((self._next() * (high - low)) >> 64)

    @property
    def numpy(self) -> np.random.Generator:
        """The numpy Generator of this sample's key (built once, on first use)."""
        if self._numpy is None:
            self._numpy = np.random.Generator(np.random.Philox(key=[self._key, _mix(self._key ^ _TAG)]))
        return self._numpy

    def __getattr__(self, name: str):  # the rest of np.random.Generator's methods
        if name.startswith("_"):  # a slot not set yet (copy, pickle): never the Generator's
            raise AttributeError(name)
        return getattr(self.numpy, name)


def sample_rng(seed: int, epoch: int, index: int) -> SampleRandom:
    """The random draws of sample ``index`` of ``epoch`` under ``seed`` (see :class:`SampleRandom`).
    Changing what this draws changes every augmented byte: bump wire.protocol.PROTOCOL_VERSION."""
    return SampleRandom(seed, epoch, index)


def process_sample(data: Sample, spec: TransformSpec, rng: np.random.Generator, out: np.ndarray,
                   options: DecodeOptions = DEFAULT_OPTIONS) -> None:
    """Write the transformed ``data`` into ``out`` (size, size, 3) uint8.

    ``data``: encoded bytes (decoded here) or a uint8 array ``H x W x 3`` RGB / ``H x W`` grey
    (used as is). Both take the same path below; only the size lookup and the decode differ.
    """
    size = spec.image_size
    h, w, cmyk, restarts = _header(data, options)
    if spec.train:
        top, left, ch, cw = random_resized_crop_params(h, w, spec.scale, spec.ratio, rng)
        flip = spec.flip and rng.random() < 0.5
    else:
        top, left, ch, cw = center_crop_params(h, w, spec.eval_crop_fraction)
        flip = False
    min_h, min_w = math.ceil(h * size / ch), math.ceil(w * size / cw)
    if isinstance(data, np.ndarray) or data[:3] != JPEG_MAGIC:
        img = check_pixels(data) if isinstance(data, np.ndarray) else _decode_checked(data, h, w, cmyk, options)
        crop = img[_box(top, left, ch, cw, img.shape[0] / h, img.shape[1] / w, img.shape[:2])]
    else:
        d = jpeg.pick_scale(h, w, min_h, min_w)
        sh, sw = -(-h // d), -(-w // d)
        y, x = _box(top, left, ch, cw, sh / h, sw / w, (sh, sw))
        try:
            crop = jpeg.decode_crop(data, h, w, cmyk, d, (y.start, y.stop, x.start, x.stop), options, restarts)
        except ValueError as exc:  # strict: truncated or corrupt data is an error, not grey pixels
            raise DecodeError(f"corrupt or truncated JPEG ({exc})") from None
    if crop.ndim == 2:  # a grey array: RGB like a grey PNG's decode, before the resize so the math is the same
        crop = gray_to_rgb(crop)
    resize_into(crop, out)
    if flip and cv2 is not None:
        cv2.flip(out, 1, dst=out)  # in place: no temporary copy of the output
    elif flip:  # pragma: no cover
        out[:] = out[:, ::-1].copy()


def _box(top: int, left: int, ch: int, cw: int, fy: float, fx: float, shape) -> Tuple[slice, slice]:
    """The crop box in an image decoded at scale (fy, fx) of the original."""
    y0, x0 = int(round(top * fy)), int(round(left * fx))
    y1 = min(max(int(round((top + ch) * fy)), y0 + 1), shape[0])
    x1 = min(max(int(round((left + cw) * fx)), x0 + 1), shape[1])
    return slice(y0, y1), slice(x0, x1)


def _header(data: Sample, options: DecodeOptions) -> Tuple[int, int, bool, bool]:
    """(height, width, cmyk, restarts) from the header alone, checked against the pixel limit
    (``restarts``: see :func:`jpeg.header`)."""
    if isinstance(data, np.ndarray):
        h, w = check_pixels(data).shape[:2]
        return h, w, False, False
    if data[:3] == JPEG_MAGIC:
        try:
            h, w, cmyk, restarts = jpeg.header(data)
        except ValueError as exc:
            raise DecodeError(f"corrupt JPEG header ({exc})") from None
    elif data[:8] == PNG_MAGIC:
        h, w = _png_size(data)
        cmyk = restarts = False
    else:
        h, w = _pillow_size(data)
        cmyk = restarts = False
    try:
        jpeg.check_size(h, w, options)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    return h, w, cmyk, restarts


def _png_size(data: bytes) -> Tuple[int, int]:
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise DecodeError("corrupt PNG header (no IHDR chunk)")
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if h < 1 or w < 1:
        raise DecodeError(f"corrupt PNG header (size {w}x{h})")
    return h, w


def _open_pillow(data: bytes):
    """Pillow's lazy image for one of PILLOW_FORMATS (the header read, no pixel decoded)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise DecodeError("empty file")
    try:
        with warnings.catch_warnings():  # its bomb warning: the pixel limit here is the one that counts
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=PILLOW_FORMATS)
    except UnidentifiedImageError:
        raise DecodeError(f"not an image this service reads ({READABLE}; starts with {data[:8]!r})") from None
    except Image.DecompressionBombError as exc:
        raise DecodeError(str(exc)) from None
    except Exception as exc:  # a broken header: any of Pillow's parsers' errors
        raise DecodeError(f"corrupt image header ({type(exc).__name__}: {exc})") from None


def _pillow_size(data: bytes) -> Tuple[int, int]:
    with _open_pillow(data) as im:
        w, h = im.size
    if h < 1 or w < 1:
        raise DecodeError(f"corrupt image header (size {w}x{h})")
    return h, w


def image_size_of(data: Sample, options: DecodeOptions = DEFAULT_OPTIONS) -> Tuple[int, int]:
    """(height, width) from the header alone (of an array: its shape, once checked)."""
    return _header(data, options)[:2]


def decode(data: Sample, options: DecodeOptions = DEFAULT_OPTIONS) -> np.ndarray:
    """Full-size RGB uint8 (H, W, 3). Raises :class:`DecodeError` with the reason.

    An array is checked and returned as is, or made RGB if grey. The header is checked
    against the pixel limit before any pixel is decoded.
    """
    if isinstance(data, np.ndarray):
        img = check_pixels(data)
        return gray_to_rgb(img) if img.ndim == 2 else img
    h, w, cmyk, _ = _header(data, options)
    return _decode_checked(data, h, w, cmyk, options)


def _decode_checked(data: bytes, h: int, w: int, cmyk: bool, options: DecodeOptions) -> np.ndarray:
    """:func:`decode` of bytes whose header (``h``, ``w``, ``cmyk``) :func:`_header` has read and checked."""
    if data[:3] == JPEG_MAGIC:
        try:
            return jpeg.decode_scaled(data, h, w, cmyk, 1, options)
        except ValueError as exc:  # strict: truncated or corrupt data is an error, not grey pixels
            raise DecodeError(f"corrupt or truncated JPEG ({exc})") from None
    if data[:8] != PNG_MAGIC:
        return _decode_pillow(data)
    if cv2 is not None:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if img is None:
            raise DecodeError("corrupt or truncated image (decoder gave up)")
        return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    return _decode_pillow(data)  # pragma: no cover


def check_pixels(img: np.ndarray) -> np.ndarray:
    """``img`` if it is a decoded sample (uint8, H x W x 3 or H x W, not empty), else :class:`DecodeError`."""
    if img.dtype != np.uint8 or not (img.ndim == 2 or (img.ndim == 3 and img.shape[2] == 3)) \
            or img.shape[0] < 1 or img.shape[1] < 1:
        raise DecodeError(f"a decoded sample must be a uint8 array H x W x 3 (RGB) or H x W (grey), "
                          f"got {img.dtype} of shape {img.shape}")
    return img


def gray_to_rgb(img: np.ndarray) -> np.ndarray:
    """(H, W) grey -> (H, W, 3) C-contiguous, three equal channels (as OpenCV decodes a grey PNG)."""
    if cv2 is not None:
        return cv2.cvtColor(np.ascontiguousarray(img), cv2.COLOR_GRAY2RGB)
    return np.repeat(img[:, :, None], 3, axis=2)  # pragma: no cover


def _decode_pillow(data: bytes) -> np.ndarray:
    """RGB uint8 through Pillow (PILLOW_FORMATS; PNG where OpenCV is absent)."""
    try:
        with _open_pillow(data) if data[:8] != PNG_MAGIC else _open_png_pillow(data) as im:
            return np.asarray(im.convert("RGB"))
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"corrupt or truncated image ({type(exc).__name__}: {exc})") from None


def _open_png_pillow(data: bytes):  # pragma: no cover - only where OpenCV is absent
    from PIL import Image

    return Image.open(io.BytesIO(data), formats=("PNG",))


def resize_into(src: np.ndarray, out: np.ndarray) -> None:
    """Resize ``src`` (h, w, 3) to ``out``'s size, in place.

    Bilinear, or the area filter where it shrinks by more than 2x (where bilinear would alias);
    the DCT-scaled decode keeps most crops under 2x, so the costly area filter is rare.
    """
    oh, ow = out.shape[:2]
    shrinking = src.shape[0] > 2 * oh and src.shape[1] > 2 * ow
    if cv2 is not None:
        interp = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
        if not src.flags.c_contiguous:
            src = np.ascontiguousarray(src)
        cv2.resize(src, (ow, oh), dst=out, interpolation=interp)
        return
    from PIL import Image  # pragma: no cover

    out[:] = np.asarray(Image.fromarray(src).resize((ow, oh), Image.BILINEAR))  # pragma: no cover


def random_resized_crop_params(
    h: int, w: int, scale: Tuple[float, float], ratio: Tuple[float, float], rng: np.random.Generator
) -> Tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, with our generator: (top, left, h, w)."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        cw = int(round(math.sqrt(target_area * aspect)))
        ch = int(round(math.sqrt(target_area / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(rng.integers(0, h - ch + 1))
            left = int(rng.integers(0, w - cw + 1))
            return top, left, ch, cw
    # fallback: centre crop at the nearest allowed aspect ratio
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, max(1, int(round(w / ratio[0])))
    elif in_ratio > ratio[1]:
        ch, cw = h, max(1, int(round(h * ratio[1])))  # a thin image at an extreme ratio keeps one pixel
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def center_crop_params(h: int, w: int, fraction: float) -> Tuple[int, int, int, int]:
    """The square region that Resize(size/fraction) + CenterCrop(size) keeps, in source pixels."""
    side = max(1, int(round(min(h, w) * fraction)))
    return (h - side) // 2, (w - side) // 2, side, side
