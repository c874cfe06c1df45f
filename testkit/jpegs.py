"""JPEG test material shared by the kernel's and prepare-jpegs' tests: a real photo and its variants
(grey, CMYK, progressive, restart markers, subsamplings, odd sizes), and a decode bomb made from it."""

import io
import os

import cv2
import numpy as np
import pytest
import simplejpeg

from testkit.paths import TEST_DATA

PHOTO = os.path.join(TEST_DATA, "grace_hopper.jpg")


@pytest.fixture(scope="module")
def photo() -> bytes:
    with open(PHOTO, "rb") as f:
        return f.read()


def _pil(img: np.ndarray, mode: str = "RGB", **kw) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).convert(mode).save(buf, "JPEG", **kw)
    return buf.getvalue()


def _rst(img: np.ndarray, sampling, interval: int) -> bytes:
    """A JPEG with a restart marker after every ``interval`` MCUs."""
    params = [cv2.IMWRITE_JPEG_QUALITY, 90, cv2.IMWRITE_JPEG_RST_INTERVAL, interval]
    if sampling is not None:
        factor = {"4:2:0": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420, "4:4:4": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444}
        params += [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, factor[sampling]]
        img = img[:, :, ::-1]
    return cv2.imencode(".jpg", np.ascontiguousarray(img), params)[1].tobytes()


def _restart_markers(data: bytes) -> list:
    """Offsets of the restart markers in the scan (after the SOS segment)."""
    sos = data.index(b"\xff\xda")
    i = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")
    found = []
    while (i := data.find(b"\xff", i)) >= 0 and i + 1 < len(data):
        if 0xD0 <= data[i + 1] <= 0xD7:
            found.append(i)
        i += 2 if data[i + 1] != 0xFF else 1
    return found


@pytest.fixture(scope="module")
def variants(photo) -> dict:
    rgb = simplejpeg.decode_jpeg(photo)
    odd = rgb[:333, :451]
    v = {
        "photo": photo,
        "grey": _pil(rgb, "L", quality=90),
        "cmyk": _pil(rgb, "CMYK", quality=90),
        "progressive": _pil(rgb, quality=85, progressive=True),
        "odd-sized 451x333": _pil(odd, quality=90),
        "4:4:4": _pil(rgb, quality=90, subsampling=0),
        "4:2:2": _pil(rgb, quality=90, subsampling=1),
        "restart markers": cv2.imencode(".jpg", rgb[:, :, ::-1], [cv2.IMWRITE_JPEG_RST_INTERVAL, 3])[1].tobytes(),
        # restart intervals that tile the MCU grid: the kernel decodes only the segments around the crop
        "restart markers per row": _rst(rgb, "4:2:0", 512 // 16),
        "restart markers every 2 rows": _rst(rgb, "4:2:0", 2 * 512 // 16),
        "restart markers every 8 MCUs": _rst(rgb, "4:2:0", 8),
        "4:4:4, restart markers every 8 MCUs": _rst(rgb, "4:4:4", 8),
        "grey, restart markers every 16 MCUs": _rst(cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY), None, 16),
        "odd-sized 451x333, a restart marker after every MCU": _rst(odd, "4:2:0", 1),
        "1x1": _pil(rgb[:1, :1], quality=90),
    }
    return v


def bomb_jpeg(photo: bytes, w: int, h: int) -> bytes:
    """The photo with its SOF0 frame size rewritten: a small file whose header claims w x h."""
    i = photo.index(b"\xff\xc0")
    return photo[:i + 5] + h.to_bytes(2, "big") + w.to_bytes(2, "big") + photo[i + 9:]
