"""The wire format: every message between client, service and workers is defined here.

A message is a list of ZeroMQ frames: frame 0 is a msgpack map (the header) holding the
protocol version ``v``, the message type ``t`` and the message's fields; any further frames
are raw data buffers (batch images, labels). No pickle crosses any socket.

``encode`` and ``decode`` are pure functions. ``decode`` trusts nothing: it checks the version,
the type, every field's presence and type, value ranges that the receiver relies on, and the
number and size of data frames, and raises :class:`ProtocolError` with a message a person can
act on. This module needs only msgpack and numpy, so the client imports it without the
service's dependencies.
"""

import math
import struct
from dataclasses import MISSING, dataclass, field, fields
from enum import IntEnum
from itertools import compress
from operator import methodcaller, ne
from typing import Any, ClassVar, Optional, Sequence, Union, get_args, get_origin, get_type_hints

import msgpack

from wire.errors import ErrorCode, ProtocolError, brief
from wire.jobspec import JobSpec, check_pipeline

# 2: on-demand streams, stall figures as deltas; 3: Hello carries the job as one JobSpec map;
# 4: augmentation draws from a counter-based hash (decode.transforms.SampleRandom): the same sample
# gives other bytes than under 3, so a client or replica of 3 is refused, never mixed in;
# 5: Hello.window, what a stream may have asked and not been sent (the service refuses more); a
# service of 4 would refuse the new field by its name, so the version says what is wrong instead;
# 6: one kind of stream: every batch is asked for by a Request (Credit, Hello.on_demand and
# Hello.start_batch removed; message type 2 stays unused); Hello.prefetch renamed slots (what it
# is); Batch.chunk (an output larger than FRAME_MAX_BYTES crosses the wire in several frames); the
# co-located mode: Hello.local, DatasetInfo.probe and Accept.probe, Batch.local, Release and Request.released
PROTOCOL_VERSION = 7
MAX_HEADER_BYTES = 1 << 20  # a header is small; anything bigger is refused before unpacking
MAX_CLIENT_MESSAGE_BYTES = 4 << 20  # socket-level cap on what a client may send the service
# how often a client sends ZMTP PINGs unless it says otherwise (Hello.heartbeat): the service cuts
# a connection that brings nothing for 3 of them (loader_service.dispatch.silence)
DEFAULT_HEARTBEAT_S = 2.0
MAX_HEARTBEAT_S = 3600.0
MAX_WINDOW = 1 << 14  # the most batches a stream may have asked and not yet been sent (Hello.window)
MAX_ERROR_MESSAGE = 2048  # characters of an Error's message (its traceback is the worker's own, kept whole)
ZERO_COPY_MIN_BYTES = 64 * 1024  # below this, zmq copying is cheaper than tracking a buffer
# The largest data frame the service sends: a larger output goes in frames of this size. libzmq
# receives every frame into a malloc of its own, and glibc maps an allocation above 32 MiB (its
# largest mmap threshold) afresh every time: a 38.5 MB frame (batch 256 at 224 px) cost the
# receiver 9,400 page faults, 25 ms of CPU per batch (docs/benchmarks.md section 17). Frames of
# 16 MiB stay below that threshold, so glibc reuses their memory.
FRAME_MAX_BYTES = 16 << 20
MAX_CHUNK_BYTES = 1 << 31  # a Batch.chunk beyond this is refused (no frame is that large)

Buffer = Union[bytes, bytearray, memoryview]


class MsgType(IntEnum):
    # client -> service
    HELLO = 1
    # 2 was CREDIT (protocol <= 5): never reused
    BYE = 3
    DESCRIBE = 4
    REQUEST = 5
    RELEASE = 6
    # service -> client
    ACCEPT = 10
    BATCH = 11
    END_OF_EPOCH = 12
    ERROR = 13
    DATASET_INFO = 14
    PROGRESS = 15
    # worker <-> dispatcher (inside the service)
    READY = 20
    TASK = 21
    DONE = 22
    STOP = 23
    UNMAP = 24


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[MsgType]
    DATA_FRAMES: ClassVar[int] = 0

    def check(self) -> None:
        """Range checks beyond types; raise ProtocolError."""

    def data_frames(self) -> int:
        return self.DATA_FRAMES


# --------------------------------------------------------------------------- client -> service
@dataclass(frozen=True)
class Hello(Message):
    """Start (or restart) a stream: one rank's pass over one epoch.

    A client sends a new Hello with a higher ``stream`` for every epoch and after every
    reconnect; the service drops whatever it still had for that client's older streams.

    The service computes exactly the batches asked for, ``batches`` now and more with each
    :class:`Request`, and sends them in the order asked, from ``slots`` batch slots it keeps
    for the stream (the RemoteLoader asks for as many as its ``prefetch``).
    """

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    stream: int
    spec: JobSpec  # what every rank of the job shares (see wire.jobspec)
    epoch: int = 0
    rank: int = 0
    origin: int = 0  # the plan begins at this position of the epoch's global order (an elastic resume)
    entry: int = 0  # the job's position where this rank's run of the epoch began (0, or a loaded state's)
    slots: int = 4
    job: str = ""
    batches: list = field(default_factory=list)
    lookahead: bool = False  # the next epoch, started early: served only when nothing else waits
    client: str = ""  # the loader instance (all its connections): one (job, rank) belongs to one client
    # the most batches the client may have asked of this stream and not yet received (0: MAX_WINDOW);
    # the service refuses a Request past it, so a stream's asks cost bounded memory in any state
    window: int = 0
    # co-located (the client reached DatasetInfo.probe): batches are handed over in the service's shared
    # memory (Batch.local) and handed back with Release, instead of crossing the socket
    local: bool = False
    # how often this client's socket sends ZMTP PINGs, seconds: the service cuts its connection when
    # nothing (not even a PING) came for 3 of them. Sent only when not the default, so a default Hello
    # is what a service without the field reads
    heartbeat: float = DEFAULT_HEARTBEAT_S

    def check(self) -> None:
        _range(self, "stream", 0)
        _range(self, "window", 0, MAX_WINDOW)
        if not 0 < self.heartbeat <= MAX_HEARTBEAT_S:
            raise ProtocolError(f"Hello.heartbeat must be in (0, {MAX_HEARTBEAT_S:g}] seconds, got {self.heartbeat}",
                                ErrorCode.BAD_JOB)
        self.spec.check()
        _check_batches(self.batches)
        _range(self, "epoch", 0, (1 << 31) - 1)
        _range(self, "rank", 0, self.spec.world_size - 1)
        _range(self, "origin", 0)
        _range(self, "entry", 0)
        _range(self, "slots", 1, 256)
        if len(self.job) > 256 or len(self.client) > 64:
            raise ProtocolError("job name longer than 256 characters, or client id longer than 64", ErrorCode.BAD_JOB)


@dataclass(frozen=True)
class Request(Message):
    """Ask a stream for ``batches`` (appended to what it computes and sends, in this order; may
    be empty to report stall figures or promote).

    ``wait_s``/``h2d_s`` are *deltas*: the seconds the trainer waited in next() / spent on
    host-to-device copies since this connection's previous message, so a service adds them up
    without keeping any baseline.
    """

    TYPE: ClassVar[MsgType] = MsgType.REQUEST
    stream: int
    batches: list = field(default_factory=list)
    wait_s: float = 0.0
    h2d_s: float = 0.0
    consumed: int = 0
    promote: bool = False
    final: bool = False  # nothing more will be asked: the stream ends once these are sent
    probe: bool = False  # the client has heard nothing for a while: answer with a Progress
    # co-located: batches of this stream handed back, as a Release of them just before this
    # Request would (one message instead of two when a batch is let go of and one asked for)
    released: list = field(default_factory=list)

    def check(self) -> None:
        _range(self, "stream", 0)
        _check_batches(self.batches)
        if len(self.batches) > 1 << 16:
            raise ProtocolError("Request.batches lists more than 65536 batches", ErrorCode.BAD_JOB)
        _range(self, "consumed", 0)
        _check_stall(self)
        if self.released:
            _check_released(self.released)


@dataclass(frozen=True)
class Release(Message):
    """A co-located client is done with ``batches`` of a ``local`` stream (copied out of the
    service's shared memory, or let go of by its trainer or its GPU copy): their slots are the
    service's again. A batch the stream did not hand over (never sent, already handed back) is
    refused (``bad_release``) and ends that stream."""

    TYPE: ClassVar[MsgType] = MsgType.RELEASE
    stream: int
    batches: list = field(default_factory=list)

    def check(self) -> None:
        _range(self, "stream", 0)
        _check_released(self.batches)


@dataclass(frozen=True)
class Bye(Message):
    """The client is leaving: free its stream now rather than at disconnect."""

    TYPE: ClassVar[MsgType] = MsgType.BYE


@dataclass(frozen=True)
class Describe(Message):
    """Ask for a dataset's size (``len(loader)`` needs it before the first epoch)."""

    TYPE: ClassVar[MsgType] = MsgType.DESCRIBE
    dataset: Optional[str] = None
    pipeline: str = ""  # also describe this pipeline's outputs for pipeline_args (DatasetInfo.outputs)
    pipeline_args: dict = field(default_factory=dict)

    def check(self) -> None:
        check_pipeline(type(self).__name__, self.pipeline, self.pipeline_args)


# --------------------------------------------------------------------------- service -> client
@dataclass(frozen=True)
class Accept(Message):
    TYPE: ClassVar[MsgType] = MsgType.ACCEPT
    stream: int
    epoch: int
    num_batches: int  # in this rank's epoch, counting from batch 0
    num_samples: int  # in this rank's epoch
    dataset_length: int
    dataset: str
    service: str = ""  # the service instance id (changes on restart)
    fingerprint: str = ""  # the dataset's identity beside its length (Source.fingerprint)
    decoding: str = ""  # how its samples become bytes: decode settings, pipeline code (output_identity)
    # the service's bulk-lane port (see "Bulk lanes" below): a client may open lanes there and
    # receive its batches' outputs on them; 0: the service has none
    lanes: int = 0
    # DatasetInfo.probe again, for a client that asked no Describe of this service (a replica that
    # joined its fleet mid-run) or whose service restarted elsewhere at the same endpoint
    probe: str = ""

    def check(self) -> None:
        _range(self, "lanes", 0, 65535)


@dataclass(frozen=True)
class Batch(Message):
    """One batch: frame 1 holds uint8 images (n, h, w, 3), frame 2 int64 labels (n,).

    With ``outputs`` (a named pipeline): ``[[name, per-sample shape], ...]``, ``shape`` is
    ``[n]``, and there is one uint8 frame per output, in that order, then the labels.
    """

    TYPE: ClassVar[MsgType] = MsgType.BATCH
    DATA_FRAMES: ClassVar[int] = 2
    stream: int
    epoch: int
    index: int  # batch index within the rank's epoch
    indices: list  # dataset index of each sample, in order
    shape: list  # [n, h, w, c]
    padding: int = 0  # trailing samples that repeat one to even out ranks (see plan.py)
    skipped: list = field(default_factory=list)  # [[dataset index, reason], ...]
    dtype: str = "uint8"
    outputs: list = field(default_factory=list)  # [[name, per-sample shape], ...]; empty: one image frame
    # > 0: each output goes in frames of this many bytes, its last frame the rest (frame_sizes);
    # 0: one frame per output
    chunk: int = 0
    # co-located: [segment name, [[offset, bytes], ...]], each output's block in the service's shared
    # memory (the client copies it out, then sends Release); the data frames are the labels alone
    local: list = field(default_factory=list)
    # > 0: the outputs' bytes come on this many bulk lanes (lane_stripe), not in data frames; the
    # data frames are the labels alone
    lanes: int = 0
    lane_set: int = 0  # the number of the lane set they come on (its lanes' hello): a client that has
    # another set now (the one it had failed) knows at once that these bytes will not come

    def check(self) -> None:
        if self.local:
            _check_local(self)
        if not (0 <= self.lanes <= MAX_LANES and 0 <= self.lane_set <= _MAX_LANE_SET):  # (one per batch: inline)
            _range(self, "lanes", 0, MAX_LANES)
            _range(self, "lane_set", 0, _MAX_LANE_SET)
        if self.lanes and self.local:
            raise ProtocolError("Batch.lanes and Batch.local exclude each other")
        if self.chunk and not ZERO_COPY_MIN_BYTES <= self.chunk <= MAX_CHUNK_BYTES:
            raise ProtocolError(f"Batch.chunk must be 0 or in [{ZERO_COPY_MIN_BYTES}, {MAX_CHUNK_BYTES}], "
                                f"got {self.chunk}")
        if self.dtype != "uint8":
            raise ProtocolError(f"unsupported dtype {brief(self.dtype)}")
        if self.outputs:
            _check_outputs(self.outputs)
            if len(self.shape) != 1 or not _is_int(self.shape[0]) or self.shape[0] < 0:
                raise ProtocolError(f"shape must be [n] when outputs are named, got {brief(self.shape)}")
        elif len(self.shape) != 4 or not _non_negative_ints(self.shape):
            raise ProtocolError(f"shape must be 4 non-negative ints, got {brief(self.shape)}")
        if not _non_negative_ints(self.indices):
            raise ProtocolError("indices must be non-negative ints")
        if self.shape[0] != len(self.indices):
            raise ProtocolError(f"shape[0]={self.shape[0]} but {len(self.indices)} indices")
        if not 0 <= self.padding <= len(self.indices):
            _range(self, "padding", 0, len(self.indices))

    def data_frames(self) -> int:
        """Frames after the header: each output's (several when chunked, none when handed over in place), then the labels'."""
        if self.local or self.lanes:
            return 1
        return sum(frame_count(n, self.chunk) for n in self.output_bytes()) + 1

    def output_shapes(self) -> list:
        """[(name, full shape of its frame), ...]; the unnamed single output is ``image``."""
        if not self.outputs:
            return [("image", tuple(self.shape))]
        return [(name, (self.shape[0], *shape)) for name, shape in self.outputs]

    def output_bytes(self) -> list:
        """Each output's bytes, in order (the unnamed single output: the whole shape's)."""
        if not self.outputs:
            return [math.prod(self.shape)]
        return [math.prod(s) for _, s in self.output_shapes()]

    @property
    def image_bytes(self) -> int:
        """All output frames together."""
        return sum(self.output_bytes())


@dataclass(frozen=True)
class EndOfEpoch(Message):
    TYPE: ClassVar[MsgType] = MsgType.END_OF_EPOCH
    stream: int
    epoch: int
    num_batches: int


@dataclass(frozen=True)
class Error(Message):
    """Something went wrong. ``stream`` is -1 when no stream is concerned.

    ``fatal`` errors end the stream; the client raises. ``traceback`` is the worker's
    formatted traceback when the error happened in a worker process.
    """

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: str
    message: str
    stream: int = -1
    fatal: bool = True
    traceback: str = ""

    def __post_init__(self) -> None:
        # a reply never grows with what it answers: a message quoting a hostile input is cut here
        if len(self.message) > MAX_ERROR_MESSAGE:
            keep = MAX_ERROR_MESSAGE - 40  # room for the note, so a cut message is not cut again
            object.__setattr__(self, "message", f"{self.message[:keep]}... ({len(self.message) - keep} characters cut)")


@dataclass(frozen=True)
class DatasetInfo(Message):
    TYPE: ClassVar[MsgType] = MsgType.DATASET_INFO
    dataset: str
    length: int
    num_classes: int
    fingerprint: str = ""  # the dataset's identity beside its length (Source.fingerprint)
    decoding: str = ""  # Accept.decoding for the pipeline asked (the built-in recipes when none)
    outputs: list = field(default_factory=list)  # the asked pipeline's [[name, per-sample shape], ...]
    # a shared-memory segment of the service holding its own name: a client that can read it shares
    # the service's /dev/shm (same host or a shared one) and may ask for Hello.local; "": none
    probe: str = ""

    def check(self) -> None:
        _check_outputs(self.outputs)


@dataclass(frozen=True)
class Progress(Message):
    """The answer to a probing :class:`Request`: what the service is doing for the stream, so a
    client that times out can say whether the service is slow, starved or out of workers."""

    TYPE: ClassVar[MsgType] = MsgType.PROGRESS
    stream: int
    workers: int  # live workers of the service
    busy: int  # of them, busy with any client's task
    tasks: int  # tasks of this stream running now
    waiting: int = 0  # batches of this stream asked for and not yet started
    no_slots: bool = False  # they wait for batch memory that other jobs' streams use
    batch: int = -1  # the batch of this stream's longest-running task (-1: none is running)
    task_s: float = 0.0  # how long that task has run
    sample: int = -1  # the dataset index its worker is on (-1: unknown)
    file: str = ""  # where that sample comes from (a path, a key)
    sample_s: float = 0.0  # how long the worker has been on it


# --------------------------------------------------------------------------- inside the service
@dataclass(frozen=True)
class Ready(Message):
    TYPE: ClassVar[MsgType] = MsgType.READY
    worker: int
    pid: int
    error: str = ""  # set when the worker could not start; it exits after sending this
    traceback: str = ""


@dataclass(frozen=True)
class Task(Message):
    """Decode ``indices`` of ``dataset`` into slot ``offset`` of shared segment ``shm``."""

    TYPE: ClassVar[MsgType] = MsgType.TASK
    task: int
    dataset: str
    shm: str
    offset: int
    indices: list
    seed: int  # with epoch and the sample's index: its random draws (see decode.transforms.sample_rng)
    epoch: int
    on_error: str = "raise"
    pipeline: str = ""  # its name, for errors
    target: str = ""  # MODULE:CALLABLE of its factory
    pipeline_args: dict = field(default_factory=dict)  # resolved: the built-in recipe's args come from the JobSpec
    capacity: int = 0  # samples per output block of the slot at ``offset``
    position: int = 0  # where in each block the first of ``indices`` goes


@dataclass(frozen=True)
class Done(Message):
    TYPE: ClassVar[MsgType] = MsgType.DONE
    task: int
    worker: int
    ok: bool
    read_s: float = 0.0
    decode_s: float = 0.0  # decoding and augmenting
    skipped: list = field(default_factory=list)  # [[position in task, dataset index, reason], ...]
    error: str = ""
    traceback: str = ""


@dataclass(frozen=True)
class Stop(Message):
    TYPE: ClassVar[MsgType] = MsgType.STOP


@dataclass(frozen=True)
class Unmap(Message):
    """Segment ``shm`` was unlinked: a worker that mapped it drops the mapping (it pins the memory)."""

    TYPE: ClassVar[MsgType] = MsgType.UNMAP
    shm: str


MESSAGES: dict = {cls.TYPE: cls for cls in Message.__subclasses__()}


# --------------------------------------------------------------------------- encode / decode
def encode(msg: Message, *data: Buffer) -> list:
    """Frames for ``msg``: the msgpack header, then ``data`` unchanged (never copied here)."""
    if len(data) != msg.data_frames():
        raise ValueError(f"{type(msg).__name__} takes {msg.data_frames()} data frames, got {len(data)}")
    return [encode_header(msg), *data]


def encode_header(msg: Message) -> bytes:
    """Frame 0 of ``msg`` alone (for senders that build data frames themselves). Fields left at
    their default are not written (the receiver fills them in), so a message that uses no newer
    field still decodes on a peer that predates it."""
    header = {"v": PROTOCOL_VERSION, "t": int(msg.TYPE), **_changed(msg)}
    # a str that is not UTF-8 (a file name with undecodable bytes, kept as surrogates) goes as its
    # escaped text ("\\udcff"), never as a failed send
    return msgpack.packb(header, use_bin_type=True, unicode_errors="backslashreplace")


def _changed(obj: Any) -> dict:
    """The fields of a message (or of a :class:`JobSpec` inside one) that differ from their defaults."""
    layout = _layout(type(obj))
    # a frozen dataclass keeps its fields in __dict__ (getattr on each: a fifth of a Request's
    # encode); each value compared with its default by map and compress, not by a comprehension
    # (a Request per batch: its ten fields cost the trainer as much as the rest of the encode).
    # A field without a default compares unequal to _NO_DEFAULT, so it is always written.
    values = list(map(obj.__dict__.__getitem__, layout.names))
    out = dict(compress(zip(layout.names, values), map(ne, values, layout.default_values)))
    for name in layout.nested:
        if isinstance(out.get(name), JobSpec):
            out[name] = _changed(out[name])
    return out


_NO_DEFAULT = object()
_new_object = object.__new__
_copy = methodcaller("copy")


class _Layout:
    """A message class's fields as encode and decode walk them, resolved once per class: a
    header is encoded or decoded once or twice per batch, and ``dataclasses.fields`` and
    ``get_origin`` on each took half of a Batch's decode."""

    __slots__ = ("cls", "names", "default_values", "types", "required", "required_set", "nested", "passed",
                 "template", "factories", "empties", "direct")

    def __init__(self, cls: type):
        hints = get_type_hints(cls)
        self.cls = cls
        # each field's name, and its default or _NO_DEFAULT: what encode leaves out when unchanged
        self.names = tuple(f.name for f in fields(cls))
        self.default_values = tuple(f.default if f.default is not MISSING
                                    else f.default_factory() if f.default_factory is not MISSING else _NO_DEFAULT
                                    for f in fields(cls))
        # what make() starts an instance's fields from, in their order (a required one is always
        # given), and the fields whose default is made afresh for each instance
        self.template = dict(zip(self.names, self.default_values))
        made = [f for f in fields(cls) if f.default_factory is not MISSING]
        self.factories = tuple(f.name for f in made)
        # the generated __init__ does nothing but set the fields unless the class has a __post_init__;
        # a default made by list or dict is a copy of an empty one (made without a Python call)
        self.direct = not hasattr(cls, "__post_init__") and all(f.default_factory in (list, dict) for f in made)
        self.empties = tuple(f.default_factory() for f in made)
        # name -> (type, whether None is allowed, the type a value of exactly which needs no
        # further check, or None): what decode checks, walking the header's own fields
        self.types = {}
        for f in fields(cls):
            hint, optional = _unwrap(hints[f.name])
            self.types[f.name] = (hint, optional, hint if hint in _PLAIN_TYPES else None)
        # the fields without a default, in their order (a missing one is named)
        self.required = tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
        self.required_set = frozenset(self.required)
        self.nested = tuple(f.name for f in fields(cls) if self.types[f.name][0] is JobSpec)  # encoded as maps
        # the field names (in a header's order) -> their types, of headers whose every value had
        # its field's plain type: see _build
        self.passed: dict = {}

    def make(self, kwargs: dict) -> Any:
        """An instance with the fields ``kwargs`` names (every required one, each of its field's
        type: checked) and the defaults for the rest; what ``cls(**kwargs)`` makes, without the
        generated ``__init__``'s call per field (a Batch's fifteen were a tenth of the trainer's
        work per batch)."""
        if not self.direct:
            return self.cls(**kwargs)
        msg = _new_object(self.cls)
        values = msg.__dict__
        values.update(self.template)  # the fields' order first, as __init__ sets them
        values.update(zip(self.factories, map(_copy, self.empties)))
        values.update(kwargs)
        return msg


# what msgpack decodes to exactly these types is checked by its type alone (a float also needs to be
# finite, and a JobSpec its fields: those take the full check)
_PLAIN_TYPES = (int, bool, str, list, dict)


def _unwrap(hint: Any) -> tuple:
    """(type, whether it is Optional)."""
    if get_origin(hint) is Union:  # Optional[X]
        return [a for a in get_args(hint) if a is not type(None)][0], True
    return hint, False


def _layout(cls: type) -> _Layout:
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = _Layout(cls)
    return layout


def decode(frames: Sequence[Any], expect: Optional[tuple] = None) -> tuple:
    """Parse ``frames`` into ``(message, data_frames)``; raise :class:`ProtocolError`.

    ``expect``: the message classes the receiver accepts here; others are refused.
    Data frames are returned as given (bytes or zmq.Frame), after their sizes are checked.
    """
    if not frames:
        raise ProtocolError("empty message")
    msg = decode_header(frames[0], expect)
    data = list(frames[1:])
    check_data_sizes(msg, [_nbytes(f) for f in data])
    return msg, data


def decode_header(frame: Any, expect: Optional[tuple] = None) -> Message:
    """Parse frame 0 alone (a receiver that reads data frames into its own buffers uses this,
    then :func:`check_data_sizes`)."""
    raw = _as_bytes(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    version = header.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {brief(version)} not supported (this side speaks {PROTOCOL_VERSION}); "
            "upgrade the older of client and service",
            ErrorCode.BAD_VERSION,
        )
    type_code = header.pop("t", None)
    cls = MESSAGES.get(type_code) if _is_int(type_code) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {brief(type_code)}")
    if expect is not None and cls not in expect:
        raise ProtocolError(f"unexpected message {cls.__name__} here")
    return _build(cls, header)


def check_data_sizes(msg: Message, sizes: Sequence[int]) -> None:
    """Check the number and byte sizes of ``msg``'s data frames."""
    if len(sizes) != msg.data_frames():
        raise ProtocolError(f"{type(msg).__name__} takes {msg.data_frames()} data frames, got {len(sizes)}")
    if isinstance(msg, Batch):  # the count matched, so these lists are as long as what came
        want = [] if msg.local or msg.lanes else [n for nbytes in msg.output_bytes() for n in frame_sizes(nbytes, msg.chunk)]
        want.append(8 * len(msg.indices))
        if list(sizes) != want:
            raise ProtocolError(f"Batch frames are {list(sizes)} bytes, header says {want}")


# --------------------------------------------------------------------------- bulk lanes
# A client that asks for them (RemoteLoader(lanes=N)) opens N plain TCP connections to the port its
# service names in Accept.lanes, and says on each, within LANE_HELLO_S, which ZeroMQ connection it
# belongs to (that connection's routing id: 16 random bytes the service already knows), which
# lane of how many it is, and the number of this set of lanes (random; a Batch names the set it
# was sent on, Batch.lane_set). From then on the service may send a batch's outputs on the lanes
# instead of in data frames (Batch.lanes): the outputs' bytes, one after another, split in one
# stripe per lane (lane_stripe), lane i carrying stripe i after a LANE_PIECE header. The client receives
# each stripe straight into the batch's buffer (recv_into): one copy fewer than a ZeroMQ frame,
# and several connections at once (docs/benchmarks.md section 17). Lanes carry no secret and are
# not encrypted: a service with CURVE keys has none.
MAX_LANES = 8
LANE_MAGIC = b"RLL1"
LANE_HELLO = struct.Struct("<4s16sBBI")  # magic, the ZeroMQ routing id, this lane, the lanes in all, the set's number
LANE_PIECE = struct.Struct("<4sQQQ")  # magic, stream, batch index, the batch's output bytes in all
LANE_HELLO_S = 5.0  # a lane that has not said who it is by then is closed


def lane_stripe(total: int, lane: int, lanes: int) -> tuple:
    """The ``[start, end)`` of ``total`` bytes that lane ``lane`` of ``lanes`` carries."""
    return total * lane // lanes, total * (lane + 1) // lanes


def lane_hello(identity: bytes, lane: int, lanes: int, lane_set: int) -> bytes:
    return LANE_HELLO.pack(LANE_MAGIC, identity, lane, lanes, lane_set)


def parse_lane_hello(data: bytes) -> tuple:
    """(routing id, lane, lanes, lane set) from a lane's first bytes; raise ProtocolError."""
    if len(data) != LANE_HELLO.size:
        raise ProtocolError(f"a lane hello is {LANE_HELLO.size} bytes, got {len(data)}")
    magic, identity, lane, lanes, lane_set = LANE_HELLO.unpack(data)
    if magic != LANE_MAGIC or not 1 <= lanes <= MAX_LANES or lane >= lanes:
        raise ProtocolError(f"not a lane hello (magic {brief(magic)}, lane {lane} of {lanes})")
    return identity, lane, lanes, lane_set


def lane_piece(stream: int, index: int, total: int) -> bytes:
    return LANE_PIECE.pack(LANE_MAGIC, stream, index, total)


def parse_lane_piece(data: Buffer) -> tuple:
    """(stream, batch index, the batch's output bytes) from a piece header; raise ProtocolError."""
    magic, stream, index, total = LANE_PIECE.unpack(data)
    if magic != LANE_MAGIC:
        raise ProtocolError(f"a lane piece starts with {brief(bytes(magic))}, not {LANE_MAGIC!r}")
    return stream, index, total


def frame_sizes(nbytes: int, chunk: int) -> list:
    """The frames an output of ``nbytes`` goes in: ``chunk`` bytes each, the last the rest
    (``chunk`` 0, or an output no larger: one frame)."""
    if chunk <= 0 or nbytes <= chunk:
        return [nbytes]
    full, rest = divmod(nbytes, chunk)
    return [chunk] * full + ([rest] if rest else [])


def frame_count(nbytes: int, chunk: int) -> int:
    """``len(frame_sizes(nbytes, chunk))`` without building the list (a hostile shape may be huge)."""
    return 1 if chunk <= 0 or nbytes <= chunk else -(-nbytes // chunk)


def _build(cls: type, header: dict) -> Any:
    """``cls`` (a message, or a :class:`JobSpec` inside one) from a decoded map, every field checked."""
    layout = _layout(cls)
    # A header whose fields, in this order, have exactly the types of one that passed the field
    # by field check below passes it too (that check looks at nothing but each value's type): the
    # common case, a Batch header per batch in the trainer's process, costs one lookup.
    if layout.passed.get(tuple(header)) == tuple(map(type, header.values())):
        kwargs = header
    else:
        kwargs = _checked_fields(cls, layout, header)
    msg = layout.make(kwargs)
    msg.check()
    return msg


MAX_PASSED = 64  # field lists remembered per class (a peer that varies its own costs a full check each time)


def _checked_fields(cls: type, layout: "_Layout", header: dict) -> dict:
    """``header``'s fields, each checked against its type; every required one present."""
    types = layout.types
    kwargs = {}
    plain_only = True
    for name, value in header.items():
        spec = types.get(name)
        if spec is None:
            # repr: msgpack's keys may be text and bytes in one map, which do not sort together
            raise ProtocolError(f"{cls.__name__} has no field(s) "
                                f"{brief(sorted(header.keys() - types.keys(), key=repr))}")
        hint, optional, plain = spec
        if type(value) is plain:  # msgpack's own int, list, ...: nothing more to check (a bool is no int here)
            kwargs[name] = value
        else:
            plain_only = False
            kwargs[name] = None if optional and value is None else _coerce(cls, name, hint, value)
    if not kwargs.keys() >= layout.required_set:
        missing = next(name for name in layout.required if name not in kwargs)
        raise ProtocolError(f"{cls.__name__} is missing field {missing!r}")
    if plain_only and len(layout.passed) < MAX_PASSED:
        layout.passed[tuple(header)] = tuple(map(type, header.values()))
    return kwargs


def _coerce(cls: type, name: str, hint: Any, value: Any) -> Any:
    """``value`` checked against ``hint`` (Optional already unwrapped)."""
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = _is_int(value)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    elif hint is list:
        ok = isinstance(value, list)
    elif hint is dict:
        ok = isinstance(value, dict)
    elif hint is JobSpec:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ProtocolError(f"{cls.__name__}.{name} must be a map of the job's fields, got {type(value).__name__}")
        return _build(JobSpec, value)
    else:  # pragma: no cover - a field type this module does not know is a programming error
        raise TypeError(f"unsupported field type {hint!r} for {cls.__name__}.{name}")
    if not ok:
        got = repr(value) if isinstance(value, float) else type(value).__name__
        raise ProtocolError(f"{cls.__name__}.{name} must be {'a finite ' if hint is float else ''}"
                            f"{getattr(hint, '__name__', hint)}, got {got}")
    return value


def _range(msg: Message, name: str, lo: int, hi: Optional[int] = None) -> None:
    v = getattr(msg, name)
    if v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ProtocolError(f"{type(msg).__name__}.{name} must be {bound}, got {v}", ErrorCode.BAD_JOB)


def _check_batches(batches: list) -> None:
    if not _non_negative_ints(batches):
        raise ProtocolError("batches must be non-negative ints", ErrorCode.BAD_JOB)
    if len(set(batches)) != len(batches):
        raise ProtocolError("batches lists a batch twice", ErrorCode.BAD_JOB)


def _check_released(batches: list) -> None:
    """Batches handed back (Release.batches, Request.released): at most a window's worth, each once."""
    if len(batches) > MAX_WINDOW:
        raise ProtocolError(f"a Release lists more than {MAX_WINDOW} batches", ErrorCode.BAD_RELEASE)
    _check_batches(batches)


MAX_STALL_S = 86400.0  # a delta of stall seconds above a day is no trainer's: the service's sums stay finite


def _check_stall(msg: Message) -> None:
    for name in ("wait_s", "h2d_s"):
        if not 0 <= getattr(msg, name) <= MAX_STALL_S:
            raise ProtocolError(f"{type(msg).__name__}.{name} is a delta since the connection's previous message: "
                                f"it must be within 0-{MAX_STALL_S:g} s, got {getattr(msg, name)!r}",
                                ErrorCode.BAD_MESSAGE)


def _check_local(msg: Batch) -> None:
    """Batch.local names a segment and one block per output, each of that output's size."""
    local = msg.local
    if (len(local) != 2 or not isinstance(local[0], str) or not 0 < len(local[0]) <= 255 or "/" in local[0]
            or not isinstance(local[1], list)):
        raise ProtocolError(f"Batch.local must be [segment name, [[offset, bytes], ...]], got {brief(local)}")
    sizes = msg.output_bytes()
    blocks = local[1]
    if len(blocks) != len(sizes) or not all(map(_is_block, blocks)):
        raise ProtocolError(f"Batch.local must list [offset, bytes] for each of {len(sizes)} outputs, got "
                            f"{brief(blocks)}")
    if [b[1] for b in blocks] != sizes:
        raise ProtocolError(f"Batch.local blocks are {[b[1] for b in blocks]} bytes, the outputs {sizes}")


_MAX_LANE_SET = (1 << 32) - 1
_MAX_OFFSET = 1 << 48  # of a block in a segment, and its size (far above any segment's)


def _is_block(b: Any) -> bool:
    """``[offset, bytes]``, two ints (no bools) in ``[0, 2**48)``."""
    if not isinstance(b, list) or len(b) != 2:
        return False
    offset, nbytes = b
    return _is_int(offset) and _is_int(nbytes) and 0 <= offset < _MAX_OFFSET and 0 <= nbytes < _MAX_OFFSET


def _check_outputs(outputs: list) -> None:
    for entry in outputs:
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or not isinstance(entry[1], list) or not entry[1]
                or not all(_is_int(d) and 1 <= d <= 1 << 16 for d in entry[1])):
            raise ProtocolError(f"outputs must be [[name, [positive ints]], ...], got {brief(entry)}")
    if len({e[0] for e in outputs}) != len(outputs):
        raise ProtocolError("outputs names an output twice")


def _is_int(x: Any) -> bool:
    return type(x) is int or (isinstance(x, int) and not isinstance(x, bool))  # (msgpack's ints: the first test)


def _non_negative_ints(xs: list) -> bool:
    """Every item an int (not a bool) >= 0; checked over the items' types, not item by item (a
    Batch lists one index per sample)."""
    types = set(map(type, xs))
    if types != _INT_ONLY and not all(issubclass(t, int) and not issubclass(t, bool) for t in types):
        return False
    return not xs or min(xs) >= 0


_INT_ONLY = {int}  # what msgpack decodes a list of ints to: no other type to look at


def _as_bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    buf = getattr(frame, "bytes", None)  # zmq.Frame
    return buf if isinstance(buf, bytes) else bytes(frame)


def _nbytes(frame: Any) -> int:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer without copying
    return memoryview(buf).nbytes


_LAYOUTS: dict = {}
