"""Service configuration: one frozen model, validated on construction.

:class:`ServiceConfig` is a frozen pydantic dataclass: it is built as ``ServiceConfig(workers=2, ...)``
and read as ``config.workers``, and its fields, with their descriptions, are the single list of
options. :func:`load_config` fills it from, lowest first, the defaults, a config file (TOML, JSON or
YAML: ``--config`` or ``LOADER_CONFIG``), ``LOADER_<FIELD>`` environment variables (the
pydantic-settings sources) and command-line flags, which ``cli.py`` generates from the same
fields (``settings_cli.py``). A bad value is reported with the option and where it came from.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Annotated, Any, Dict, Mapping, Optional, Tuple

from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass

from loader_service.decode.jpeg import DEFAULT_MAX_PIXELS, DecodeOptions
from loader_service.sources.demo import DEFAULT_COUNT

ON_ERROR = ("raise", "skip")
START_METHODS = ("spawn", "forkserver", "fork")
LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "LOADER_"
CONFIG_ENV = "LOADER_CONFIG"  # the config file, when --config is not given
REDACTED = "***"


def opt(description: str, *, flag: Optional[str] = None, metavar: Optional[str] = None, choices=None,
        cli: bool = True, secret: bool = False) -> Any:
    """A field's description and how it shows on the command line: ``flag`` overrides the name
    derived from the field, ``cli=False`` keeps it off the command line (a secret on a command line
    is visible to every user of the machine), ``secret`` redacts it in ``loader-service config``."""
    return Field(description=description, json_schema_extra={
        "flag": flag, "metavar": metavar, "choices": list(choices) if choices else None, "cli": cli, "secret": secret})


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ServiceConfig:
    data: Annotated[Tuple[str, ...], opt(
        "dataset: an ImageFolder or packed folder, WebDataset .tar shard(s) (a file, a folder, or a pattern like "
        "shards-{000..009}.tar), an .h5 file, or a URL in object storage (s3://, gs://, https://: .tar shards, or "
        "s3:// / gs:// class folders of images); repeat the flag for several (in LOADER_DATA: separated by "
        f"{os.pathsep!r})", metavar="PATH")] = ()
    demo: Annotated[bool, opt("serve the embedded demo dataset when no --data is given")] = False
    demo_size: Annotated[int, opt("images in the demo dataset")] = DEFAULT_COUNT
    workers: Annotated[int, opt(
        "decode worker processes (-1: the CPUs this process may use, affinity and cgroup quota included)")] = -1
    max_workers: Annotated[int, opt("upper bound for --workers, PUT /v1/workers and the autoscaler")] = 256
    host: Annotated[str, opt("address to bind (0.0.0.0 in containers)")] = "127.0.0.1"
    data_port: Annotated[int, opt("ZeroMQ data port (0: any free port)")] = 5555
    http_port: Annotated[int, opt("REST port, also the status page at / (0: any free port)")] = 8080
    lane_port: Annotated[int, opt(
        "bulk-lane port: clients that ask (RemoteLoader(lanes=N)) receive batch bytes on N plain TCP connections "
        "here, beside the data port, at up to twice its throughput (docs/deployment.md); -1: no lanes, 0: any free "
        "port. Not encrypted: refused with --curve-keys")] = -1
    max_shm_mb: Annotated[int, opt("cap on batch slots in shared memory, all clients together (MiB)")] = 4096
    reclaim_idle_s: Annotated[float, opt(
        "a connected client's stream that has asked for nothing, with nothing in flight, for this long lends its "
        "batch slots to a job that needs them; it gets slots again with its next request")] = 10.0
    on_error: Annotated[str, opt("a sample that fails to decode: fail the client's epoch with the reason (raise) "
                                 "or deliver the batch without it (skip)", choices=ON_ERROR)] = "raise"
    heartbeat_s: Annotated[float, opt(
        "how often data-port connections are looked at for silence: one that has brought nothing (not even its "
        "client's ZMTP PINGs) for 3 of its client's heartbeats, and never less than 3 of these, is cut")] = 2.0
    max_sessions: Annotated[int, opt(
        "sessions (connections that said Hello) at once; a Hello past it is refused with no_capacity naming this "
        "cap (each session costs a few KB, and while it streams one shared-memory segment and its descriptor)")] = 8192
    client_allowance: Annotated[int, opt(
        "what one data-port connection may send beyond what it is served, in units of a message or 4 KiB of one "
        "(whichever is more): each batch sent to it earns 4 back, time --client-allowance-rate a second; past it "
        "the connection is cut and what its client sends for 30 s is dropped unread (a flood costs this much, "
        "not a growing queue; the project's client sends about two messages a batch)")] = 1024
    client_allowance_rate: Annotated[float, opt(
        "units a second each data-port connection's allowance earns back whatever it is sent (a stream's Hello "
        "and first Requests, a Describe)")] = 256.0
    max_stranded_per_address: Annotated[int, opt(
        "data-port connections from one address that libzmq never closed after they were cut (a peer that opened a "
        "second connection under the identity of one still sending); past it that address is refused new "
        "connections at the handshake until the service stops, as each keeps a descriptor till then (0: never "
        "refuse)")] = 32
    max_waiting: Annotated[int, opt(
        "new streams waiting at once for batch slots that ending or quiet streams hold; a Hello past it is refused "
        "with no_capacity naming this cap (the client retries)")] = 256
    stop_timeout_s: Annotated[float, opt("per stage of the worker stop ladder")] = 5.0
    drain_s: Annotated[float, opt("on stop, let tasks in flight finish and go out for up to this long")] = 2.0
    stop_deadline_s: Annotated[float, opt(
        "a stop (SIGTERM) ends within this long whatever still runs: past it, what did not stop is logged with its "
        "stack, the workers are killed, the shared memory is removed and the process exits 1 (keep it under the "
        "orchestrator's grace, with 5s to spare: compose's stop_grace_period here is 30s, Kubernetes' default "
        "30s)")] = 20.0
    task_deadline_s: Annotated[float, opt(
        "a task running longer has its worker killed and replaced, and is redone (0: derived from measured task "
        "times, at least --task-deadline-floor)")] = 0.0
    task_deadline_floor_s: Annotated[float, opt("the least a task gets when its deadline is derived")] = 10.0
    worker_start_s: Annotated[float, opt("a decode process that has not said it is ready within this many seconds "
                                         "(hung opening a dataset or importing a pipeline) is killed and counts "
                                         "as a failed start")] = 120.0
    worker_stop_s: Annotated[float, opt("a decode process told to stop (scaled down) that has not exited within "
                                        "this many seconds (a dataset whose close never returns) is killed")] = 10.0
    max_skipped: Annotated[int, opt("with --on-error skip: samples one stream may skip before it fails with the "
                                    "list (0: no cap)")] = 1000
    start_method: Annotated[str, opt("how worker processes start", choices=START_METHODS)] = "spawn"
    worker_nice: Annotated[int, opt(
        "decode processes run this much nicer (lower priority, 0-19) than the service's own process: when every "
        "core decodes, the dispatcher and a trainer on the same host still run the moment they have work, which "
        "keeps the decode processes fed (0: the same priority)")] = 10
    # 4: libzmq walks an I/O thread's whole timer list to cancel a heartbeat timeout, once per
    # pong, so the data port's heartbeat work grows as connections^2 / io_threads (issue 32)
    io_threads: Annotated[int, opt("ZeroMQ I/O threads of the data port")] = 4
    log_level: Annotated[str, opt("log level", choices=LOG_LEVELS)] = "info"
    autoscale: Annotated[str, opt("let the autoscaler set the worker count in this range (empty: off)",
                                  metavar="MIN:MAX")] = ""
    autoscale_interval_s: Annotated[float, opt("how often the autoscaler decides")] = 2.0
    status_log_s: Annotated[float, opt("log clients, img/s and workers this often while serving (0: never)")] = 30.0
    watch_s: Annotated[float, opt(
        "look this often for files added to or removed from an ImageFolder dataset since the service scanned it "
        "(one stat per folder): they are not served until a restart, and /v1/status and the log say so "
        "(0: never look)")] = 30.0
    max_sample_bytes: Annotated[int, opt("a loose image file (ImageFolder, local or in object storage) larger "
                                         "than this is refused through --on-error, with its path (an object: as "
                                         "listed, before it is fetched); only regular files are read")] = 64 << 20
    max_image_pixels: Annotated[int, opt("an image whose header claims more pixels (width x height) is refused "
                                         "before anything is decoded or allocated (a decode bomb)")] = DEFAULT_MAX_PIXELS
    jpeg_fast_dct: Annotated[bool, opt("libjpeg's fast integer IDCT: a few % faster, ~0.3 dB off")] = False
    jpeg_fast_upsample: Annotated[bool, opt("plain JPEG chroma upsampling instead of the smooth one")] = False
    max_http_connections: Annotated[int, opt("REST connections at once; more are answered 503 and closed at accept "
                                             "(the listen backlog is the same number)")] = 64
    http_receipt_s: Annotated[float, opt("a REST request must arrive whole (headers and body) within this, or its "
                                         "connection is closed (slowloris)")] = 10.0
    max_http_body_bytes: Annotated[int, opt("a larger REST body is answered 413 before it is read")] = 65536
    loop_answer_s: Annotated[float, opt("/healthz fails (503) and REST calls give up when the dispatcher loop has "
                                        "not answered within this (a stuck loop stalls every client)")] = 3.0
    curve_keys: Annotated[str, opt("encrypt the data port with CURVE and serve only clients whose key is in DIR "
                                   "(made by `loader-service keys DIR`)", metavar="DIR")] = ""
    api_token: Annotated[str, opt("guards mutating REST calls (empty: see --api-token-file; else one is generated "
                                  "and logged); environment or config file only", cli=False, secret=True)] = ""
    api_token_file: Annotated[str, opt("a file holding the API token", metavar="PATH")] = ""
    pipeline: Annotated[Tuple[str, ...], opt(
        "offer a preprocessing pipeline that clients choose by NAME: MODULE:CALLABLE is its factory, imported at "
        "start (the service refuses to start if it does not import); repeat the flag for several (in "
        "LOADER_PIPELINE: separated by commas); built in: train, eval", metavar="NAME=MODULE:CALLABLE")] = ()

    s3_endpoint_url: Annotated[str, opt(
        "an S3-compatible store's URL for s3:// datasets (MinIO, Ceph, R2...; empty: AWS_ENDPOINT_URL, else AWS); "
        "credentials come from the standard environment (AWS_ACCESS_KEY_ID..., pod or instance identity), never "
        "from here", metavar="URL")] = ""
    cache_dir: Annotated[str, opt(
        "the folder of the shard cache (shards/) and the indexes of datasets in object storage, shared by every "
        "decode process; put it on a volume to keep it across restarts (empty: ~/.cache/loader-service)",
        metavar="DIR")] = ""
    cache_max_gb: Annotated[float, opt(
        "cap on the shard cache (GB); least recently used shards not in use are evicted to stay under it; "
        "it must hold decode processes x 2 x the largest shard")] = 20.0
    remote_timeout_s: Annotated[float, opt(
        "one request to an object store, body included (a whole shard); see --remote-retry-s")] = 300.0
    remote_retry_s: Annotated[float, opt(
        "datasets in object storage: a request that fails transiently (no answer, a dropped connection, a "
        "timeout, 5xx, 429 throttling) is retried with backoff (0.1s doubling to 5s) for up to this many seconds, "
        "then the read fails naming the object (0: no retries); the default rides out a minute-long outage")] = 120.0
    shard_prefetch: Annotated[int, opt(
        "datasets in object storage: download ahead the shards of each stream's next N batches into the cache's "
        "free room (never evicting for it; 0: off)", metavar="N")] = 8

    @field_validator("data", mode="before")
    @classmethod
    def _split_paths(cls, v):
        # LOADER_DATA=/a:/b, as PATH is written; a list or tuple (config file, flags) passes as is
        return tuple(p for p in v.split(os.pathsep) if p) if isinstance(v, str) else v

    @field_validator("pipeline", mode="before")
    @classmethod
    def _split_pipelines(cls, v):
        # LOADER_PIPELINE=a=m:f,b=m:g (a ':' is part of each entry, so not PATH-style)
        return tuple(p.strip() for p in v.split(",") if p.strip()) if isinstance(v, str) else v

    def __post_init__(self) -> None:
        if self.workers == -1:
            object.__setattr__(self, "workers", available_cpus())
        if not self.data and not self.demo:
            raise ValueError("no dataset: give --data PATH (ImageFolder, packed, WebDataset shards or HDF5) "
                             "or --demo")
        if not 0 <= self.workers <= self.max_workers:
            raise ValueError(f"workers must be in [0, {self.max_workers}], got {self.workers}")
        for name in ("data_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if not -1 <= self.lane_port <= 65535:
            raise ValueError(f"lane_port must be -1 (no lanes) or in [0, 65535], got {self.lane_port}")
        if self.lane_port >= 0 and self.curve_keys:
            raise ValueError("bulk lanes (--lane-port) carry batches in the clear: they cannot be used with "
                             "--curve-keys; leave --lane-port at -1")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {self.start_method!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.autoscale:
            from loader_service.control.autoscale import AutoscalePolicy

            AutoscalePolicy.parse(self.autoscale, self.autoscale_interval_s)  # raises if malformed
        if (self.max_shm_mb < 1 or self.demo_size < 1 or self.heartbeat_s <= 0 or self.stop_timeout_s <= 0
                or self.stop_deadline_s <= 0):
            raise ValueError("max_shm_mb, demo_size, heartbeat_s, stop_timeout_s and stop_deadline_s must be positive")
        if self.reclaim_idle_s < 0:
            raise ValueError(f"reclaim_idle_s must be >= 0, got {self.reclaim_idle_s}")
        if self.worker_start_s <= 0 or self.worker_stop_s <= 0:
            raise ValueError(f"worker_start_s and worker_stop_s must be positive, got {self.worker_start_s} and "
                             f"{self.worker_stop_s}")
        if self.task_deadline_s < 0 or self.task_deadline_floor_s <= 0:
            raise ValueError("task_deadline_s must be >= 0 (0: derived from measured task times) and "
                             f"task_deadline_floor_s > 0, got {self.task_deadline_s} and {self.task_deadline_floor_s}")
        if (min(self.max_sample_bytes, self.max_http_connections, self.max_http_body_bytes) < 1
                or self.http_receipt_s <= 0 or self.loop_answer_s <= 0):
            raise ValueError("max_sample_bytes, max_http_connections, max_http_body_bytes, http_receipt_s and "
                             f"loop_answer_s must be positive, got {self.max_sample_bytes}, {self.max_http_connections}, "
                             f"{self.max_http_body_bytes}, {self.http_receipt_s} and {self.loop_answer_s}")
        if self.max_stranded_per_address < 0:
            raise ValueError(f"max_stranded_per_address must be >= 0, got {self.max_stranded_per_address}")
        if self.client_allowance < 1 or self.client_allowance_rate < 0:
            raise ValueError(f"client_allowance must be >= 1 and client_allowance_rate >= 0, got "
                             f"{self.client_allowance} and {self.client_allowance_rate}")
        if self.max_sessions < 1 or self.max_waiting < 0:
            raise ValueError(f"max_sessions must be >= 1 and max_waiting >= 0, got {self.max_sessions} and "
                             f"{self.max_waiting}")
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice must be in [0, 19], got {self.worker_nice}")
        if self.max_skipped < 0:
            raise ValueError(f"max_skipped must be >= 0 (0: no cap), got {self.max_skipped}")
        DecodeOptions(self.max_image_pixels)  # raises if the limit is out of range
        self.remote_settings  # raises if the cache cap or the timeout is out of range
        for entry in self.pipeline:
            name, sep, target = entry.partition("=")
            if not sep or not name.strip() or ":" not in target:
                raise ValueError(f"pipeline {entry!r}: expected NAME=MODULE:CALLABLE")
        if self.watch_s < 0:
            raise ValueError(f"watch_s must be >= 0 (0 turns the dataset watch off), got {self.watch_s}")
        if self.status_log_s < 0:
            raise ValueError(f"status_log_s must be >= 0 (0 turns the log line off), got {self.status_log_s}")

    def __repr__(self) -> str:  # the token stays out of logs and tracebacks
        shown = ", ".join(f"{k}={v!r}" for k, v in redacted(self).items())
        return f"ServiceConfig({shown})"

    @property
    def decode_options(self) -> DecodeOptions:
        return DecodeOptions(self.max_image_pixels, self.jpeg_fast_dct, self.jpeg_fast_upsample)

    @property
    def remote_settings(self):
        """How datasets in object storage are reached and cached (sources/remote)."""
        from loader_service.sources.remote.store import RemoteSettings

        return RemoteSettings(endpoint_url=self.s3_endpoint_url, cache_dir=self.cache_dir,
                              cache_max_bytes=round(self.cache_max_gb * 1e9), timeout_s=self.remote_timeout_s,
                              retry_s=self.remote_retry_s, prefetch_batches=self.shard_prefetch,
                              decode_processes=max(self.workers, 0))

    @property
    def max_shm_bytes(self) -> int:
        return self.max_shm_mb << 20

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides) -> "ServiceConfig":
        """Defaults, then ``LOADER_*`` variables, then ``overrides`` (those not None)."""
        return load_config(environ=environ, overrides=overrides).config


def option_fields() -> Dict[str, Any]:
    """Every option: field name -> pydantic FieldInfo (annotation, default, description, extras)."""
    return dict(ServiceConfig.__pydantic_fields__)


def option_extra(name: str) -> dict:
    info = ServiceConfig.__pydantic_fields__[name]
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return {"flag": None, "metavar": None, "choices": None, "cli": True, "secret": False, **extra}


class Loaded:
    """The effective configuration and, for every option, where its value came from."""

    def __init__(self, config: ServiceConfig, origin: Dict[str, str]):
        self.config, self.origin = config, origin



def redacted(config: ServiceConfig) -> Dict[str, Any]:
    """Field -> value, secrets replaced by ``***`` when set."""
    out = {}
    for f in fields(ServiceConfig):
        value = getattr(config, f.name)
        out[f.name] = REDACTED if option_extra(f.name)["secret"] and value else value
    return out


def load_config(environ: Optional[Mapping[str, str]] = None, config_file: Optional[str] = None,
                overrides: Optional[Mapping[str, Any]] = None,
                override_origin: Optional[Mapping[str, str]] = None) -> Loaded:
    """Defaults < config file < ``LOADER_*`` variables < ``overrides`` (those not None).

    ``config_file`` defaults to ``$LOADER_CONFIG``; ``override_origin`` names each override's
    source for error messages (the CLI passes ``--flag``). Raises ValueError naming the option,
    its value and its source."""
    env = os.environ if environ is None else environ
    values: Dict[str, Any] = {}
    origin: Dict[str, str] = {f.name: "default" for f in fields(ServiceConfig)}
    path = config_file or env.get(CONFIG_ENV) or None
    if path:
        for name, value in _file_values(path).items():
            values[name], origin[name] = value, f"config file {path}"
    for name, value in _env_values(env).items():
        values[name], origin[name] = value, f"environment {ENV_PREFIX}{name.upper()}"
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
            origin[name] = (override_origin or {}).get(name, "argument")
    try:
        return Loaded(ServiceConfig(**values), origin)
    except ValidationError as exc:
        raise ValueError(_explain(exc, values, origin)) from None


def _settings_class():
    """A pydantic-settings model with ServiceConfig's field names and no validation of its own
    (every field ``Any``): its sources only find raw values; ServiceConfig validates them once."""
    from pydantic import create_model
    from pydantic_settings import BaseSettings, SettingsConfigDict

    class Base(BaseSettings):
        model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="forbid")

    return create_model("LoaderSettings", __base__=Base, **{f.name: (Any, None) for f in fields(ServiceConfig)})


def _env_values(environ: Mapping[str, str]) -> Dict[str, Any]:
    from pydantic_settings import EnvSettingsSource
    from pydantic_settings.sources.utils import parse_env_vars

    class FromMapping(EnvSettingsSource):
        def _load_env_vars(self):  # the mapping given (tests, manifests), not os.environ
            return parse_env_vars(environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    return {k: v for k, v in FromMapping(_settings_class())().items() if v is not None}


def _file_values(path: str) -> Dict[str, Any]:
    from pydantic_settings import JsonConfigSettingsSource, TomlConfigSettingsSource, YamlConfigSettingsSource

    if not os.path.isfile(path):
        raise ValueError(f"config file {path}: not found")
    kind = os.path.splitext(path)[1].lower()
    cls = {".toml": TomlConfigSettingsSource, ".json": JsonConfigSettingsSource,
           ".yaml": YamlConfigSettingsSource, ".yml": YamlConfigSettingsSource}.get(kind)
    if cls is None:
        raise ValueError(f"config file {path}: use .toml, .json or .yaml")
    try:
        raw = cls(_settings_class(), path)()
    except Exception as exc:  # a syntax error: the parser's own message, with the file
        raise ValueError(f"config file {path}: {exc}") from None
    known = {f.name for f in fields(ServiceConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"config file {path}: unknown option(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    return raw


def _explain(exc: ValidationError, values: Mapping[str, Any], origin: Mapping[str, str]) -> str:
    lines = []
    for err in exc.errors():
        loc = [p for p in err.get("loc", ()) if isinstance(p, str)]
        msg = err["msg"].removeprefix("Value error, ")
        if loc and loc[0] in origin:
            name = loc[0]
            lines.append(f"{name}={values.get(name)!r} (from {origin[name]}): {msg}")
        else:  # a check across options (__post_init__): name the sources of those it mentions
            named = [n for n in origin if n in msg and origin[n] != "default"]
            where = "; ".join(f"{n} from {origin[n]}" for n in named)
            lines.append(msg + (f" ({where})" if where else ""))
    return "invalid configuration: " + "; ".join(lines)


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (the
    limit of a container or pod, which os.cpu_count() does not see)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)
