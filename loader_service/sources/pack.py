"""``loader-service pack SRC DST --format webdataset|hdf5|packed``: convert an ImageFolder.

Sample ``i`` of the output is sample ``i`` of the ImageFolder (same order, same bytes, same
label), so a job gives the same batches whichever format it reads.

* ``webdataset``: DST is a folder of ``shard-000000.tar`` ... (``--shard-size`` samples each;
  members ``<class>/<stem>.<ext>`` and ``<class>/<stem>.cls``), ``classes.json``, the local
  index (``.wds-index/``) so a service on the folder starts without scanning, and
  ``wds-index.json`` (:func:`~loader_service.sources.remote.webdataset.write_index_file`): upload
  it with the shards and ``classes.json``, and a first start on the bucket prefix GETs those two
  files and no shard.
* ``hdf5``: DST is one ``.h5`` file: ``images`` (variable-length uint8, ``--chunk`` samples
  per chunk), ``labels`` (int64), ``names``, and a ``classes`` attribute.
* ``packed``: DST is a packed folder (``sources/packed.py``).

The output is written under a temporary name next to DST and renamed into place only once
complete (and, with ``--verify``, checked): an error or Ctrl-C leaves nothing at DST.
``--verify`` reopens the output through the same Source interface the service uses and
compares every sample's bytes and label with the ImageFolder; the first mismatch is printed
and the exit status is 1. Exit status 2: bad arguments or input.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
import time
import uuid
from typing import Iterator, List, Optional, Tuple

FORMATS = ("webdataset", "hdf5", "packed")


def add_pack_parser(sub) -> None:
    p = sub.add_parser("pack", help="convert an ImageFolder to webdataset shards, HDF5 or packed",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="ImageFolder root: SRC/<class>/<image>.{jpg,jpeg,png}")
    p.add_argument("dst", help="output: a folder (webdataset, packed) or a .h5 file (hdf5)")
    p.add_argument("--format", choices=FORMATS, help="output format (default: hdf5 for a .h5/.hdf5 DST, "
                   "otherwise required)")
    p.add_argument("--shard-size", type=int, default=1000, metavar="N", help="webdataset: samples per shard (1000)")
    p.add_argument("--chunk", type=int, default=256, metavar="N", help="hdf5: samples per chunk (256)")
    p.add_argument("--verify", action="store_true", help="reopen the output and check every sample round-trips "
                   "byte-identical with its label; exit 1 at the first mismatch")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run_pack(args) -> int:
    try:
        fmt = _format(args)
        if args.shard_size < 1 or args.chunk < 1:
            raise ValueError("--shard-size and --chunk must be >= 1")
        if os.path.lexists(args.dst) and not args.overwrite:
            raise FileExistsError(f"{args.dst} exists; give --overwrite to replace it")
        from loader_service.sources.imagefolder import ImageFolderSource

        src = ImageFolderSource.scan(args.src)
    except (OSError, ValueError) as exc:
        print(f"loader-service pack: {exc}", file=sys.stderr)
        return 2
    try:
        return _pack(src, args, fmt)
    except (OSError, ValueError) as exc:
        print(f"loader-service pack: failed, nothing written to {args.dst}: {exc}", file=sys.stderr)
        return 2
    finally:
        src.close()


def _format(args) -> str:
    if args.format:
        if args.format == "hdf5" and not args.dst.lower().endswith((".h5", ".hdf5")):
            raise ValueError(f"an hdf5 DST must end in .h5 or .hdf5, got {args.dst}")
        return args.format
    if args.dst.lower().endswith((".h5", ".hdf5")):
        return "hdf5"
    raise ValueError("give --format webdataset|hdf5|packed")


def _pack(src, args, fmt: str) -> int:
    dst = os.path.abspath(args.dst)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    stem, ext = os.path.splitext(os.path.basename(dst)) if fmt == "hdf5" else (os.path.basename(dst), "")
    tmp = os.path.join(parent, f".{stem}.tmp-{uuid.uuid4().hex[:8]}{ext}")
    n, in_bytes = len(src), 0
    t0 = time.perf_counter()
    try:
        bar = _bar(n, f"pack {fmt}", args.quiet)
        try:
            def progress(nbytes: int) -> None:
                nonlocal in_bytes
                in_bytes += nbytes
                bar.update(1)

            if fmt == "webdataset":
                _write_webdataset(src, tmp, args.shard_size, progress)
            elif fmt == "hdf5":
                from loader_service.sources.hdf5 import write_hdf5

                write_hdf5(tmp, _counted(_samples(src), progress), n, src.classes, args.chunk)
            else:
                from loader_service.sources.packed import write_packed

                write_packed(tmp, _counted(_samples(src), progress), src.classes)
        finally:
            bar.close()
        seconds = time.perf_counter() - t0
        verify_line = ""
        if args.verify:
            t1 = time.perf_counter()
            problem = verify(src, tmp, quiet=args.quiet)
            if problem:
                _remove(tmp)
                print(f"loader-service pack: verify FAILED, nothing written to {args.dst}: {problem}", file=sys.stderr)
                return 1
            verify_line = (f"  verify:  ok, {n} samples byte-identical with equal labels "
                           f"({time.perf_counter() - t1:.2f} s)")
        _commit(tmp, dst, args.overwrite)
    except BaseException:
        _remove(tmp)
        raise
    outputs = _outputs(dst, fmt)
    out_bytes = sum(os.path.getsize(p) for p in outputs)
    rate = n / seconds if seconds > 0 else float("inf")
    print(f"packed {n} samples ({len(src.classes)} classes, {_mb(in_bytes)} of images) as {fmt} in "
          f"{seconds:.2f} s ({rate:.0f} samples/s)")
    print(f"  output:  {dst}  ({_describe_outputs(dst, outputs)}, {_mb(out_bytes)})")
    if verify_line:
        print(verify_line)
    return 0


def _samples(src) -> Iterator[Tuple[str, bytes, int]]:
    """``(name, bytes, label)`` of every sample in order: the one place the writers read from."""
    for i in range(len(src)):
        yield src.paths[i], src.read(i), int(src.labels[i])


def _counted(samples, progress):
    for name, blob, label in samples:
        yield name, blob, label
        progress(len(blob))


def _write_webdataset(src, out: str, shard_size: int, progress) -> List[str]:
    from loader_service.sources.remote.webdataset import write_index_file
    from loader_service.sources.webdataset import LABEL_MAP_NAME, WebDatasetSource

    os.makedirs(out)
    shards: List[str] = []
    tar: Optional[tarfile.TarFile] = None
    try:
        for i, (name, blob, label) in enumerate(_samples(src)):
            if i % shard_size == 0:
                if tar is not None:
                    tar.close()
                shards.append(os.path.join(out, f"shard-{len(shards):06d}.tar"))
                tar = tarfile.open(shards[-1], "w", format=tarfile.PAX_FORMAT)
            key, ext = _wds_key(name)
            assert tar is not None
            _add(tar, f"{key}.{ext}", blob)
            _add(tar, f"{key}.cls", str(label).encode())
            progress(len(blob))
    finally:
        if tar is not None:
            tar.close()
    with open(os.path.join(out, LABEL_MAP_NAME), "w") as f:
        json.dump(list(src.classes), f)
    write_index_file(out)  # wds-index.json, for the bucket the folder is copied to
    WebDatasetSource.open(out, write_local=True).close()  # the index, so no one scans again
    return shards


def _wds_key(name: str) -> Tuple[str, str]:
    """``cls/img.v2.JPG`` -> (``cls/img_v2``, ``jpg``): the key may not hold a dot in its file name."""
    folder, base = os.path.split(name.replace(os.sep, "/"))
    stem, ext = os.path.splitext(base)
    stem = stem.replace(".", "_")
    return (f"{folder}/{stem}" if folder else stem), ext[1:].lower()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0  # reproducible shards
    tar.addfile(info, io.BytesIO(data))


def verify(src, out: str, quiet: bool = True) -> str:
    """Reopen ``out`` through the Source interface; '' if every sample matches ``src``, else
    a description of the first mismatch."""
    from loader_service.sources.detect import open_path

    try:
        packed = open_path(out)
    except (OSError, ValueError) as exc:
        return f"cannot reopen the output: {exc}"
    try:
        if len(packed) != len(src):
            return f"the output has {len(packed)} samples, the source {len(src)}"
        bar = _bar(len(src), "verify", quiet)
        try:
            for i in range(len(src)):
                want, got = src.read(i), packed.read(i)
                if got != want:
                    diff = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    return (f"sample {i} ({src.describe(i)} vs {packed.describe(i)}): bytes differ "
                            f"(output {len(got)} bytes, source {len(want)} bytes, first difference at byte {diff})")
                if int(packed.labels[i]) != int(src.labels[i]):
                    return (f"sample {i} ({src.describe(i)}): label {int(packed.labels[i])} in the output, "
                            f"{int(src.labels[i])} in the source")
                bar.update(1)
        finally:
            bar.close()
    finally:
        packed.close()
    return ""


def _commit(tmp: str, dst: str, overwrite: bool) -> None:
    if os.path.lexists(dst):
        if not overwrite:
            raise FileExistsError(f"{dst} appeared while packing; not replacing it")
        old = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.old-{uuid.uuid4().hex[:8]}")
        os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except BaseException:
            os.rename(old, dst)
            raise
        _remove(old)
    else:
        os.rename(tmp, dst)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _outputs(dst: str, fmt: str) -> List[str]:
    if fmt == "hdf5":
        return [dst]
    out = []
    for dirpath, _, files in os.walk(dst):
        out.extend(os.path.join(dirpath, f) for f in sorted(files))
    return sorted(out)


def _describe_outputs(dst: str, outputs: List[str]) -> str:
    from loader_service.sources.remote.webdataset import INDEX_FILE

    shards = [os.path.basename(p) for p in outputs if p.endswith(".tar")]
    if shards:
        span = shards[0] if len(shards) == 1 else f"{shards[0]} .. {shards[-1]}"
        return f"{len(shards)} shard{'s' if len(shards) > 1 else ''}: {span} + index + {INDEX_FILE}"
    if len(outputs) == 1:
        return "1 file"
    return f"{len(outputs)} files"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _bar(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", disable=quiet, file=sys.stderr, leave=False, dynamic_ncols=True)
