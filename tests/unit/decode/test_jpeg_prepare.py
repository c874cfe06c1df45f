"""The lossless JPEG preparation tool (loader_service/decode/jpeg_prepare.py, _jpegprep.c): restart
markers at every MCU row, the same decoded pixels, every APPn/COM marker kept; prepare_tree and
``loader-service prepare-jpegs`` over a dataset folder.

The JPEG variants (grey, CMYK, progressive, restart markers, 4:4:4, 4:2:2, odd-sized, 1x1) and
the real photo are tests/unit/decode/test_jpeg.py's.
"""

from testkit.paths import REPO_ROOT
import os
import shutil
import subprocess
import sys

import cv2
import numpy as np
import pytest
import simplejpeg

from loader_service.decode import jpeg_prepare as JP
from loader_service.cli.main import main as cli_main

from tests.conftest import write_imagefolder
from testkit.jpegs import bomb_jpeg, photo, variants  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(not JP.available(), reason="the _jpegprep extension is not built (pip install -e .)")
ROOT = REPO_ROOT
FIXTURES = (photo, variants)  # pytest fixtures this module uses, imported from test_jpeg_kernel


def _segments(data: bytes) -> list:
    """The (marker, payload) segments from SOI up to the first SOS (an independent reading of
    the header, not libjpeg's)."""
    assert data[:2] == b"\xff\xd8"
    out, i = [], 2
    while True:
        assert data[i] == 0xFF, f"no marker at {i}"
        marker = data[i + 1]
        n = int.from_bytes(data[i + 2:i + 4], "big")
        out.append((marker, data[i + 4:i + 2 + n]))
        if marker == 0xDA:
            return out
        i += 2 + n


def _restart_info(data: bytes) -> tuple:
    """(SOF marker, restart interval, MCUs per MCU row) from the header."""
    segs = dict(_segments(data))  # the last of each kind; SOF and DRI appear once
    sof = next(m for m in segs if 0xC0 <= m <= 0xCF and m not in (0xC4, 0xC8, 0xCC))
    p = segs[sof]
    width, ncomp = int.from_bytes(p[3:5], "big"), p[5]
    hmax = max(p[6 + 3 * k + 1] >> 4 for k in range(ncomp))
    span = 8 if ncomp == 1 else 8 * hmax  # a one-component scan's MCU is one block
    dri = int.from_bytes(segs[0xDD], "big") if 0xDD in segs else 0
    return sof, dri, -(-width // span)


def _app_and_com(data: bytes, skip_own: bool = True) -> list:
    """The APPn and COM segments in order; without the JFIF APP0 and Adobe APP14 that libjpeg
    writes itself (from the frame's colour space) when ``skip_own``."""
    out = []
    for m, p in _segments(data):
        if not (0xE0 <= m <= 0xEF or m == 0xFE):
            continue
        if skip_own and ((m == 0xE0 and p[:5] == b"JFIF\0") or (m == 0xEE and p[:5] == b"Adobe")):
            continue
        out.append((m, p))
    return out


def _pixels(data: bytes) -> list:
    """The image as simplejpeg (its own libjpeg-turbo) and OpenCV decode it."""
    cmyk = simplejpeg.decode_jpeg_header(data)[2].upper() in ("CMYK", "YCCK")
    return [simplejpeg.decode_jpeg(data, colorspace="CMYK" if cmyk else "RGB"),
            cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)]


def test_every_variant_keeps_its_pixels_and_gets_a_restart_marker_per_mcu_row(variants):
    for name, data in variants.items():
        for rows in (1, 2, 3):
            out = JP.add_restart_markers(data, rows)
            sof, dri, mcus = _restart_info(out)
            assert sof == 0xC0, f"{name}: SOF{sof - 0xC0}, not baseline"
            assert dri == rows * mcus, f"{name}, rows={rows}: restart interval {dri}, MCU row {mcus}"
            for ref, got in zip(_pixels(data), _pixels(out)):
                assert ref.shape == got.shape and np.array_equal(ref, got), f"{name}, rows={rows}"
            assert _app_and_com(out) == _app_and_com(data), name
            assert JP.add_restart_markers(out, rows) == out, f"{name}: a second pass changes the bytes"


def test_progressive_and_arithmetic_inputs_come_out_baseline(variants, photo):
    assert _restart_info(variants["progressive"])[0] == 0xC2
    assert _restart_info(JP.add_restart_markers(variants["progressive"]))[0] == 0xC0
    if shutil.which("jpegtran") is None:
        pytest.skip("jpegtran (libjpeg-turbo-progs) not installed")
    arith = subprocess.run(["jpegtran", "-arithmetic"], input=photo, capture_output=True, check=True).stdout
    assert _restart_info(arith)[0] == 0xC9
    out = JP.add_restart_markers(arith)  # the system libjpeg-turbo decodes arithmetic coding
    assert _restart_info(out)[:2] == (0xC0, 32)
    for ref, got in zip(_pixels(photo), _pixels(out)):
        assert np.array_equal(ref, got)


def test_same_bytes_as_jpegtran(variants):
    """What ``jpegtran -restart R -optimize -copy all`` writes, to the byte."""
    if shutil.which("jpegtran") is None:
        pytest.skip("jpegtran (libjpeg-turbo-progs) not installed")
    for name, data in variants.items():
        for rows in (1, 4):
            ref = subprocess.run(["jpegtran", "-restart", str(rows), "-optimize", "-copy", "all"], input=data,
                                 capture_output=True, check=True).stdout
            assert JP.add_restart_markers(data, rows) == ref, f"{name}, rows={rows}"


def test_tiles_of_a_few_mcus_divide_the_mcu_row(variants):
    """``mcus=N``: an interval that divides the MCU row (so segments tile it), the largest in
    [N/2, N], else whole rows; pixels unchanged; jpegtran's bytes for that interval."""
    expect = {("photo", 8): 8, ("photo", 5): 4, ("odd-sized 451x333", 8): 29, ("grey", 8): 8, ("4:4:4", 3): 2,
              ("1x1", 8): 1}
    jpegtran = shutil.which("jpegtran") is not None
    for name, data in variants.items():
        for mcus in (1, 3, 5, 8):
            out = JP.add_restart_markers(data, mcus=mcus)
            sof, dri, per_row = _restart_info(out)
            assert sof == 0xC0 and per_row % dri == 0 and (mcus <= 2 * dri <= 2 * mcus or dri == per_row), \
                f"{name}, mcus={mcus}: interval {dri} of a {per_row}-MCU row"
            assert expect.get((name, mcus), dri) == dri, (name, mcus, dri)
            for ref, got in zip(_pixels(data), _pixels(out)):
                assert np.array_equal(ref, got), f"{name}, mcus={mcus}"
            if jpegtran:
                ref = subprocess.run(["jpegtran", "-restart", f"{dri}B", "-optimize", "-copy", "all"], input=data,
                                     capture_output=True, check=True).stdout
                assert out == ref, f"{name}, mcus={mcus}"


def _with_markers(data: bytes, segments: list) -> bytes:
    """``data`` with ``segments`` (marker, payload) inserted right after SOI."""
    extra = b"".join(b"\xff" + bytes([m]) + (len(p) + 2).to_bytes(2, "big") + p for m, p in segments)
    return data[:2] + extra + data[2:]


def test_app_and_com_markers_survive_byte_identical(variants):
    rng = np.random.default_rng(0)
    added = [(0xE1, b"Exif\0\0MM\0*" + rng.bytes(3000)),  # an EXIF-like APP1
             (0xE2, b"ICC_PROFILE\0\x01\x01" + rng.bytes(65519)),  # a full-size APP2 (the longest segment)
             (0xEF, b"\0"),
             (0xFE, "a comment, caf\u00e9".encode())]
    for name in ("photo", "cmyk", "grey", "progressive"):
        data = _with_markers(variants[name], added)
        out = JP.add_restart_markers(data)
        kept = _app_and_com(out)
        assert kept == _app_and_com(data) and all(s in kept for s in added), name
        # exactly one JFIF (colour/grey) or Adobe (CMYK) marker: the library's own
        own = [m for m, p in _app_and_com(out, skip_own=False) if (m, p) not in kept]
        assert own == ([0xEE] if name == "cmyk" else [0xE0]), name


@pytest.mark.parametrize("cut", [0.02, 0.3, 0.6, 0.95])
@pytest.mark.parametrize("kind", ["photo", "progressive", "restart markers"])
def test_truncated_input_is_refused_with_the_library_reason(variants, kind, cut):
    with pytest.raises(ValueError, match="^Premature end of JPEG file$"):
        JP.add_restart_markers(variants[kind][:int(len(variants[kind]) * cut)])


def test_corrupt_input_is_refused_with_the_library_reason(photo):
    sos = photo.index(b"\xff\xda")
    junk = photo[:sos + 40] + b"\xff\xd0" * 3 + photo[sos + 40:]  # restart markers where there are none
    with pytest.raises(ValueError, match="^Corrupt JPEG data"):
        JP.add_restart_markers(junk)
    with pytest.raises(ValueError, match="^Not a JPEG file: starts with 0x89 0x50$"):
        JP.add_restart_markers(cv2.imencode(".png", np.zeros((4, 4, 3), np.uint8))[1].tobytes())
    with pytest.raises(ValueError, match="^Empty input file$"):
        JP.add_restart_markers(b"")


def test_pixel_limit_is_checked_from_the_header(photo):
    import resource

    bomb = bomb_jpeg(photo, 60000, 60000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=r"^image is 60000x60000 = 3,600,000,000 pixels, above the limit of "
                                         r"178,956,970 \(max_pixels\)$"):
        JP.add_restart_markers(bomb)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: no coefficients read
    with pytest.raises(ValueError, match=r"is 512x600 = 307,200 pixels, above the limit of 307,199 \(max_pixels\)"):
        JP.add_restart_markers(photo, max_pixels=512 * 600 - 1)
    assert _restart_info(JP.add_restart_markers(photo, max_pixels=512 * 600))[1] == 32


def test_bad_arguments(photo):
    with pytest.raises(ValueError, match="rows must be 1..65535, got 0"):
        JP.add_restart_markers(photo, 0)
    with pytest.raises(ValueError, match="max_pixels must be >= 1, got 0"):
        JP.add_restart_markers(photo, 1, 0)
    for rows, mcus in ((2, 8), (1, -1)):
        with pytest.raises(ValueError, match=f"mcus must be 0 \\(whole rows\\) or 1..65535, with rows=1; "
                                             f"got mcus={mcus}, rows={rows}"):
            JP.add_restart_markers(photo, rows, mcus=mcus)
    wide = bomb_jpeg(photo, 65500, 16)  # libjpeg's widest; 4:2:0: 4094 MCUs per MCU row, 17 rows > 65535
    with pytest.raises(ValueError, match=r"^17 MCU rows of 4094 MCUs exceed the largest restart interval "
                                         r"\(65535 MCUs\)$"):
        JP.add_restart_markers(wide, 17)


# -- prepare_tree and the CLI ------------------------------------------------------------------


def _files(root: str) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture
def tree(tmp_path, variants):
    """An ImageFolder (JPEGs and PNGs in class folders), the variants under photos/ (one with an
    upper-case .JPEG), a text file, and a truncated JPEG."""
    src = str(tmp_path / "src")
    write_imagefolder(src, classes=2, per_class=5, png_every=3)
    for i, (name, data) in enumerate(variants.items()):
        _write(os.path.join(src, "photos", "deeper" if i % 2 else "", f"v{i}.{'JPEG' if i == 3 else 'jpg'}"), data)
    _write(os.path.join(src, "notes.txt"), b"not an image\n")
    _write(os.path.join(src, "photos", "bad.jpg"), variants["photo"][:20000])
    return src


def test_prepare_tree_converts_jpegs_copies_the_rest_and_reports_the_failed(tree, tmp_path):
    dst = str(tmp_path / "dst")
    calls = []
    summary = JP.prepare_tree(tree, dst, workers=2, progress=lambda *a: calls.append(a))
    files = _files(tree)
    jpegs = [f for f in files if f.lower().endswith((".jpg", ".jpeg"))]
    assert _files(dst) == files  # the same relative paths, no temporary file left
    assert summary.failed == (("photos/bad.jpg", "Premature end of JPEG file; copied unchanged"),)
    assert (summary.converted, summary.copied, summary.skipped) == (len(jpegs) - 1, len(files) - len(jpegs), 0)
    assert calls[-1][:2] == (len(files), len(files)) and len(calls) == len(files)
    assert (summary.bytes_in, summary.bytes_out) == calls[-1][2:]
    assert summary.bytes_in == sum(os.path.getsize(os.path.join(tree, f)) for f in files)
    assert summary.bytes_out == sum(os.path.getsize(os.path.join(dst, f)) for f in files)
    for f in files:
        a, b = _read(os.path.join(tree, f)), _read(os.path.join(dst, f))
        if f in jpegs and f != "photos/bad.jpg":
            _, dri, per_row = _restart_info(b)  # the default: tiles of <= 8 MCUs that divide the row
            assert per_row == _restart_info(a)[2] and per_row % dri == 0 and (4 <= dri <= 8 or dri == per_row), f
            for ref, got in zip(_pixels(a), _pixels(b)):
                assert np.array_equal(ref, got), f
        else:
            assert a == b, f  # PNGs, the text file, the failed JPEG: unchanged copies
        assert os.stat(os.path.join(dst, f)).st_mode == os.stat(os.path.join(tree, f)).st_mode, f
    assert "1 failed" in summary.format()
    assert "failed: photos/bad.jpg: Premature end of JPEG file; copied unchanged" in summary.format()


def test_prepare_tree_reruns_skip_what_is_up_to_date(tree, tmp_path):
    dst = str(tmp_path / "dst")
    first = JP.prepare_tree(tree, dst, workers=1, progress=False)
    again = JP.prepare_tree(tree, dst, workers=1, progress=False)
    n = len(_files(tree))
    # the failed JPEG is tried (and reported) again: its copy is older than its source
    assert (again.converted, again.copied, again.skipped, again.failed) == (0, 0, n - 1, first.failed)
    assert again.bytes_in == os.path.getsize(os.path.join(tree, "photos/bad.jpg"))
    st = os.stat(os.path.join(tree, "photos/v0.jpg"))
    os.utime(os.path.join(tree, "photos/v0.jpg"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))  # edited later
    third = JP.prepare_tree(tree, dst, workers=1, progress=False)
    assert (third.converted, third.copied, third.skipped) == (1, 0, n - 2)



def test_a_jpeg_above_max_sample_bytes_is_copied_unchanged_and_reported(tmp_path, variants):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    big, small = variants["photo"], min(variants.values(), key=len)
    _write(os.path.join(src, "big.jpg"), big)
    _write(os.path.join(src, "small.jpg"), small)
    limit = len(big) - 1
    assert len(small) <= limit
    summary = JP.prepare_tree(src, dst, workers=1, progress=False, max_sample_bytes=limit)
    assert summary.failed == (("big.jpg", f"larger than {limit} bytes (max_sample_bytes); copied unchanged"),)
    assert summary.converted == 1 and _read(os.path.join(dst, "big.jpg")) == big
    assert _restart_info(_read(os.path.join(dst, "small.jpg")))[1] > 0
    # reported again on a rerun (stamped older than its source), converted once the limit allows
    assert JP.prepare_tree(src, dst, workers=1, progress=False, max_sample_bytes=limit).failed == summary.failed
    again = JP.prepare_tree(src, dst, workers=1, progress=False, max_sample_bytes=len(big))
    assert (again.converted, again.skipped, again.failed) == (1, 1, ())
    with pytest.raises(ValueError, match="max_sample_bytes must be >= 1, got 0"):
        JP.prepare_tree(src, dst, workers=1, progress=False, max_sample_bytes=0)


def test_a_rerun_deletes_the_temporary_files_a_killed_run_left(tree, tmp_path):
    dst = str(tmp_path / "dst")
    JP.prepare_tree(tree, dst, workers=1, progress=False)
    target = os.path.join(dst, "photos", "v0.jpg")
    # a run killed between writing and renaming: the writer itself, stopped dead at the rename
    kill = ("import os, sys; from loader_service.decode import jpeg_prepare as JP; "
            "os.replace = lambda *a: os._exit(9); "
            "JP._write_atomic(sys.argv[1], 0o644, lambda f: f.write(b'half a file'))")
    proc = subprocess.run([sys.executable, "-c", kill, target], cwd=ROOT, capture_output=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    folder = os.path.join(dst, "photos")
    left = [n for n in os.listdir(folder) if n.endswith(".part")]
    assert len(left) == 1 and left[0].startswith(".v0.jpg."), left
    # look-alikes that are not this tool's: another name, no random part, a folder
    for name in (".notes.jpg.abcd1234.part", ".v0.jpg.part"):
        _write(os.path.join(folder, name), b"keep")
    os.mkdir(os.path.join(folder, ".v2.jpg.abcd1234.part"))
    summary = JP.prepare_tree(tree, dst, workers=1, progress=False)
    assert summary.stale_removed == 1
    assert "deleted 1 temporary file(s) left by an interrupted run" in summary.format()
    assert sorted(n for n in os.listdir(folder) if n.endswith(".part")) == [
        ".notes.jpg.abcd1234.part", ".v0.jpg.part", ".v2.jpg.abcd1234.part"]

def test_prepare_tree_refuses_a_destination_inside_the_source(tree, tmp_path):
    before = _files(tree)
    for dst in (tree, os.path.join(tree, "out"), os.path.join(tree, "photos", "deeper", "out")):
        with pytest.raises(ValueError, match="is (the source|inside the source)"):
            JP.prepare_tree(tree, dst, workers=1, progress=False)
    os.symlink(tree, str(tmp_path / "alias"))
    with pytest.raises(ValueError, match="is the source"):
        JP.prepare_tree(str(tmp_path / "alias"), tree, workers=1, progress=False)
    assert _files(tree) == before
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        JP.prepare_tree(str(tmp_path / "missing"), str(tmp_path / "dst"), workers=1, progress=False)


def test_cli_exit_codes(tree, tmp_path, capsys):
    assert cli_main(["prepare-jpegs", tree, str(tmp_path / "dst"), "--workers", "2", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "1 failed" in out and "failed: photos/bad.jpg: Premature end of JPEG file; copied unchanged" in out
    os.unlink(os.path.join(tree, "photos", "bad.jpg"))
    assert cli_main(["prepare-jpegs", tree, str(tmp_path / "clean"), "--workers", "2", "--rows", "2"]) == 0
    captured = capsys.readouterr()
    assert ", 0 failed;" in captured.out and "prepare-jpegs: " in captured.err  # the summary; progress lines
    data = _read(str(tmp_path / "clean" / "photos" / "v0.jpg"))
    assert _restart_info(data)[1] == 2 * _restart_info(data)[2]
    assert cli_main(["prepare-jpegs", tree, str(tmp_path / "tiles"), "--mcus", "8", "--quiet"]) == 0
    assert _restart_info(_read(str(tmp_path / "tiles" / "photos" / "v0.jpg")))[1:] == (8, 32)
    with pytest.raises(SystemExit):
        cli_main(["prepare-jpegs", tree, str(tmp_path / "both"), "--mcus", "8", "--rows", "2"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert cli_main(["prepare-jpegs", tree, os.path.join(tree, "x")]) == 2
    assert "is inside the source" in capsys.readouterr().err


def test_links_fifos_and_unreadable_folders(tmp_path, photo):
    """Folder links are followed (not into a cycle), a file link's target is copied; what cannot
    be read is reported, never silently left out."""
    src, other = tmp_path / "src", tmp_path / "elsewhere"
    _write(str(other / "a.jpg"), photo)
    _write(str(src / "cls" / "b.jpg"), photo)
    os.symlink(str(other), str(src / "linked"))  # a class folder that is a link
    os.symlink(str(other), str(src / "linked-too"))  # and another link to the same folder
    os.symlink(str(src), str(src / "cls" / "loop"))  # a cycle
    os.symlink(str(other / "a.jpg"), str(src / "cls" / "file-link.jpg"))
    os.symlink(str(tmp_path / "gone.jpg"), str(src / "cls" / "dangling.jpg"))
    os.mkfifo(str(src / "cls" / "fifo.jpg"))
    locked = src / "locked"
    _write(str(locked / "c.jpg"), photo)
    os.chmod(str(locked), 0)
    try:
        summary = JP.prepare_tree(str(src), str(tmp_path / "dst"), workers=1, progress=False)
    finally:
        os.chmod(str(locked), 0o755)
    failed = dict(summary.failed)
    assert failed.pop("cls/dangling.jpg").startswith("FileNotFoundError: ") and failed.pop("cls/fifo.jpg") == \
        "not a regular file; not copied"
    if os.geteuid() != 0:  # root reads a mode-0 folder anyway
        assert failed.pop("locked") == "PermissionError: Permission denied; folder not read"
    assert failed == {}
    done = set(_files(str(tmp_path / "dst")))
    assert {"cls/b.jpg", "cls/file-link.jpg", "linked/a.jpg", "linked-too/a.jpg"} <= done and not any("loop/" in f for f in done)
    assert summary.converted == len(done)
