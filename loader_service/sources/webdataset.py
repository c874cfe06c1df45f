"""WebDataset tar shards: one ``.tar``, a folder of ``*.tar`` shards, or a brace pattern
such as ``/data/train-{000000..000146}.tar`` (``{a,b}`` lists work too).

Samples follow the WebDataset convention: consecutive members sharing a key (the member path
up to the first dot of its file name: ``cls/img_7.jpg`` and ``cls/img_7.cls`` are sample
``cls/img_7``) form one sample. A sample needs one image member (``.jpg``, ``.jpeg``, ``.png``,
or another of :data:`~loader_service.sources.base.IMAGE_EXTENSIONS`) and a label, which comes from, in this order:

1. a ``.cls`` (or ``.cls.txt``) member holding an integer as text;
2. the name of the folder the key lives in (``train/n01440764/x`` -> ``n01440764``), mapped to
   an integer by ``classes.json`` next to the shards (a JSON list of class names, index = label,
   or an object ``{"name": label}``; another file can be given as ``label_map``), or, without one,
   by the sorted set of folder names (as ImageFolder does).

A sample with neither is an error that names it. Members that are no part of a sample (names
without a dot) are ignored.

The index is built once, by reading only the tar headers (and the tiny ``.cls`` members), and
saved as ``.npy`` files: shard number, data offset, size and label of every sample, plus the
keys. It is found again on the next start by a fingerprint of the shards' paths, sizes and
mtimes, first next to the shards (``<root>/.wds-index/<fingerprint>/``, which ``loader-service
pack`` writes) then in the cache folder (``$LOADER_CACHE_DIR/wds-index/``, where a scan saves it),
so a restart reads no shard. Workers memory-map the same files (one copy in the page cache for
all of them) and read a sample with one ``os.pread`` at its offset: no tar parsing per read.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import uuid
from array import array
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from loader_service.sources.base import IMAGE_EXTENSIONS, Source, SourceSpec, register
from loader_service.sources.index import PackedStrings
from wire.plan import Blocks

log = logging.getLogger("loader_service.sources.webdataset")

INDEX_FORMAT = "loader-wds-index"
INDEX_VERSION = 1
LOCAL_INDEX_DIR = ".wds-index"
LABEL_MAP_NAME = "classes.json"
IMAGE_EXTS = tuple(e[1:] for e in IMAGE_EXTENSIONS)
CLS_EXTS = ("cls", "cls.txt")
MAX_OPEN_SHARDS = 64  # file descriptors a source keeps open (LRU)
BLOCK = 512
_META_KINDS = (b"x", b"X", b"g", b"L", b"K")  # headers that describe the next member
_ARRAYS = ("shard", "offset", "size", "labels", "keys_blob", "keys_offsets")


class ShardError(ValueError):
    """A shard is not a readable, complete, uncompressed tar archive."""


# ---------------------------------------------------------------------------- shard lists
def expand_braces(pattern: str) -> List[str]:
    """``a-{00..02}.tar`` -> ``[a-00.tar, a-01.tar, a-02.tar]``; ``{x,y}`` lists; several groups."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[: m.start()], pattern[m.end() :]
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if r:
        lo, hi = r.group(1), r.group(2)
        if int(hi) < int(lo):
            raise ValueError(f"bad brace range {{{body}}} in {pattern!r}: end < start")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        items = [str(k).zfill(width) for k in range(int(lo), int(hi) + 1)]
    elif "," in body:
        items = body.split(",")
    else:
        raise ValueError(f"bad brace group {{{body}}} in {pattern!r}: use {{000..009}} or {{a,b}}")
    return [p for item in items for p in expand_braces(head + item + tail)]


def is_pattern(path: str) -> bool:
    return "{" in path and "}" in path


def resolve_shards(path: str) -> List[str]:
    """The shard files ``path`` names (absolute, in order). Raises with a clear reason."""
    if is_pattern(path):
        shards = [os.path.abspath(p) for p in expand_braces(path)]
        missing = [p for p in shards if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{len(missing)} of the {len(shards)} shards of {path} are missing, "
                                    f"the first: {missing[0]}")
    elif os.path.isdir(path):
        shards = sorted(os.path.join(os.path.abspath(path), e.name) for e in os.scandir(path)
                        if e.name.endswith(".tar") and not e.name.startswith(".") and e.is_file())
        if not shards:
            raise ValueError(f"no .tar shards in {path}")
    elif os.path.isfile(path):
        shards = [os.path.abspath(path)]
    else:
        raise FileNotFoundError(f"dataset {path} does not exist")
    for p in shards:
        if p.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")):
            raise ShardError(f"{p}: compressed shards cannot be read by offset; repack them as plain .tar")
        if not os.access(p, os.R_OK):
            raise PermissionError(f"cannot read shard {p}: permission denied")
    return shards


# ---------------------------------------------------------------------------- tar scanning
def _octal(field: bytes, path: str, pos: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for large sizes
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ShardError(f"{path}: corrupt tar header at byte {pos} (bad number {field!r})") from None


def _signed_checksum(hdr: bytes) -> int:  # some old tars sum signed chars
    return sum(b - 256 if b > 127 else b for b in hdr[:148] + hdr[156:]) + 8 * 32


def _cstr(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "replace")


def _pax_records(data: bytes) -> Dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        if sp < 0:
            break
        try:
            length = int(data[pos:sp])
        except ValueError:
            break
        if length <= 0:
            break
        key, _, value = data[sp + 1 : pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        pos += length
    return out


def iter_members(path: str):
    """Yield ``(name, data_offset, size)`` for each regular file in the tar at ``path``.

    Reads only headers. Raises :class:`ShardError` for a bad checksum, a member that runs past
    the end of the file or a missing end-of-archive marker (a truncated copy), and compressed
    archives.
    """
    with open(path, "rb") as f:
        fsize = os.fstat(f.fileno()).st_size
        if fsize == 0:
            raise ShardError(f"{path}: empty file, not a tar shard")
        head = f.read(6)
        if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00":
            raise ShardError(f"{path}: compressed archive; shards must be plain (uncompressed) tar")
        pos, long_name, pax = 0, None, {}
        while True:
            if pos + BLOCK > fsize:
                raise ShardError(f"{path}: truncated (ends at byte {fsize} without the end-of-archive "
                                 "marker; an interrupted copy?)")
            f.seek(pos)
            hdr = f.read(BLOCK)
            if hdr == b"\0" * BLOCK:
                return
            stored = _octal(hdr[148:156], path, pos)
            if stored != sum(hdr[:148]) + 8 * 32 + sum(hdr[156:]) and stored != _signed_checksum(hdr):
                raise ShardError(f"{path}: corrupt tar header at byte {pos} (checksum mismatch); "
                                 "not a tar file, or damaged")
            size = _octal(hdr[124:136], path, pos)
            kind = hdr[156:157]
            data = pos + BLOCK
            if kind not in _META_KINDS and "size" in pax:  # a pax header's size is for the member after it
                try:
                    size = int(pax["size"])
                except ValueError:
                    raise ShardError(f"{path}: corrupt pax header before byte {pos} (size {pax['size']!r})") from None
            if data + size > fsize:
                raise ShardError(f"{path}: truncated (member at byte {pos} needs {size} bytes, "
                                 f"the file ends {fsize - data} bytes after its header)")
            nxt = data + -(-size // BLOCK) * BLOCK
            if kind == b"L":  # GNU long name for the next member
                f.seek(data)
                long_name = _cstr(f.read(size))
            elif kind in (b"x", b"X"):  # pax extended header for the next member
                f.seek(data)
                pax = _pax_records(f.read(size))
            elif kind == b"g":  # pax global header: nothing we use
                pass
            else:
                if kind in (b"0", b"\0", b"7"):
                    name = _cstr(hdr[0:100])
                    if hdr[257:262] == b"ustar" and hdr[345:346] != b"\0":
                        name = _cstr(hdr[345:500]) + "/" + name
                    name = pax.get("path") or long_name or name
                    yield name, data, size
                long_name, pax = None, {}
            pos = nxt


def split_key(name: str) -> Tuple[str, str]:
    """WebDataset's key/extension split: ``a/b/c.d.jpg`` -> (``a/b/c``, ``d.jpg``); ("", "") if none."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:  # no dot, or a hidden file (".foo")
        return "", ""
    return name[:dot], name[dot + 1 :]


def _scan_shard(path: str):
    """Samples of one shard: lists of keys, image offsets and sizes, and labels (-1: from the folder)."""
    keys: List[str] = []
    offsets, sizes, labels = array("q"), array("q"), array("q")
    fd = os.open(path, os.O_RDONLY)
    try:
        cur, image, label = None, None, -1

        def flush() -> None:
            if cur is None:
                return
            if image is None:
                raise ShardError(f"{path}: sample {cur!r} has no image member ({', '.join(IMAGE_EXTENSIONS)})")
            keys.append(cur)
            offsets.append(image[0])
            sizes.append(image[1])
            labels.append(label)

        for name, off, size in iter_members(path):
            key, ext = split_key(name)
            if not key:
                continue
            if key != cur:
                flush()
                cur, image, label = key, None, -1
            ext = ext.lower()
            if image is None and ext.rsplit(".", 1)[-1] in IMAGE_EXTS:
                image = (off, size)
            elif ext in CLS_EXTS:
                text = os.pread(fd, min(size, 64), off).decode("utf-8", "replace").strip()
                try:
                    label = int(text)
                except ValueError:
                    raise ShardError(f"{path}: sample {key!r}: .{ext} holds {text!r}, not an integer") from None
                if label < 0:
                    raise ShardError(f"{path}: sample {key!r}: negative label {label}")
        flush()
    finally:
        os.close(fd)
    return keys, offsets, sizes, labels


def _load_label_map(path: str):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the label map {path}: {exc}") from None
    if isinstance(data, list) and all(isinstance(x, str) for x in data):
        return list(data), {name: i for i, name in enumerate(data)}
    if isinstance(data, dict) and all(isinstance(v, int) and v >= 0 for v in data.values()):
        classes = [""] * (max(data.values()) + 1 if data else 0)
        for name, v in data.items():
            classes[v] = classes[v] or name
        return classes, dict(data)
    raise ValueError(f"{path}: a label map is a JSON list of class names or an object {{name: label}}")


def _class_folder(key: str) -> str:
    parts = key.split("/")
    return parts[-2] if len(parts) >= 2 else ""


# ---------------------------------------------------------------------------- the source
@register("webdataset")
class WebDatasetSource(Source):
    """Samples of tar shards, read with ``os.pread`` at offsets from a persistent index."""

    def __init__(self, root: str, index_dir: str, name: str = "", origin: str = "loaded"):
        self.root, self.index_dir = root, index_dir
        with open(os.path.join(index_dir, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("format") != INDEX_FORMAT or meta.get("version") != INDEX_VERSION:
            raise ValueError(f"{index_dir}: not a webdataset index of version {INDEX_VERSION}")
        self.meta = meta
        self.name = name or meta.get("name") or os.path.basename(root)
        self.classes: list = list(meta.get("classes", []))
        self.shards = [os.path.join(root, p) for p in meta["shards"]]  # one entry per shard, not per sample
        self.index_origin = origin  # "scanned" (built now) or "loaded" (found on disk)
        a = {k: np.load(os.path.join(index_dir, f"{k}.npy"), mmap_mode="r") for k in _ARRAYS}
        n = int(meta["length"])
        if not (len(a["shard"]) == len(a["offset"]) == len(a["size"]) == len(a["labels"]) == n
                and len(a["keys_offsets"]) == n + 1):
            raise ValueError(f"{index_dir}: webdataset index is inconsistent (damaged?)")
        self._shard, self._offset, self._size = a["shard"], a["offset"], a["size"]
        self.labels = a["labels"]
        self.keys = PackedStrings(a["keys_blob"], a["keys_offsets"])
        self._fds: "OrderedDict[int, int]" = OrderedDict()
        self._blocks: Optional[Blocks] = None

    # -------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str, name: str = "", label_map: Optional[str] = None,
             cache_dir: Optional[str] = None, write_local: bool = False) -> "WebDatasetSource":
        """Open shards, reusing a saved index whose fingerprint matches, else scanning them.

        ``write_local``: save a new index next to the shards instead of in the cache folder.
        """
        shards = resolve_shards(path)
        root = os.path.dirname(shards[0]) if len(shards) == 1 else os.path.commonpath(shards)
        if os.path.isfile(root):
            root = os.path.dirname(root)
        if label_map is None and os.path.isfile(os.path.join(root, LABEL_MAP_NAME)):
            label_map = os.path.join(root, LABEL_MAP_NAME)
        fp = _fingerprint(root, shards, label_map)
        local = os.path.join(root, LOCAL_INDEX_DIR, fp)
        cached = os.path.join(cache_dir or _cache_dir(), "wds-index",
                              hashlib.sha256(f"{root}\0{fp}".encode()).hexdigest()[:24])
        name = name or _default_name(path)
        for candidate in (local, cached):
            if os.path.isfile(os.path.join(candidate, "meta.json")):
                try:
                    src = cls(root, candidate, name, origin="loaded")
                except (OSError, ValueError, KeyError) as exc:
                    log.warning("ignoring a damaged index at %s (%s); scanning again", candidate, exc)
                    continue
                if src.meta.get("fingerprint") == fp:
                    return src
                src.close()
        index_dir = _build_index(root, shards, label_map, fp, [local, cached] if write_local else [cached, local])
        return cls(root, index_dir, name, origin="scanned")

    @classmethod
    def from_spec(cls, spec: SourceSpec) -> "WebDatasetSource":
        return cls(spec.path, spec.index, spec.name)

    def spec(self) -> SourceSpec:
        return SourceSpec(self.name, "webdataset", self.root, self.index_dir)

    def index_parts(self):
        return self.keys.blob, self.keys.offsets, self._size, self.labels

    def blocks(self) -> Blocks:
        """One block per shard (its samples are contiguous in the index), for a shuffle window."""
        if self._blocks is None:
            self._blocks = Blocks.of_labels(self._shard)
        return self._blocks

    # -------------------------------------------------------------- reading
    def __len__(self) -> int:
        return len(self._size)

    def read(self, i: int) -> bytes:
        s, off, size = int(self._shard[i]), int(self._offset[i]), int(self._size[i])
        fd = self._fd(s)
        data = os.pread(fd, size, off)
        while len(data) < size:  # pread may return less; at EOF it returns b""
            more = os.pread(fd, size - len(data), off + len(data))
            if not more:
                raise OSError(f"{self.describe(i)}: shard ends before the sample ({len(data)} of {size} "
                              "bytes); truncated since it was indexed?")
            data += more
        return data

    def _fd(self, s: int) -> int:
        fd = self._fds.get(s)
        if fd is not None:
            self._fds.move_to_end(s)
            return fd
        fd = self._fds[s] = os.open(self.shards[s], os.O_RDONLY)
        while len(self._fds) > MAX_OPEN_SHARDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def describe(self, i: int) -> str:
        return f"{self.shards[int(self._shard[i])]}:{self.keys[i]}"

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


# ---------------------------------------------------------------------------- index files
def _cache_dir() -> str:
    from loader_service.sources.demo import cache_dir

    return cache_dir()


def _default_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    if is_pattern(base):
        base = base[: base.index("{")].rstrip("-_.")
    elif base.endswith(".tar"):
        base = base[:-4]
    return base or os.path.basename(os.path.dirname(os.path.abspath(path)))


def _fingerprint(root: str, shards: List[str], label_map: Optional[str]) -> str:
    items = []
    for p in shards + ([label_map] if label_map else []):
        st = os.stat(p)
        items.append([os.path.relpath(p, root), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"v": INDEX_VERSION, "files": items, "map": bool(label_map)}).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def _build_index(root: str, shards: List[str], label_map: Optional[str], fp: str, targets: List[str],
                 scan=None) -> str:
    """Scan every shard (``scan(path)``: :func:`_scan_shard`, or one that fetches the shard first),
    resolve labels and save the index in the first writable target."""
    scan = scan or _scan_shard
    keys: List[str] = []
    shard_ids, offsets, sizes, labels = array("i"), array("q"), array("q"), array("q")
    for s, path in enumerate(shards):
        k, o, z, lab = scan(path)
        keys.extend(k)
        offsets.extend(o)
        sizes.extend(z)
        labels.extend(lab)
        shard_ids.extend(itertools.repeat(s, len(k)))
    if not keys:
        raise ValueError(f"no samples in {len(shards)} shard(s) under {root}: expected members like "
                         "key.jpg + key.cls")
    label_arr = np.frombuffer(labels, dtype=np.int64).copy()
    classes: list = []
    if label_map:
        classes, mapping = _load_label_map(label_map)
    missing = np.flatnonzero(label_arr < 0)
    if len(missing):
        folders = [_class_folder(keys[i]) for i in missing]
        if not label_map:
            classes = sorted({f for f in folders if f})
            mapping = {c: i for i, c in enumerate(classes)}
        for i, folder in zip(missing, folders):
            if folder not in mapping:
                where = f"its folder {folder!r} is not in {label_map}" if folder else "its key names no class folder"
                raise ValueError(f"{shards[shard_ids[i]]}: sample {keys[i]!r} has no label: no .cls member and "
                                 f"{where} (add .cls members, or a {LABEL_MAP_NAME} mapping folder names to labels)")
            label_arr[i] = mapping[folder]
    packed_keys = PackedStrings.from_strings(keys)
    arrays = {"shard": np.frombuffer(shard_ids, dtype=np.int32), "offset": np.frombuffer(offsets, dtype=np.int64),
              "size": np.frombuffer(sizes, dtype=np.int64), "labels": label_arr,
              "keys_blob": packed_keys.blob, "keys_offsets": packed_keys.offsets}
    meta = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "fingerprint": fp, "length": len(keys),
            "shards": [os.path.relpath(p, root) for p in shards], "classes": classes}
    errors = []
    for target in targets:
        try:
            return _write_index(target, arrays, meta)
        except OSError as exc:
            errors.append(f"{target}: {exc}")
    raise OSError("cannot save the webdataset index anywhere: " + "; ".join(errors))


def _write_index(target: str, arrays: Dict[str, np.ndarray], meta: dict) -> str:
    """Write atomically (temp folder + rename); a concurrent writer's equal index wins."""

    def fill(tmp: str) -> None:
        for k, arr in arrays.items():
            np.save(os.path.join(tmp, f"{k}.npy"), arr)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)

    return save_folder(target, fill)


def save_folder(target: str, fill: Callable[[str], None]) -> str:
    """Make the folder ``target`` atomically: ``fill(tmp)`` writes a temporary sibling, renamed
    into place; a concurrent writer's equal folder (one with its ``meta.json``) wins."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        fill(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "meta.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process saved the same index first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
