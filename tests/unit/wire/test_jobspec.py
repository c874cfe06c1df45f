"""JobSpec: the job's fields declared once, and what the wire, the job rules, the plan and the
loader's resume check take from it."""

import dataclasses

import pytest

from client.config import LoaderConfig
from wire import protocol as P
from wire.jobspec import JobSpec
from wire.plan import Blocks, PlanSpec


def test_the_order_fields_fix_the_global_order_and_the_shape_fields_only_shard_it():
    assert set(JobSpec.order_fields()) == {"seed", "shuffle", "drop_last", "dataset", "shuffle_window"}
    assert set(JobSpec.shape_fields()) == {"batch_size", "world_size"}
    assert set(JobSpec.order_fields() + JobSpec.shape_fields()) < set(JobSpec.names())


def test_plan_carries_every_order_field_and_the_rank_and_epoch():
    spec = JobSpec(batch_size=8, seed=3, world_size=4, shuffle=False, drop_last=True, dataset="d")
    assert spec.plan(100, epoch=2, rank=1) == PlanSpec(100, 8, 3, 2, 1, 4, False, True)
    assert spec.plan(100, epoch=2, rank=1, origin=40) == PlanSpec(100, 8, 3, 2, 1, 4, False, True, 40)


def test_plan_takes_the_blocks_only_for_a_shuffle_window():
    blocks = Blocks([0, 10, 20])
    windowed = JobSpec(batch_size=8, seed=3, shuffle_window=2)
    assert windowed.plan(30, 0, 0, blocks=blocks) == PlanSpec(30, 8, 3, window=2, blocks=Blocks([0, 10, 20]))
    # no window, or no shuffle: the blocks change nothing, so the plan (and the service's cache key) is W = 0's
    assert JobSpec(batch_size=8, seed=3).plan(30, 0, 0, blocks=blocks) == PlanSpec(30, 8, 3)
    unshuffled = JobSpec(batch_size=8, seed=3, shuffle=False, shuffle_window=2).plan(30, 0, 0, blocks=blocks)
    assert unshuffled == PlanSpec(30, 8, 3, shuffle=False)


def test_a_shuffle_window_travels_only_when_set_so_a_default_hello_is_unchanged_on_the_wire():
    """No PROTOCOL_VERSION change: W = 0 sends no new key (an older service reads the Hello as
    before); W > 0 sends one, which a service without the field refuses naming it (the unknown
    field rule of wire.protocol._build), never ignores."""
    import msgpack

    plain = msgpack.unpackb(P.encode(P.Hello(stream=1, spec=JobSpec(batch_size=8)))[0])
    assert "shuffle_window" not in plain["spec"]
    hello = P.Hello(stream=1, spec=JobSpec(batch_size=8, shuffle_window=16))
    assert msgpack.unpackb(P.encode(hello)[0])["spec"]["shuffle_window"] == 16
    assert P.decode(P.encode(hello))[0] == hello
    # a service of before this field: the same decoder over a JobSpec without it
    older = dataclasses.make_dataclass("JobSpec", [(f.name, f.type, f) for f in dataclasses.fields(JobSpec)
                                                   if f.name != "shuffle_window"], frozen=True,
                                        namespace={"__module__": "wire.jobspec"})
    older.check = lambda self: None
    assert P._build(older, plain["spec"]).batch_size == 8
    with pytest.raises(P.ProtocolError, match=r"JobSpec has no field\(s\) \['shuffle_window'\]"):
        P._build(older, msgpack.unpackb(P.encode(hello)[0])["spec"])


def test_differences_name_each_field_with_both_values():
    a = JobSpec(batch_size=8, seed=1, image_size=64)
    b = JobSpec(batch_size=8, seed=2, image_size=32, train=False)
    assert a.differences(b) == [("image_size", 64, 32), ("seed", 1, 2), ("train", True, False)]
    assert a.differences(a) == []


def test_on_resolves_the_dataset_and_makes_equal_numbers_compare_equal():
    ints = JobSpec(batch_size=8, scale=[1, 1], ratio=[1, 1])
    floats = JobSpec(batch_size=8, dataset="demo", scale=[1.0, 1.0], ratio=[1.0, 1.0])
    assert ints.on("demo").differences(floats.on("demo")) == []
    assert ints.on("demo").dataset == "demo" and ints.dataset is None


@pytest.mark.parametrize("changes, match", [
    (dict(batch_size=0), r"JobSpec.batch_size must be \[1"),
    (dict(image_size=7), r"JobSpec.image_size must be \[8"),
    (dict(seed=-1), r"JobSpec.seed must be \[0"),
    (dict(world_size=0), r"JobSpec.world_size must be \[1"),
    (dict(shuffle_window=-1), r"JobSpec.shuffle_window must be \[0"),
    (dict(scale=[0.5]), "scale must be two finite numbers"),
    (dict(ratio=[2.0, 1.0]), "ratio must satisfy 0 < min <= max"),
    (dict(scale=[0.5, 1.5]), "scale max must be <= 1"),
    (dict(pipeline="x" * 65), "at most 64 characters"),
    (dict(pipeline_args={"a": 1}), "pipeline_args given without a pipeline name"),
    (dict(pipeline="p", pipeline_args={1: 1}), "pipeline_args keys must be strings"),
])
def test_check_refuses_each_bad_value_as_a_bad_job_naming_it(changes, match):
    with pytest.raises(P.ProtocolError, match=match) as info:
        JobSpec(**{"batch_size": 4, **changes}).check()
    assert info.value.code == P.ErrorCode.BAD_JOB


def test_a_hello_sends_only_the_fields_that_differ_from_their_defaults():
    import msgpack

    hello = P.Hello(stream=1, spec=JobSpec(batch_size=8, seed=5))
    raw = msgpack.unpackb(P.encode(hello)[0])
    assert raw["spec"] == {"batch_size": 8, "seed": 5}
    assert P.decode(P.encode(hello))[0] == hello


def test_the_loader_config_splits_flat_settings_into_the_spec_and_its_own():
    c = LoaderConfig.of("tcp://127.0.0.1:9", batch_size=4, seed=7, dataset="d", scale=(0.5, 1.0), rank=1,
                        world_size=2, prefetch=3, pipeline=None, pipeline_args=None)
    assert c.spec == JobSpec(batch_size=4, seed=7, dataset="d", scale=[0.5, 1.0], world_size=2)
    assert (c.rank, c.prefetch) == (1, 3)
    assert not any(f.name in JobSpec.names() for f in dataclasses.fields(LoaderConfig) if f.name != "spec")


def test_the_loader_config_refuses_a_bad_job_setting_as_a_value_error_naming_it():
    with pytest.raises(ValueError, match="JobSpec.image_size"):
        LoaderConfig.of("tcp://127.0.0.1:9", batch_size=4, image_size=4)
    with pytest.raises(ValueError, match="pipeline_args must be a dict"):
        LoaderConfig.of("tcp://127.0.0.1:9", batch_size=4, pipeline="p", pipeline_args=[1])


@pytest.mark.parametrize("ratio", [[1e-9, 1e-9], [1e308, 1e308], [0.5, float("nan")], [1e-4, 1.0], [1.0, 1e4]])
def test_an_aspect_ratio_that_breaks_crops_is_refused_naming_ratio_not_a_file(ratio):
    with pytest.raises(P.ProtocolError, match="ratio must") as info:
        JobSpec(batch_size=4, ratio=ratio).check()
    assert info.value.code == P.ErrorCode.BAD_JOB


def test_pipeline_args_nested_too_deep_are_refused_without_recursing_into_them():
    deep: object = 1
    for _ in range(990):
        deep = [deep]
    with pytest.raises(P.ProtocolError, match="nest deeper than 8 levels"):
        JobSpec(batch_size=4, pipeline="p", pipeline_args={"a": deep}).check()
    ok: object = 1
    for _ in range(7):  # pipeline_args itself is the 8th level
        ok = [ok]
    JobSpec(batch_size=4, pipeline="p", pipeline_args={"a": ok}).check()


def test_large_pipeline_args_are_refused_and_the_refusal_does_not_echo_them():
    big = {"a": "x" * 900_000}
    with pytest.raises(P.ProtocolError, match="at most 65536") as info:
        JobSpec(batch_size=4, pipeline="p", pipeline_args=big).check()
    assert len(str(info.value)) < 200


def test_a_refusal_quotes_a_hostile_value_briefly():
    with pytest.raises(P.ProtocolError) as info:
        JobSpec(batch_size=4, scale=list(range(100_000))).check()
    assert "scale must be two finite numbers" in str(info.value) and len(str(info.value)) < 200


def test_an_error_reply_is_cut_to_a_bounded_length():
    err = P.Error(code=P.ErrorCode.BAD_JOB, message="y" * 100_000)
    assert len(err.message) <= P.MAX_ERROR_MESSAGE and err.message.endswith("characters cut)")
    assert P.decode(P.encode(err))[0] == err
