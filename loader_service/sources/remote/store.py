"""Object-store URLs, their listing and downloads, over obstore; every failure a
:class:`RemoteError` that names the object and the cause.

Credentials come from the environment the way obstore reads it (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_WEB_IDENTITY_TOKEN_FILE`` for pod
identity, the instance metadata service; ``GOOGLE_APPLICATION_CREDENTIALS`` for gs://). Nothing
here keeps, logs or returns them: :class:`RemoteSettings` and the source's spec hold none, and
each decode process builds its own store from its own environment.
"""

from __future__ import annotations

import hashlib
import html
import json
import logging
import os
import random
import re
import time
import urllib.parse
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

SCHEMES = ("s3://", "gs://", "http://", "https://")
MAX_LISTING_BYTES = 4 << 20  # an HTML folder listing larger than this is refused
_HREF = re.compile(r'href="([^"?#]+)"', re.IGNORECASE)
_MD5 = re.compile(r"[0-9a-f]{32}")
# an ETag made from the content: an MD5 (S3 single-part, MinIO, GCS), or S3's multipart "<md5>-<parts>"
_CONTENT_ETAG = re.compile(r"[0-9a-f]{32}(-\d+)?")
# obstore raises a GenericError for an S3 listing refused with 403: the status and code are in its text
_DENIED = re.compile(r"\b(401 Unauthorized|403 Forbidden)\b|<Code>(AccessDenied|InvalidAccessKeyId|ExpiredToken|"
                     r"InvalidToken|SignatureDoesNotMatch)</Code>")
# what a retry is worth: no answer, a dropped connection or body, a timeout, a 5xx or 429 (throttling)
_TRANSIENT = re.compile(r"error sending request|request or response body error|status code: (5\d\d|429)\b|"
                        r"SlowDown|timed out|(?<!retry_)[Tt]imeout|[Cc]onnection (reset|closed|refused|aborted)|Interrupted|"
                        r"[Bb]roken pipe|unexpected EOF|IncompleteMessage")
# the same in the detail's structured part (its text also says "retry_timeout", so not the words above)
_TRANSIENT_KIND = re.compile(r"kind: (?:Connect|Timeout|Interrupted)\b|ConnectionRefused|ConnectionReset|TimedOut")
_S3_CODE = re.compile(r"<Code>(\w+)</Code>")
_STATUS = re.compile(r"status code: (\d{3}(?: [A-Za-z][^:]*?)?)(?::|$)")
_NO_CREDENTIALS = re.compile(r"169\.254\.169\.254|169\.254\.170\.2|/latest/api/token|/latest/meta-data/iam|[Nn]o credentials|[Cc]redentials? (not found|"
                             r"missing)|metadata\.google\.internal|[Mm]issing (access key|secret)")
BACKOFF_S = (0.1, 5.0)  # the first retry's wait, doubled each retry up to the second (with jitter)
CHUNK = 1 << 20
log = logging.getLogger("loader_service.sources.remote")


class RemoteError(OSError):
    """An object store refused, failed or timed out; the message names the object and why."""


class TransientError(RemoteError):
    """A failure worth a retry (no answer, a dropped connection, a timeout, 5xx, throttling):
    :meth:`Store._retrying` retries it until ``--remote-retry-s`` has passed."""


def is_url(path: str) -> bool:
    return path.lower().startswith(SCHEMES)


@dataclass(frozen=True)
class RemoteSettings:
    """How remote datasets are reached and cached (no credentials: those stay in the environment)."""

    endpoint_url: str = ""  # an S3-compatible store's URL ("": AWS_ENDPOINT_URL, else AWS)
    cache_dir: str = ""  # "" : <LOADER_CACHE_DIR>/shards
    cache_max_bytes: int = 20 << 30
    timeout_s: float = 300.0  # one request, body included (a whole shard download)
    connect_timeout_s: float = 10.0
    retry_s: float = 120.0  # 5xx (503 SlowDown), 429, dropped connections, timeouts: retried with backoff this long
    max_retries: int = 1000  # and at most this many times per read
    wait_s: float = 600.0  # the longest a read waits for a download (its own or another process's) or for room
    prefetch_batches: int = 8  # per stream: the shards of this many batches ahead are downloaded early (0: off)
    decode_processes: int = 0  # the service's at start: a cap below 2 x them x the largest shard is refused (0: unchecked)

    def __post_init__(self) -> None:
        if self.cache_max_bytes <= 0 or self.timeout_s <= 0 or self.connect_timeout_s <= 0 or self.wait_s <= 0:
            raise ValueError("cache_max_bytes, timeout_s, connect_timeout_s and wait_s must be positive")
        if self.retry_s < 0:
            raise ValueError(f"retry_s (--remote-retry-s) must be >= 0, got {self.retry_s}")
        if self.max_retries < 0 or self.prefetch_batches < 0 or self.decode_processes < 0:
            raise ValueError(f"max_retries, prefetch_batches and decode_processes must be >= 0, got "
                             f"{self.max_retries}, {self.prefetch_batches}, {self.decode_processes}")

    def options(self) -> Tuple[Tuple[str, Any], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))

    @classmethod
    def from_options(cls, options: dict) -> "RemoteSettings":
        return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})

    def root(self) -> str:
        """The cache's folder: shards under ``shards/``, the indexes made from listings beside them."""
        if self.cache_dir:
            return self.cache_dir
        from loader_service.sources.demo import cache_dir

        return cache_dir()

    def shard_dir(self) -> str:
        return os.path.join(self.root(), "shards")

    def saved_index(self, folder: str, location: "Location", listing: dict) -> Tuple[str, str]:
        """Where the index made from ``listing`` (what was listed: names, sizes, ETags, as JSON
        values) is saved, ``<root>/<folder>/remote-<url>-<listing>``, and the listing's fingerprint."""
        fp = hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:24]
        return os.path.join(self.root(), folder, f"remote-{location.tag()}-{fp}"), fp

    def retries_file(self, location: "Location") -> str:
        """The counter of retries made for ``location`` by every process (int64, under ``flock``)."""
        return os.path.join(self.root(), "remote-stats", f"{location.tag()}.retries")

    def note_listing(self, folder: str, location: "Location", objects: Dict[str, Tuple[int, str]]) -> List[str]:
        """Compare ``objects`` (name -> (size, ETag), as listed now) with what the last start on
        this URL listed (kept in ``<root>/<folder>/remote-<url>.last-listing.json``), log the
        objects that changed, by URL, and keep this listing for the next start. Returns those lines."""
        path = os.path.join(self.root(), folder, f"remote-{location.tag()}.last-listing.json")
        try:
            with open(path) as f:
                before = {n: tuple(v) for n, v in json.load(f).items()}
        except (OSError, ValueError, AttributeError, TypeError):
            before = None
        lines = [] if before is None else listing_changes(location, before, objects)
        loose = sorted(n for n, (_, tag) in objects.items() if not _CONTENT_ETAG.fullmatch(etag_value(tag).lower()))
        if location.scheme in ("http", "https") and loose:
            tag = objects[loose[0]][1]
            log.warning("%s: the server's ETags are not made from the content (%s: %s; nginx and Apache make them "
                        "from the modification time and size, python -m http.server sends none): an object "
                        "rewritten at the same size (and modification time) is not seen as changed, neither as a "
                        "new dataset nor in the shard cache, which serves its old copy. Serve the dataset where "
                        "ETags are content hashes (S3, GCS, MinIO), or give a changed dataset a new URL",
                        location.where(), location.where(loose[0]), tag or "no ETag")
        if lines:
            more = f" (and {len(lines) - 5} more)" if len(lines) > 5 else ""
            log.warning("%s changed since the service last listed it: %s%s. It is a new dataset (a new fingerprint): "
                        "loaders whose epochs or saved states were planned on the old one are refused with "
                        "[dataset_changed]", location.where(), "; ".join(lines[:5]), more)
        if lines or before is None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump({n: list(v) for n, v in objects.items()}, f)
            os.replace(path + ".tmp", path)
        return lines


def listing_changes(location: "Location", before: Dict[str, Tuple[int, str]],
                    now: Dict[str, Tuple[int, str]]) -> List[str]:
    """One line per object added, removed or changed (size or ETag) between two listings, by URL."""
    lines = []
    for name in sorted(set(before) | set(now)):
        old, new = before.get(name), now.get(name)
        if old == new:
            continue
        where = location.where(name)
        if old is None:
            lines.append(f"{where} added")
        elif new is None:
            lines.append(f"{where} removed")
        else:
            lines.append(f"{where} changed (size {old[0]} -> {new[0]}, ETag {old[1]} -> {new[1]})")
    return lines


def etag_value(tag: str) -> str:
    """An ETag without its quotes and weak prefix: one store may list an object's ETag bare and
    send it quoted with a GET (fake-gcs-server does), or the other way round; the value is the
    same object."""
    tag = tag.strip()
    return (tag[2:] if tag.startswith("W/") else tag).strip('"')


def same_etag(a: str, b: str) -> bool:
    """Whether two ETags, as a listing and a GET wrote them, name the same version."""
    return etag_value(a) == etag_value(b)


@dataclass(frozen=True)
class ObjectInfo:
    """One object as the listing saw it: its name relative to the dataset's base, size, ETag."""

    name: str
    size: int
    etag: str = ""

    def md5(self) -> str:
        """The ETag when it is a plain MD5 of the content (S3 single-part, most HTTP servers), else ""."""
        tag = self.etag.strip('"').lower()
        return tag if _MD5.fullmatch(tag) else ""


def _import_obstore():
    try:
        import obstore
        from obstore import store
    except ImportError:
        raise RuntimeError('datasets in object storage need obstore: pip install "remote-loader[remote]"') from None
    return obstore, store


@dataclass(frozen=True)
class Location:
    """A dataset URL split into the store's base and what to read under it."""

    url: str
    scheme: str  # s3 | gs | http | https
    base: str  # s3://bucket, gs://bucket, https://host/dir/ (what the store is made from)
    prefix: str  # under base: the folder listed ("" or ending in "/"), or the pattern's folder
    names: Tuple[str, ...] = ()  # a pattern's or a single file's names (relative to prefix); () : list

    @classmethod
    def parse(cls, url: str) -> "Location":
        from loader_service.sources.webdataset import expand_braces, is_pattern

        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("s3", "gs", "http", "https") or not parts.netloc:
            raise ValueError(f"{url}: not a dataset URL (s3://bucket/prefix/, gs://bucket/prefix/, https://host/path/)")
        path = parts.path.lstrip("/")
        folder, _, last = path.rpartition("/")
        folder = folder + "/" if folder else ""
        if is_pattern(last):
            names = tuple(expand_braces(last))
        elif last.endswith(".tar"):
            names = (last,)
        elif last:  # a prefix without its trailing slash names a folder
            folder, names = path + "/", ()
        else:
            names = ()
        for n in names:
            if not n.endswith(".tar"):
                raise ValueError(f"{url}: {n} is not a .tar shard (compressed shards cannot be read by offset)")
        if scheme in ("s3", "gs"):
            return cls(url, scheme, f"{scheme}://{parts.netloc}", folder, names)
        return cls(url, scheme, f"{scheme}://{parts.netloc}/{folder}", "", names)

    def tag(self) -> str:
        """A short digest of the store and prefix: names in the cache folder made for this URL."""
        return hashlib.sha256(f"{self.base}\0{self.prefix}".encode()).hexdigest()[:16]

    def default_name(self) -> str:
        """The dataset's name when none is given: the last folder of the URL."""
        return os.path.basename(self.where().rstrip("/").split("://", 1)[1])

    def where(self, name: str = "") -> str:
        """The URL of ``name`` (for messages)."""
        return self.base.rstrip("/") + "/" + self.prefix + name if self.scheme in ("s3", "gs") else self.base + name

    def key(self, name: str) -> str:
        return self.prefix + name


class Store:
    """One process's connection to a dataset's store (build it where it is used: a decode process
    builds its own)."""

    def __init__(self, location: Location, settings: RemoteSettings):
        obstore, stores = _import_obstore()
        self.obstore, self.location, self.settings = obstore, location, settings
        client = {"timeout": timedelta(seconds=settings.timeout_s),
                  "connect_timeout": timedelta(seconds=settings.connect_timeout_s)}
        retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=settings.timeout_s)}  # ours: _retrying
        bucket = location.base.split("://", 1)[1]
        if location.scheme == "s3":
            endpoint = settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")
            extra = {"endpoint": endpoint} if endpoint else {}
            if endpoint.startswith("http://"):
                client["allow_http"] = True
            self.store = stores.S3Store(bucket, client_options=client, retry_config=retry, **extra)
        elif location.scheme == "gs":
            self.store = stores.GCSStore(bucket, client_options=client, retry_config=retry)
        else:
            client["allow_http"] = location.scheme == "http"
            # obstore appends "/" + the key to the base as given: a base ending in "/" would ask for
            # <folder>//<name>, which S3- and GCS-style HTTPS endpoints take as another key (404).
            # Objects are read from the folder without its slash, the listing from the folder with it
            # (without, a server answers for the folder's name, or redirects)
            self.store = stores.HTTPStore.from_url(location.base.rstrip("/"), client_options=client,
                                                   retry_config=retry)
            self._listing_store = stores.HTTPStore.from_url(location.base, client_options=client,
                                                            retry_config=retry)
        self._top_listing: Optional[Tuple[Dict[str, Optional[ObjectInfo]], List[str]]] = None

    def _fail(self, exc: BaseException, what: str, name: str = "") -> RemoteError:
        """A one-line error: the object's URL, what was done, the cause in words (no credentials
        found, bucket not found, access denied, not found, or the failure), the store's error code
        or HTTP status; the store's raw detail goes to the debug log only."""
        e = self.obstore.exceptions
        where = self.location.where(name)
        detail = " ".join(str(exc).split())
        log.debug("%s: %s: %s: %s", where, what, type(exc).__name__, detail)
        head = detail.split(" Debug source:")[0]
        code = _S3_CODE.search(detail)
        status = _STATUS.search(head)
        why = code.group(1) if code else f"HTTP {status.group(1)}" if status else ""
        kind = RemoteError
        if _NO_CREDENTIALS.search(head):
            cause = ("no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a web identity token "
                     "file or an instance role; for gs://, GOOGLE_APPLICATION_CREDENTIALS)")
        elif code and code.group(1) == "NoSuchBucket":
            cause = "bucket not found"
        elif isinstance(exc, (e.NotFoundError, FileNotFoundError)) or (status and status.group(1).startswith("404")):
            cause = "not found"  # obstore raises the builtin for an S3 GET's 404
        elif isinstance(exc, (e.PermissionDeniedError, e.UnauthenticatedError, PermissionError)) or _DENIED.search(detail):
            cause = f"access denied ({why + ': ' if why else ''}check the credentials and the bucket policy)"
        else:
            kind = TransientError if _TRANSIENT.search(head) or _TRANSIENT_KIND.search(detail) else RemoteError
            cause = "failed: " + (why or _short(head + " " + " ".join(_TRANSIENT_KIND.findall(detail)))
                                  or type(exc).__name__)
        return kind(f"{where}: {what} {cause}")

    def _retrying(self, op: Callable[[], Any]) -> Any:
        """``op()``, retried on a :class:`TransientError` with backoff (doubling, jittered) until
        ``retry_s`` has passed since the first failure or ``max_retries`` were made; each retry
        counted (:func:`read_retries`). The last error then says how long it was retried."""
        first, n = 0.0, 0
        while True:
            try:
                return op()
            except TransientError as exc:
                now = time.monotonic()
                first = first or now
                delay = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** n) * random.uniform(0.5, 1.0)
                if n >= self.settings.max_retries or now + delay - first > self.settings.retry_s:
                    raise RemoteError(f"{exc} (still failing after {n} retries over {now - first:.1f}s: "
                                      f"--remote-retry-s {self.settings.retry_s:g})") from None
                if n == 0:  # once per read: a wrong endpoint at start shows at once, not after the deadline
                    log.warning("%s; retrying for up to %gs (--remote-retry-s)", str(exc), self.settings.retry_s)
                n += 1
                _count_retry(self.settings.retries_file(self.location))
                time.sleep(delay)

    # ------------------------------------------------------------------ listing
    def kind(self) -> str:
        """What the URL holds: ``"packed"`` (a ``meta.json`` right under the prefix, as ``loader-service
        pack`` writes it), ``"webdataset"`` (a pattern, a ``.tar``, or ``.tar`` objects right under
        the prefix) or ``"imagefolder"`` (no ``.tar`` there, class folders of images below it); one
        listing of the prefix's first level decides (kept for the source that opens it)."""
        if self.location.names:
            return "webdataset"
        objs, folders = self._top()
        if "meta.json" in objs:
            return "packed"
        if any(n.endswith(".tar") and not n.startswith(".") for n in objs):
            return "webdataset"
        if any(not f.startswith(".") for f in folders):
            return "imagefolder"
        raise RemoteError(f"{self.location.url}: no .tar shards there, nor class folders of images "
                          "(<prefix>/<class>/<image>)")

    def _top(self) -> Tuple[Dict[str, Optional[ObjectInfo]], List[str]]:
        """The prefix's first level, once: its objects (name -> ObjectInfo; None where an HTML
        listing gives no size nor ETag) and its subfolders' names."""
        if self._top_listing is None:
            loc = self.location
            if loc.scheme in ("s3", "gs"):
                listing = self._retrying(lambda: self._call(
                    lambda: self.obstore.list_with_delimiter(self.store, loc.prefix or None), "listing"))
                objs: Dict[str, Optional[ObjectInfo]] = {
                    info.name: info for info in map(self._info, listing["objects"]) if info is not None}
                folders = [p[len(loc.prefix):].strip("/") for p in listing["common_prefixes"]
                           if p.startswith(loc.prefix)]
            else:
                names = self._html_listing()
                objs = {n: None for n in names if not n.endswith("/")}
                folders = [n.rstrip("/") for n in names if n.endswith("/")]
            self._top_listing = objs, folders
        return self._top_listing

    def _info(self, meta: dict) -> Optional[ObjectInfo]:
        """An S3 / GCS listing's entry as an ObjectInfo named relative to the prefix (None: outside it)."""
        path = meta["path"]
        if not path.startswith(self.location.prefix):
            return None
        return ObjectInfo(path[len(self.location.prefix):], int(meta["size"]), meta.get("e_tag") or "")

    def list_shards(self) -> Tuple[List[ObjectInfo], Optional[ObjectInfo]]:
        """The dataset's ``.tar`` shards (sorted by name) and its ``classes.json``, if any."""
        loc = self.location
        if loc.names:
            infos = [self.head(n) for n in loc.names]
            label_map = None
        else:
            objs = self._top()[0]
            names = [n for n in sorted(objs) if n.endswith(".tar") and not n.startswith(".")]
            infos = [objs[n] or self.head(n) for n in names]
            label_map = (objs["classes.json"] or self.head("classes.json")) if "classes.json" in objs else None
        if not infos:
            raise RemoteError(f"{loc.url}: no .tar shards there")
        for info in infos:
            if info.name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")):
                raise RemoteError(f"{loc.where(info.name)}: compressed shards cannot be read by offset")
        return infos, label_map

    def list_tree(self) -> List[ObjectInfo]:
        """Every object under the prefix, at any depth, named relative to it (S3 and GCS list
        sizes and ETags with the names: one request per 1,000 objects)."""
        if self.location.scheme not in ("s3", "gs"):
            raise RemoteError(f"{self.location.url}: a folder of loose images is read from s3:// or gs:// "
                              "(an HTML listing has no sizes nor ETags; pack the images into .tar shards)")
        return self._retrying(lambda: self._call(lambda: [
            info for batch in self.obstore.list(self.store, self.location.prefix or None, chunk_size=1000)
            for info in map(self._info, batch) if info is not None], "listing"))

    def _call(self, fn: Callable[[], Any], what: str, name: str = "") -> Any:
        """``fn()``, its failure a :class:`RemoteError` (or :class:`TransientError`) naming ``name``."""
        try:
            return fn()
        except RemoteError:
            raise
        except Exception as exc:
            raise self._fail(exc, what, name) from None

    def listed(self, name: str) -> ObjectInfo:
        """``name`` right under the prefix as the first-level listing saw it (a HEAD where an HTML
        listing gives no size nor ETag); a :class:`RemoteError` naming it when it is not there."""
        objs = self._top()[0]
        if name not in objs:
            raise RemoteError(f"{self.location.where(name)}: not found in the listing of {self.location.where()}")
        return objs[name] or self.head(name)

    def optional(self, name: str) -> Optional[ObjectInfo]:
        """``name`` right under a listed prefix (see :meth:`listed`), or None when it is not there
        (or the URL is a pattern or one shard: nothing is listed)."""
        if self.location.names or name not in self._top()[0]:
            return None
        return self.listed(name)

    def head(self, name: str) -> ObjectInfo:
        meta = self._retrying(lambda: self._call(lambda: self.obstore.head(self.store, self.location.key(name)),
                                                 "HEAD", name))
        return ObjectInfo(name, int(meta["size"]), meta.get("e_tag") or "")

    def _html_listing(self) -> List[str]:
        """The plain names linked from a folder's HTML listing (nginx autoindex, Apache, ``python -m
        http.server``), subfolders ending in ``/``, bounded in size."""
        def get() -> bytearray:
            data = bytearray()
            for chunk in self.obstore.get(self._listing_store, ""):
                data += chunk
                if len(data) > MAX_LISTING_BYTES:
                    raise RemoteError(f"{self.location.url}: the folder listing is over {MAX_LISTING_BYTES} bytes")
            return data

        data = self._retrying(lambda: self._call(get, "folder listing"))
        names = set()
        for href in _HREF.findall(data.decode("utf-8", "replace")):
            name = urllib.parse.unquote(html.unescape(href))
            if "/" not in name.rstrip("/") and name.rstrip("/") not in ("", ".", ".."):
                names.add(name)
        return sorted(names)

    # ------------------------------------------------------------------ reading
    def _checked(self, info: ObjectInfo, what: str) -> Iterator[memoryview]:
        """The object's bytes in chunks, checked: the size the listing saw, the same ETag, and the
        content's MD5 where the ETag is one. Raises :class:`RemoteError` naming it and the cause."""
        where = self.location.where(info.name)
        md5 = hashlib.md5() if info.md5() else None
        n = 0
        try:
            res = self.obstore.get(self.store, self.location.key(info.name))
            meta = res.meta
            if int(meta["size"]) != info.size or (info.etag and not same_etag(meta.get("e_tag") or "", info.etag)):
                raise RemoteError(f"{where}: changed since the dataset was listed (size {info.size} -> "
                                  f"{meta['size']}, ETag {info.etag} -> {meta.get('e_tag')}); restart the service "
                                  "to take the new version as a new dataset")
            for chunk in res.stream(min_chunk_size=CHUNK):
                view = memoryview(chunk)
                if n + len(view) > info.size:
                    raise RemoteError(f"{where}: the store sent more than the {info.size} bytes listed")
                if md5 is not None:
                    md5.update(view)
                n += len(view)
                yield view
        except RemoteError:
            raise
        except Exception as exc:
            raise self._fail(exc, f"{what} (after {n} of {info.size} bytes)", info.name) from None
        if n != info.size:
            raise TransientError(f"{where}: truncated {what}: {n} of {info.size} bytes")
        if md5 is not None and md5.hexdigest() != info.md5():
            raise RemoteError(f"{where}: checksum mismatch: MD5 {md5.hexdigest()}, ETag {info.etag}")

    def download(self, info: ObjectInfo, fd: int) -> None:
        """Write the object into ``fd`` from its start, checked (see :meth:`_checked`); a transient
        failure starts it again from byte 0 (see :meth:`_retrying`)."""
        def once() -> None:
            os.lseek(fd, 0, os.SEEK_SET)
            for view in self._checked(info, "download"):
                try:
                    while view:
                        view = view[os.write(fd, view):]
                except OSError as exc:
                    raise RemoteError(f"{self.location.where(info.name)}: writing the download failed: "
                                      f"{exc}") from None

        self._retrying(once)

    def read_object(self, info: ObjectInfo) -> bytes:
        """The object whole, checked (see :meth:`_checked`): the caller bounds ``info.size`` first."""
        return self._retrying(lambda: b"".join(bytes(view) for view in self._checked(info, "GET")))

    def read_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object, one ranged GET, checked: the response must be that
        object as listed (size, and ETag where it sends one; the ETag is also sent as ``If-Match``,
        so S3 and GCS refuse a changed object themselves) and exactly the span asked for."""
        return self._retrying(lambda: self._range(info, start, end))

    def _range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        where = self.location.where(info.name)
        if not 0 <= start < end <= info.size:
            raise RemoteError(f"{where}: range {start}-{end} is outside the {info.size} bytes listed")
        options: Dict[str, Any] = {"range": (start, end)}
        if info.etag:
            options["if_match"] = f'"{etag_value(info.etag)}"'  # If-Match takes the quoted form
        try:
            res = self.obstore.get(self.store, self.location.key(info.name), options=options)
            meta = res.meta
            etag = meta.get("e_tag")
            if int(meta["size"]) != info.size or (info.etag and etag and not same_etag(etag, info.etag)):
                raise RemoteError(f"{where}: changed since the dataset was listed (size {info.size} -> "
                                  f"{meta['size']}, ETag {info.etag} -> {meta.get('e_tag')}); restart the service "
                                  "to take the new version as a new dataset")
            # streamed, each chunk counted: a body longer than its span (whatever its Content-Length
            # claims) is refused after at most one chunk more, never read whole
            data = bytearray()
            for chunk in res.stream(min_chunk_size=min(CHUNK, end - start)):
                if len(data) + len(chunk) > end - start:
                    raise RemoteError(f"{where}: the store sent more than the {end - start} bytes of the range "
                                      f"{start}-{end} asked for")
                data += memoryview(chunk)
        except RemoteError:
            raise
        except Exception as exc:
            if isinstance(exc, self.obstore.exceptions.PreconditionError):
                raise RemoteError(f"{where}: changed since the dataset was listed (ETag {info.etag} no longer "
                                  "matches); restart the service to take the new version as a new dataset") from None
            raise self._fail(exc, f"range GET of bytes {start}-{end}", info.name) from None
        if len(data) != end - start or tuple(res.range) != (start, end):
            raise TransientError(f"{where}: truncated range GET: {len(data)} bytes (range {tuple(res.range)}) for "
                              f"bytes {start}-{end}")
        return bytes(data)

    def read_small(self, info: ObjectInfo, limit: int) -> bytes:
        """A small object whole (a label map, an index file), refused over ``limit`` bytes, checked
        as :meth:`read_object` (a body longer than listed is refused, not read)."""
        if info.size > limit:
            raise RemoteError(f"{self.location.where(info.name)}: {info.size} bytes, over the {limit} allowed")
        return self.read_object(info)


def _short(head: str) -> str:
    """A failure in words, from the store's message (without its detail)."""
    for pattern, words in (("error following redirect|TooManyRedirects", "too many redirects"),
                           ("ConnectionRefused|[Cc]onnection refused", "no answer (connection refused)"),
                           (r"timed out|TimedOut|kind: Timeout\b|operation timed", "timed out"),
                           ("body error|Interrupted|IncompleteMessage|unexpected EOF|reset", "the connection dropped"),
                           ("error sending request", "no answer")):
        if re.search(pattern, head):
            return words
    return ""


def _count_retry(path: str) -> None:
    """Add one to the retry counter at ``path`` (shared by every process: a read-modify-write under ``flock``)."""
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        n = int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\0"), "little")
        os.pwrite(fd, (n + 1).to_bytes(8, "little"), 0)
    finally:
        os.close(fd)


def read_retries(settings: RemoteSettings, location: Location) -> int:
    """Retries made for ``location``'s objects by every process since the cache folder was made."""
    try:
        with open(settings.retries_file(location), "rb") as f:
            return int.from_bytes(f.read(8).ljust(8, b"\0"), "little")
    except FileNotFoundError:
        return 0
