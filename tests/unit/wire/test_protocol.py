"""The wire format: round trips, strict validation, and fuzzing of every decoder."""

import dataclasses
import itertools
import re

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire import protocol as P
from wire.jobspec import JobSpec

SAMPLES = [
    P.Hello(stream=1, spec=JobSpec(batch_size=32, image_size=224, seed=3, world_size=4, shuffle=False, drop_last=True,
                                   train=False, dataset="demo"), epoch=2, rank=1, slots=8, job="resnet",
            batches=[5, 6], window=12),
    P.Hello(stream=2, spec=JobSpec(batch_size=8, image_size=64, scale=[0.25, 1.0], pipeline="multicrop",
                                   pipeline_args={"crops": 2})),
    P.Request(stream=3, batches=[2, 9], wait_s=1.5, h2d_s=0.25, consumed=9, final=True),
    P.Request(stream=3, batches=[10], released=[7, 8]),
    P.Hello(stream=3, spec=JobSpec(batch_size=8), batches=[0, 1], local=True),
    P.Release(stream=3, batches=[0, 4]),
    P.Bye(),
    P.Describe(dataset=None),
    P.Accept(stream=1, epoch=0, num_batches=10, num_samples=300, dataset_length=300, dataset="demo", service="x"),
    P.EndOfEpoch(stream=1, epoch=0, num_batches=10),
    P.Error(code=P.ErrorCode.BAD_JOB, message="nope", stream=4, fatal=False, traceback="tb"),
    P.DatasetInfo(dataset="demo", length=10, num_classes=2),
    P.DatasetInfo(dataset="demo", length=10, num_classes=2, probe="loader_service-1-probe-abc"),
    P.Ready(worker=1, pid=123),
    P.Task(task=1, dataset="d", shm="loader_service-1-x", offset=0, indices=[1, 2], seed=0, epoch=0,
           pipeline="train", pipeline_args={"size": 8, "scale": [0.08, 1.0], "ratio": [0.75, 1.33]}),
    P.Done(task=1, worker=2, ok=True, read_s=0.1, skipped=[[0, 5, "bad"]]),
    P.Stop(),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    got, data = P.decode(P.encode(msg))
    assert got == msg and data == []


def test_batch_round_trip_with_data_frames():
    msg = P.Batch(stream=1, epoch=0, index=3, indices=[4, 5], shape=[2, 2, 2, 3], padding=1, skipped=[[9, "x"]])
    images, labels = bytes(range(24)), bytes(16)
    got, data = P.decode(P.encode(msg, images, labels))
    assert got == msg and data == [images, labels]


@pytest.mark.parametrize("images, labels, match", [
    (bytes(23), bytes(16), "Batch frames are"),
    (bytes(24), bytes(8), "Batch frames are"),
])
def test_batch_frame_sizes_must_match_the_header(images, labels, match):
    msg = P.Batch(stream=1, epoch=0, index=0, indices=[4, 5], shape=[2, 2, 2, 3])
    with pytest.raises(P.ProtocolError, match=match):
        P.decode([P.encode_header(msg), images, labels])


def test_wrong_number_of_data_frames():
    with pytest.raises(P.ProtocolError, match="takes 0 data frames"):
        P.decode(P.encode(P.Bye()) + [b"extra"])


def header(**fields):
    return msgpack.packb({"v": P.PROTOCOL_VERSION, **fields})


@pytest.mark.parametrize("frame, code, match", [
    (b"", P.ErrorCode.BAD_MESSAGE, "not valid msgpack"),
    (b"\xc1", P.ErrorCode.BAD_MESSAGE, "not valid msgpack"),
    (msgpack.packb([1, 2]), P.ErrorCode.BAD_MESSAGE, "must be a msgpack map"),
    (msgpack.packb({"v": 99, "t": 1}), P.ErrorCode.BAD_VERSION, "version 99 not supported"),
    (msgpack.packb({"t": 1}), P.ErrorCode.BAD_VERSION, "version None"),
    (header(t=77), P.ErrorCode.BAD_MESSAGE, "unknown message type 77"),
    (header(t=True), P.ErrorCode.BAD_MESSAGE, "unknown message type True"),
    (header(t=1, stream=1), P.ErrorCode.BAD_MESSAGE, "missing field 'spec'"),
    (header(t=1, stream=1, spec={"image_size": 8}), P.ErrorCode.BAD_MESSAGE, "JobSpec is missing field 'batch_size'"),
    (header(t=1, stream=1, spec=[2, 8]), P.ErrorCode.BAD_MESSAGE, "spec must be a map"),
    (header(t=1, stream=1, spec={"batch_size": "2", "image_size": 8}), P.ErrorCode.BAD_MESSAGE, "batch_size must be int"),
    (header(t=1, stream=1, spec={"batch_size": True, "image_size": 8}), P.ErrorCode.BAD_MESSAGE, "batch_size must be int"),
    (header(t=1, stream=1, spec={"batch_size": 0, "image_size": 8}), P.ErrorCode.BAD_JOB, r"batch_size must be \[1"),
    (header(t=1, stream=1, spec={"batch_size": 2, "world_size": 2}, rank=2), P.ErrorCode.BAD_JOB, "rank"),
    (header(t=1, stream=1, spec={"batch_size": 2, "scale": [0.5]}), P.ErrorCode.BAD_JOB, "scale must be two"),
    (header(t=1, stream=1, spec={"batch_size": 2, "scale": [0.5, 2]}), P.ErrorCode.BAD_JOB, "scale max"),
    (header(t=1, stream=1, spec={"batch_size": 2}, evil=1), P.ErrorCode.BAD_MESSAGE, "no field"),
    (header(t=1, stream=1, spec={"batch_size": 2, "evil": 1}), P.ErrorCode.BAD_MESSAGE, "JobSpec has no field"),
    (header(t=2, stream=1, n=1), P.ErrorCode.BAD_MESSAGE, "unknown message type 2"),
    (header(t=1, stream=1, spec={"batch_size": 2}, on_demand=True), P.ErrorCode.BAD_MESSAGE, "no field"),
    (msgpack.packb({"v": 1, "t": 1, 5: 1}), P.ErrorCode.BAD_MESSAGE, "not valid msgpack"),
])
def test_malformed_headers_name_the_problem(frame, code, match):
    with pytest.raises(P.ProtocolError, match=match) as info:
        P.decode([frame])
    assert info.value.code == code


def test_expect_refuses_other_types():
    with pytest.raises(P.ProtocolError, match="unexpected message Stop"):
        P.decode(P.encode(P.Stop()), expect=(P.Hello,))


def test_oversized_header_refused_before_unpacking():
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.decode([b"\x00" * (P.MAX_HEADER_BYTES + 1)])


def test_every_message_type_is_listed():
    assert set(P.MESSAGES) == set(P.MsgType)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10) | st.binary(max_size=4), children, max_size=4),  # msgpack allows both
    max_leaves=12,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=st.sampled_from([int(x) for x in P.MsgType] + [0, 99]), fields=st.dictionaries(
    st.sampled_from(["stream", "batch_size", "image_size", "n", "indices", "shape", "scale", "ratio", "code",
                     "message", "task", "worker", "rank", "world_size", "epoch", "dataset", "spec", "x",
                     b"x", b"stream"]), json_like,  # a key as bytes beside keys as text: msgpack allows both
    max_size=8),
       extra=st.lists(st.binary(max_size=64), max_size=3))
def test_fuzzed_headers_raise_protocol_error_or_decode(t, fields, extra):
    frames = [msgpack.packb({"v": P.PROTOCOL_VERSION, "t": t, **fields}), *extra]
    try:
        msg, data = P.decode(frames)
    except P.ProtocolError:
        return
    # whatever decodes must re-encode to an equal message
    again, _ = P.decode(P.encode(msg, *data))
    assert again == msg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.dictionaries(st.sampled_from([*JobSpec.names(), "x"]), json_like, max_size=6),
       rank=st.integers(-1, 3))
def test_fuzzed_job_specs_raise_protocol_error_or_decode(spec, rank):
    try:
        msg, _ = P.decode([header(t=int(P.MsgType.HELLO), stream=1, rank=rank, spec=spec)])
    except P.ProtocolError:
        return
    assert isinstance(msg.spec, JobSpec) and 0 <= msg.rank < msg.spec.world_size
    again, _ = P.decode(P.encode(msg))
    assert again == msg


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=256), min_size=1, max_size=4))
def test_random_bytes_never_escape_as_other_exceptions(frames):
    try:
        P.decode(frames)
    except P.ProtocolError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_dropping_any_required_field_is_refused(msg, data):
    required = [f.name for f in dataclasses.fields(msg)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if not required:
        return
    name = data.draw(st.sampled_from(required))
    raw = msgpack.unpackb(P.encode(msg)[0])
    del raw[name]
    with pytest.raises(P.ProtocolError, match=f"missing field '{name}'"):
        P.decode([msgpack.packb(raw)] + [b""] * msg.DATA_FRAMES)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_floats_are_refused(bad):
    with pytest.raises(P.ProtocolError, match="finite float"):
        P.decode([header(t=int(P.MsgType.REQUEST), stream=1, batches=[1], wait_s=bad)])


# ------------------------------------------------------------------ an output in several frames
def test_an_output_larger_than_a_chunk_crosses_in_frames_of_that_size():
    chunk = P.ZERO_COPY_MIN_BYTES
    msg = P.Batch(stream=1, epoch=0, index=0, indices=[0, 1], shape=[2, 256, 256, 3], chunk=chunk)
    image = 2 * 256 * 256 * 3  # 393,216 bytes: 6 whole chunks
    assert P.frame_sizes(image, chunk) == [chunk] * 6 and msg.data_frames() == 7
    assert P.frame_sizes(image + 5, chunk) == [chunk] * 6 + [5]
    assert P.frame_sizes(chunk, chunk) == [chunk] and P.frame_sizes(10, 0) == [10]
    frames = [bytes(chunk)] * 6 + [bytes(16)]
    got, data = P.decode(P.encode(msg, *frames))
    assert got == msg and len(data) == 7
    with pytest.raises(P.ProtocolError, match="takes 7 data frames, got 2"):
        P.decode([P.encode_header(msg), bytes(image), bytes(16)])  # one frame where the header says six
    with pytest.raises(P.ProtocolError, match="Batch frames are"):
        P.decode([P.encode_header(msg), *[bytes(chunk)] * 5, bytes(chunk - 1), bytes(16)])


@pytest.mark.parametrize("chunk", [1, P.ZERO_COPY_MIN_BYTES - 1, P.MAX_CHUNK_BYTES + 1, -5])
def test_a_chunk_out_of_range_is_refused_before_any_frame_is_counted(chunk):
    """A hostile chunk of 1 byte on a huge shape would ask the receiver for billions of frames."""
    with pytest.raises(P.ProtocolError, match="Batch.chunk must be 0 or in"):
        P.decode([header(t=int(P.MsgType.BATCH), stream=1, epoch=0, index=0, indices=[0],
                         shape=[1, 1 << 20, 1 << 20, 3], chunk=chunk), b"", b""])


# ------------------------------------------------------------------ a lent batch (co-located)
def test_a_lent_batch_names_one_block_per_output_of_its_size_and_carries_the_labels_alone():
    msg = P.Batch(stream=1, epoch=0, index=0, indices=[3, 4], shape=[2, 2, 2, 3], local=["loader_service-9-x", [[96, 24]]])
    got, data = P.decode(P.encode(msg, bytes(16)))
    assert got == msg and data == [bytes(16)] and msg.data_frames() == 1


@pytest.mark.parametrize("local, match", [
    (["loader_service-9-x"], "must be \\[segment name"),
    ([5, [[0, 24]]], "must be \\[segment name"),
    (["../etc/passwd", [[0, 24]]], "must be \\[segment name"),
    (["s", [[0, 24], [24, 24]]], "for each of 1 outputs"),
    (["s", [[-1, 24]]], "for each of 1 outputs"),
    (["s", [[0, 2**60]]], "for each of 1 outputs"),
    (["s", [[True, 24]]], "for each of 1 outputs"),
    (["s", [[0.0, 24]]], "for each of 1 outputs"),
    (["s", [[0, 24, 0]]], "for each of 1 outputs"),
    (["s", [{"0": 24}]], "for each of 1 outputs"),
    (["s", [[2**48, 24]]], "for each of 1 outputs"),
    (["s", [[0, 23]]], "blocks are \\[23\\] bytes, the outputs \\[24\\]"),
])
def test_a_lent_batch_that_names_blocks_amiss_is_refused(local, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode([header(t=int(P.MsgType.BATCH), stream=1, epoch=0, index=0, indices=[3, 4], shape=[2, 2, 2, 3],
                         local=local), bytes(16)])


@pytest.mark.parametrize("fields, match", [
    (dict(lanes=P.MAX_LANES + 1), f"Batch.lanes must be \\[0, {P.MAX_LANES}\\], got {P.MAX_LANES + 1}"),
    (dict(lanes=-1), "Batch.lanes must be"),
    (dict(lane_set=1 << 32), "Batch.lane_set must be \\[0, 4294967295\\]"),
    (dict(lane_set=-1), "Batch.lane_set must be"),
    (dict(padding=-1), "Batch.padding must be \\[0, 2\\], got -1"),
])
def test_a_batch_s_lanes_and_padding_out_of_range_are_refused(fields, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode([header(t=int(P.MsgType.BATCH), stream=1, epoch=0, index=0, indices=[3, 4], shape=[2, 2, 2, 3],
                         **fields), bytes(36), bytes(16)])


@pytest.mark.parametrize("remembered", [False, True])
def test_a_decoded_message_is_the_constructor_s_with_defaults_of_its_own(remembered):
    """Decode builds a message without its generated __init__: the same fields, in the same order,
    each list default a fresh one (mutating one message's leaves the next's alone)."""
    P._layout(P.Batch).passed.clear()
    msg = P.Batch(stream=1, epoch=0, index=0, indices=[3, 4], shape=[2, 2, 2, 3])
    frames = P.encode(msg, bytes(24), bytes(16))
    if remembered:
        P.decode(frames)
    got, _ = P.decode(frames)
    assert got == msg and list(vars(got)) == list(vars(msg)) == [f.name for f in dataclasses.fields(P.Batch)]
    got.skipped.append([3, "x"])
    again, _ = P.decode(frames)
    assert again.skipped == [] and again.outputs == [] and again.local == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.index = 1
    err, _ = P.decode([header(t=int(P.MsgType.ERROR), code=P.ErrorCode.BAD_JOB,
                              message="m" * (P.MAX_ERROR_MESSAGE + 10))])
    assert len(err.message) <= P.MAX_ERROR_MESSAGE  # a class with a __post_init__ still runs it


@pytest.mark.parametrize("batches, code", [([1, 1], P.ErrorCode.BAD_JOB), ([-1], P.ErrorCode.BAD_JOB),
                                           (list(range(P.MAX_WINDOW + 1)), P.ErrorCode.BAD_RELEASE)])
@pytest.mark.parametrize("carrier", ["release", "request"])
def test_a_release_lists_each_batch_once_within_the_window(batches, code, carrier):
    """The same checks whether the batches come in a Release or taken along by a Request."""
    fields = dict(t=int(P.MsgType.RELEASE), batches=batches) if carrier == "release" else \
        dict(t=int(P.MsgType.REQUEST), batches=[2], released=batches)
    with pytest.raises(P.ProtocolError) as exc:
        P.decode([header(stream=1, **fields)])
    assert exc.value.code == code


# ------------------------------------------------------------------ the checks of a list of indices
@settings(max_examples=400, deadline=None)
@given(xs=st.lists(st.integers(-3, 2**64) | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=2)
                   | st.lists(st.integers(0, 3), max_size=2) | st.none(), max_size=6))
def test_a_list_of_indices_is_checked_as_item_by_item(xs):
    """The type-wise check of Batch.indices, Batch.shape and Request.batches refuses exactly what
    the item-by-item one did: anything but ints (bools included) and any int below 0."""
    assert P._non_negative_ints(xs) == all(P._is_int(x) and x >= 0 for x in xs)


@pytest.mark.parametrize("bad", [[0, True], [0, -1], [0, 1.0], [0, [1]], [None]])
def test_a_batch_whose_indices_are_not_non_negative_ints_is_refused(bad):
    with pytest.raises(P.ProtocolError, match="indices must be non-negative ints"):
        P.decode([header(t=int(P.MsgType.BATCH), stream=1, epoch=0, index=0, indices=bad,
                         shape=[len(bad), 1, 1, 3]), b"", b"\0" * 8 * len(bad)])


# ------------------------------------------------------------------ decoding by the fields' types alone
_VALID_BATCH = {"stream": 1, "epoch": 0, "index": 2, "indices": [3, 4], "shape": [2, 1, 1, 3], "padding": 1}


def _decoded(frame):
    """The message ``frame`` decodes to, or the error it is refused with."""
    try:
        return P.decode_header(frame)
    except P.ProtocolError as exc:
        return (exc.code, str(exc))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_header_decodes_alike_whether_or_not_a_header_of_its_fields_passed_before(data):
    """A header whose fields (in that order) once passed with the same types is built without the
    field-by-field check: whatever a header holds, it decodes to the same message, or is refused
    with the same error, as when nothing passed before."""
    fields = {k: data.draw(json_like | st.just(v), label=k) for k, v in _VALID_BATCH.items()}
    hostile = header(t=int(P.MsgType.BATCH), **fields)
    P._layout(P.Batch).passed.clear()
    cold = _decoded(hostile)
    assert _decoded(header(t=int(P.MsgType.BATCH), **_VALID_BATCH)) == P.Batch(**_VALID_BATCH)
    assert P._layout(P.Batch).passed  # the valid header's fields are remembered
    assert _decoded(hostile) == cold


def test_a_header_of_remembered_fields_is_still_checked_for_types_and_ranges():
    P._layout(P.Batch).passed.clear()
    P.decode_header(header(t=int(P.MsgType.BATCH), **_VALID_BATCH))
    with pytest.raises(P.ProtocolError, match="Batch.index must be int, got bool"):
        P.decode_header(header(t=int(P.MsgType.BATCH), **{**_VALID_BATCH, "index": True}))
    with pytest.raises(P.ProtocolError, match=r"Batch.padding must be \[0, 2\], got 3"):
        P.decode_header(header(t=int(P.MsgType.BATCH), **{**_VALID_BATCH, "padding": 3}))


def test_the_fields_remembered_per_message_type_are_bounded():
    """A peer that sends its fields in ever other orders costs a full check each time, and the
    memory of at most MAX_PASSED field lists."""
    P._layout(P.Batch).passed.clear()
    for order in itertools.islice(itertools.permutations(_VALID_BATCH), 3 * P.MAX_PASSED):
        assert P.decode_header(header(t=int(P.MsgType.BATCH), **{k: _VALID_BATCH[k] for k in order})) \
            == P.Batch(**_VALID_BATCH)
    assert len(P._layout(P.Batch).passed) == P.MAX_PASSED


@pytest.mark.parametrize("name", ["wait_s", "h2d_s"])
@pytest.mark.parametrize("value, ok", [(0.0, True), (P.MAX_STALL_S, True), (-0.5, False), (P.MAX_STALL_S + 1, False),
                                       (1e308, False)])
def test_a_stall_delta_is_refused_outside_a_day_so_the_services_sums_stay_finite(name, value, ok):
    frame = header(t=int(P.MsgType.REQUEST), stream=1, **{name: value})
    if ok:
        assert getattr(P.decode([frame])[0], name) == value
    else:
        with pytest.raises(P.ProtocolError, match=rf"^Request\.{name} is a delta since the connection's previous "
                                                  rf"message: it must be within 0-86400 s, got {re.escape(repr(value))}$"):
            P.decode([frame])
