"""Prepare a JPEG dataset for fast crops: restart markers in tiles of a few MCUs, losslessly.

``loader-service prepare-jpegs SRC DST`` (or :func:`prepare_tree`) copies a dataset folder of any
layout to DST, rewriting each ``.jpg``/``.jpeg`` with the ``_jpegprep`` extension (built from
``_jpegprep.c`` against the system libjpeg-turbo, like the decode kernel): the same DCT
coefficients, so the same decoded pixels, written as sequential Huffman with a restart marker
every few ``mcus`` (8 by default, tiling each MCU row; or, with ``mcus=0``, every ``rows`` MCU
rows), optimized Huffman tables and every APPn/COM marker (EXIF, ICC) kept. The decode kernel
then decodes only the restart segments around a crop instead of Huffman-decoding every row
above it and every column beside it: the saving grows with the photo's size (camera photos).

Every other file is copied unchanged, so an ImageFolder or segmentation layout stays usable. A
JPEG that cannot be transcoded (corrupt, truncated, not really a JPEG, above the pixel limit) is
copied unchanged and reported; it never stops the run; so is a JPEG larger than
``max_sample_bytes`` (the service's limit for a loose file: it is never read whole). Each output
is written to a temporary name in its folder (``.NAME.XXXXXXXX.part``) and renamed into place; a
DST file newer than its source is skipped, so an interrupted run can be started again (a failed
JPEG's copy is stamped older than its source, so a rerun reports it again), and a rerun deletes
the temporary files a killed run left next to the files it prepares.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import shutil
import stat
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple, Union

try:
    from loader_service.decode import _jpegprep
except ImportError:  # not built (no libjpeg-turbo headers at install time)
    _jpegprep = None

from loader_service.decode.jpeg import DEFAULT_MAX_PIXELS
from loader_service.sources.files import DEFAULT_MAX_SAMPLE_BYTES

JPEG_EXTENSIONS = (".jpg", ".jpeg")
TMP_SUFFIX = ".part"
TMP_RANDOM = 8  # the length of tempfile.mkstemp's random part
COPY_CHUNK = 1 << 20

Progress = Callable[[int, int, int, int], None]  # (files done, files total, bytes in, bytes out)


@dataclass(frozen=True)
class Summary:
    """What :func:`prepare_tree` did. Bytes count the files written this run (not the skipped ones)."""

    converted: int  # JPEGs rewritten with restart markers
    copied: int  # other files, copied unchanged
    skipped: int  # DST already newer than SRC
    failed: Tuple[Tuple[str, str], ...] = field(default=())  # (relative path, reason; what became of the file)
    bytes_in: int = 0
    bytes_out: int = 0
    jpeg_bytes_in: int = 0  # the converted JPEGs alone: the size change of the transcode
    jpeg_bytes_out: int = 0
    stale_removed: int = 0  # temporary files of a killed earlier run, deleted

    @property
    def ok(self) -> bool:
        return not self.failed

    def format(self) -> str:
        lines = [f"{self.converted} JPEGs converted, {self.copied} other files copied, {self.skipped} up to date, "
                 f"{len(self.failed)} failed; {self.bytes_in / 1e6:.1f} MB in, {self.bytes_out / 1e6:.1f} MB out"]
        if self.stale_removed:
            lines.append(f"deleted {self.stale_removed} temporary file(s) left by an interrupted run")
        if self.jpeg_bytes_in:
            change = 100.0 * (self.jpeg_bytes_out - self.jpeg_bytes_in) / self.jpeg_bytes_in
            lines.append(f"converted JPEGs: {self.jpeg_bytes_in / 1e6:.1f} MB -> {self.jpeg_bytes_out / 1e6:.1f} MB "
                         f"({change:+.1f} %)")
        for rel, reason in self.failed:
            lines.append(f"failed: {rel}: {reason}")
        return "\n".join(lines)


def available() -> bool:
    return _jpegprep is not None


DEFAULT_MCUS = 8  # restart tiles of <= 8 MCUs (64-128 px): camera crops 8.9 vs 11.7 ms with whole rows


def add_restart_markers(data: bytes, rows: int = 1, max_pixels: int = DEFAULT_MAX_PIXELS, mcus: int = 0) -> bytes:
    """``data`` losslessly rewritten with a restart marker every ``rows`` MCU rows, or with
    ``mcus`` > 0 every d MCUs, d the largest divisor of the MCU row's count in [mcus/2, mcus]
    (whole rows when there is none), so that the intervals tile every row; see the module
    docstring. ``ValueError`` with libjpeg's reason when it cannot be."""
    return _native().add_restart_markers(data, rows, max_pixels, mcus)


def _native():
    if _jpegprep is None:
        raise RuntimeError("the JPEG preparation extension (_jpegprep) is not built: install libjpeg-turbo's "
                           "headers (Debian: libjpeg62-turbo-dev) and reinstall (pip install -e .)")
    return _jpegprep


def _check_dirs(src: str, dst: str) -> Tuple[str, str]:
    if not os.path.isdir(src):
        raise NotADirectoryError(f"{src} is not a folder")
    rsrc, rdst = os.path.realpath(src), os.path.realpath(dst)
    if os.path.commonpath([rsrc, rdst]) == rsrc:
        raise ValueError(f"the destination {dst} is {'the source' if rsrc == rdst else 'inside the source'} {src}; "
                         "give a folder outside it")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise NotADirectoryError(f"{dst} exists and is not a folder")
    return rsrc, rdst


def _walk(src: str) -> Tuple[List[str], List[Tuple[str, str]]]:
    """Every file under ``src`` (relative paths, sorted), following folder links but not into a
    folder that contains the link (a cycle); and the folders that could not be listed, with the
    reason (reported, not silently left out)."""
    out, errors, chains = [], [], {}

    def unreadable(exc: OSError) -> None:
        errors.append((os.path.relpath(exc.filename, src), f"{type(exc).__name__}: {exc.strerror}; folder not read"))

    for root, dirs, files in os.walk(src, onerror=unreadable, followlinks=True):
        st = os.stat(root)
        here, above = (st.st_dev, st.st_ino), chains.get(os.path.dirname(root), frozenset())
        if here in above:  # a link back to a folder above it
            dirs[:] = []
            continue
        chains[root] = above | {here}
        rel = os.path.relpath(root, src)
        out.extend(os.path.normpath(os.path.join(rel, f)) for f in files)
    return sorted(out), errors


def _is_jpeg(rel: str) -> bool:
    return rel.lower().endswith(JPEG_EXTENSIONS)


def _write_atomic(path: str, mode: int, write: Callable) -> int:
    """Write through ``write(file)`` into a temporary name next to ``path``, then rename it into place."""
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=TMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            n = f.tell()
        os.chmod(tmp, mode)  # mkstemp makes it 0600: keep the source's permissions
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return n


def _copy_unchanged(s: str, d: str, mode: int) -> int:
    with open(s, "rb") as fin:
        return _write_atomic(d, mode, lambda f: shutil.copyfileobj(fin, f, COPY_CHUNK))


def _one(src: str, dst: str, rows: int, mcus: int, max_pixels: int, max_bytes: int,
         rel: str) -> Tuple[str, str, int, int, str]:
    """Prepare one file; runs in a pool process. Returns (rel, kind, bytes in, bytes out, reason)
    with kind one of converted, copied, skipped, failed."""
    s, d = os.path.join(src, rel), os.path.join(dst, rel)
    try:
        st = os.stat(s)
        if not stat.S_ISREG(st.st_mode):
            return rel, "failed", 0, 0, "not a regular file; not copied"
        try:
            if os.stat(d).st_mtime_ns >= st.st_mtime_ns:
                return rel, "skipped", 0, 0, ""
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(d), exist_ok=True)
        mode = stat.S_IMODE(st.st_mode)
        if not _is_jpeg(rel):
            n = _copy_unchanged(s, d, mode)
            return rel, "copied", n, n, ""
        with open(s, "rb") as f:
            data = f.read(max_bytes + 1)  # the size on disk may have changed since stat
        if len(data) > max_bytes:
            del data
            n, reason = _copy_unchanged(s, d, mode), f"larger than {max_bytes} bytes (max_sample_bytes); copied unchanged"
        else:
            try:
                out = _jpegprep.add_restart_markers(data, rows, max_pixels, mcus)
                return rel, "converted", len(data), _write_atomic(d, mode, lambda f: f.write(out)), ""
            except ValueError as exc:
                n, reason = _write_atomic(d, mode, lambda f: f.write(data)), f"{exc}; copied unchanged"
        # stamped older than the source: a rerun tries (and reports) it again rather than
        # skipping it as up to date (2 s: FAT's timestamp resolution)
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns - 2_000_000_000))
        return rel, "failed", n, n, reason
    except OSError as exc:
        return rel, "failed", 0, 0, f"{type(exc).__name__}: {exc}; not copied"


def _remove_stale_parts(dst: str, files: List[str]) -> int:
    """Delete ``.NAME.XXXXXXXX.part`` files next to the DST paths of ``files``: what a killed run
    left (a finished or failed write removes its own). Only names this tool writes are touched."""
    wanted: dict = {}
    for rel in files:
        folder, name = os.path.split(rel)
        wanted.setdefault(folder, set()).add(name)
    removed = 0
    for folder, names in wanted.items():
        try:
            entries = os.scandir(os.path.join(dst, folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        with entries:
            for e in entries:
                n = e.name
                if (n.startswith(".") and n.endswith(TMP_SUFFIX) and len(n) > TMP_RANDOM + len(TMP_SUFFIX) + 2
                        and n[-len(TMP_SUFFIX) - TMP_RANDOM - 1] == "."
                        and n[1:-len(TMP_SUFFIX) - TMP_RANDOM - 1] in names and e.is_file(follow_symlinks=False)):
                    os.unlink(e.path)
                    removed += 1
    return removed


def print_progress(stream=None, every_s: float = 1.0) -> Progress:
    """A progress callback that prints ``done/total files, MB in -> MB out`` at most every ``every_s``."""
    last = [0.0]

    def report(done: int, total: int, bytes_in: int, bytes_out: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] >= every_s:
            last[0] = now
            print(f"prepare-jpegs: {done}/{total} files, {bytes_in / 1e6:.1f} MB in -> {bytes_out / 1e6:.1f} MB out",
                  file=stream or sys.stderr, flush=True)

    return report


def prepare_tree(src: str, dst: str, workers: Optional[int] = None, rows: int = 1,
                 progress: Union[bool, Progress, None] = True, max_pixels: int = DEFAULT_MAX_PIXELS,
                 mcus: int = DEFAULT_MCUS, max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> Summary:
    """Copy the folder ``src`` to ``dst`` (same relative paths), every JPEG rewritten with restart
    markers every few ``mcus``, or with ``mcus=0`` every ``rows`` MCU rows (see :func:`add_restart_markers`;
    lossless) and every other file unchanged; see the module docstring. ``workers`` processes (default: the CPU count); ``progress``: True prints to
    stderr, a callable gets (done, total, bytes in, bytes out). Raises before doing anything if
    ``dst`` is ``src`` or inside it, or the extension is not built."""
    _native()
    if rows < 1 or mcus < 0 or (mcus and rows != 1):
        raise ValueError(f"give rows >= 1 or mcus >= 1 (with rows 1), got rows={rows}, mcus={mcus}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if max_sample_bytes < 1:
        raise ValueError(f"max_sample_bytes must be >= 1, got {max_sample_bytes}")
    src, dst = _check_dirs(src, dst)
    report = print_progress() if progress is True else (progress or None)
    files, failed = _walk(src)
    os.makedirs(dst, exist_ok=True)
    stale = _remove_stale_parts(dst, files)
    counts = {"converted": 0, "copied": 0, "skipped": 0}
    b_in = b_out = j_in = j_out = 0
    workers = max(1, min(workers or os.cpu_count() or 1, len(files) or 1))
    # spawn, not fork: the caller may have threads (a service, a test runner)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        results = pool.map(functools.partial(_one, src, dst, rows, mcus, max_pixels, max_sample_bytes), files, chunksize=8)
        for done, (rel, kind, n_in, n_out, reason) in enumerate(results, 1):
            b_in, b_out = b_in + n_in, b_out + n_out
            if kind == "failed":
                failed.append((rel, reason))
            else:
                counts[kind] += 1
            if kind == "converted":
                j_in, j_out = j_in + n_in, j_out + n_out
            if report:
                report(done, len(files), b_in, b_out)
    return Summary(counts["converted"], counts["copied"], counts["skipped"], tuple(failed), b_in, b_out, j_in, j_out, stale)


def add_prepare_parser(sub) -> None:
    p = sub.add_parser("prepare-jpegs", help="copy a dataset folder, rewriting every JPEG losslessly with restart "
                       "markers in tiles of a few MCUs (faster crops of large photos); other files copied unchanged",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the dataset folder (any layout)")
    p.add_argument("dst", help="the output folder (created; not inside SRC); files already newer there are skipped")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="processes (default: the CPU count)")
    every = p.add_mutually_exclusive_group()
    every.add_argument("--mcus", type=int, default=None, metavar="N", help=f"a restart marker every N MCUs or a few "
                       f"less (a divisor of the MCU row, so the decode kernel skips the columns beside a crop as well "
                       f"as the rows above it; whole rows when the row has no divisor in [N/2, N]); default {DEFAULT_MCUS}")
    every.add_argument("--rows", type=int, default=None, metavar="R", help="instead: a restart marker every R MCU rows")
    p.add_argument("--max-sample-bytes", type=int, default=DEFAULT_MAX_SAMPLE_BYTES, metavar="N",
                   help="a JPEG larger than this is copied unchanged and reported, never read whole (the service's "
                   f"limit for a loose file; default {DEFAULT_MAX_SAMPLE_BYTES})")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run_prepare(args) -> int:
    """Exit code 0 when every file was prepared, 1 if any failed (the rest are done), 2 if nothing could start."""
    try:
        mcus = args.mcus if args.mcus is not None else (0 if args.rows else DEFAULT_MCUS)
        summary = prepare_tree(args.src, args.dst, workers=args.workers, rows=args.rows or 1, progress=not args.quiet,
                               mcus=mcus, max_sample_bytes=args.max_sample_bytes)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"loader-service prepare-jpegs: {exc}", file=sys.stderr)
        return 2
    print(summary.format())
    return 0 if summary.ok else 1
