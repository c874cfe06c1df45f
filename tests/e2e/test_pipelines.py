"""Pipelines chosen by the client: several named outputs per sample, the built-ins as pipelines,
and every way a pipeline can be wrong (a name, an argument, a module, an output, a raise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client import LoaderError, RemoteLoader
from wire import protocol as P
from loader_service.config import ServiceConfig, load_config
from loader_service.decode.pipelines import Item, Registry, run_one
from loader_service.service import Service
from loader_service.decode.transforms import sample_rng

from testkit import pipeline_doubles as D
from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of

DOUBLES = ("two=testkit.pipeline_doubles:two_views", "returns=testkit.pipeline_doubles:returns_arrays",
           "raises=testkit.pipeline_doubles:raises")


def expected_outputs(source, name: str, args: dict, seed: int, epoch: int, index: int) -> dict:
    """What the service must send for ``index``: the pipeline run here with the same generator."""
    pipe = Registry(DOUBLES).build(name, args)
    out = {k: np.zeros(s, np.uint8) for k, s in pipe.outputs.items()}
    run_one(name, pipe, Item(source.read(index), int(source.labels[index]), index,
                             sample_rng(seed, epoch, index)), out)
    return out


def test_multi_output_batches_carry_every_output_exactly(make_service, demo_source):
    svc = make_service(pipeline=DOUBLES)
    args = {"size": 24, "small": 6}
    with RemoteLoader(svc.endpoint, batch_size=16, seed=3, pipeline="two", pipeline_args=args,
                      epoch_lookahead=False) as ld:
        assert len(ld) == DEMO_SIZE // 16
        seen = []
        for batch in ld:
            n = len(batch)
            assert batch["big"].shape == (n, 2, 24, 24, 3) and batch["small"].shape == (n, 6, 6)
            assert batch["stamp"].dtype == torch.uint8 and batch["labels"] is batch.labels
            for j, idx in enumerate(batch.indices):
                want = expected_outputs(demo_source, "two", args, 3, 0, idx)
                for name in ("big", "small", "stamp"):
                    assert np.array_equal(batch[name][j].numpy(), want[name]), (idx, name)
                assert int(batch.labels[j]) == int(demo_source.labels[idx])
            seen += batch.indices
            with pytest.raises(TypeError, match=r"3 outputs \['big', 'small', 'stamp'\]: use batch\[name\]"):
                images, labels = batch
            with pytest.raises(KeyError, match="no output 'nope'"):
                batch["nope"]
    assert sorted(seen) == list(range(DEMO_SIZE))


def test_named_builtin_train_pipeline_is_the_legacy_recipe_byte_for_byte(make_service):
    svc = make_service()
    with RemoteLoader(svc.endpoint, batch_size=32, image_size=40, seed=5, scale=(0.3, 1.0),
                      epoch_lookahead=False) as ld:
        legacy = collect(ld)
    with RemoteLoader(svc.endpoint, batch_size=32, seed=5, pipeline="train",
                      pipeline_args={"size": 40, "scale": [0.3, 1.0]}, epoch_lookahead=False) as ld:
        named = collect(ld)
        for images, labels in ld:  # one output: unpacks like a DataLoader batch
            assert images.shape[1:] == (40, 40, 3) and len(labels) == len(images)
            break
    assert [(b["indices"], b["images"], b["labels"]) for b in legacy] == \
           [(b["indices"], b["images"], b["labels"]) for b in named]


def test_unknown_pipeline_lists_the_known_ones(make_service):
    svc = make_service(pipeline=DOUBLES)
    with RemoteLoader(svc.endpoint, batch_size=8, pipeline="multicrop") as ld:
        with pytest.raises(LoaderError, match=r"unknown pipeline 'multicrop'; this service offers "
                                              r"\['eval', 'raises', 'returns', 'train', 'two'\]"):
            len(ld)


@pytest.mark.parametrize("args, message", [
    ({"size": "big"}, "pipeline 'two': argument 'size' must be an int in [4, 256], got 'big'"),
    ({"size": 1000}, "pipeline 'two': argument 'size' must be an int in [4, 256], got 1000"),
    ({"sise": 16}, "pipeline 'two': unknown argument(s) ['sise']"),
])
def test_arguments_the_pipeline_refuses_are_named(make_service, args, message):
    e = refused(make_service, "two", args)
    assert e.code == P.ErrorCode.BAD_JOB and message in e.message


def refused(make_service, pipeline: str, args: dict) -> LoaderError:
    """The error an epoch of ``pipeline`` with ``args`` ends with."""
    svc = make_service(pipeline=DOUBLES)
    with RemoteLoader(svc.endpoint, batch_size=8, pipeline=pipeline, pipeline_args=args) as ld:
        with pytest.raises(LoaderError) as info:
            collect(ld)
    return info.value


@pytest.mark.parametrize("entry, message", [
    ("x=no_such_module_here:make", "pipeline 'x': module 'no_such_module_here' does not import: ModuleNotFoundError"),
    ("x=testkit.pipeline_doubles:missing", "pipeline 'x': module 'testkit.pipeline_doubles' has no 'missing'"),
    ("x=testkit.pipeline_doubles", "expected NAME=MODULE:CALLABLE"),
    ("train=testkit.pipeline_doubles:raises", "the name 'train' is already taken (built in)"),
])
def test_a_pipeline_that_cannot_load_stops_the_service_from_starting(entry, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Service(ServiceConfig(demo=True, demo_size=DEMO_SIZE, workers=1, data_port=0, http_port=0,
                              pipeline=(entry,))).start()


def test_pipeline_option_from_flag_and_environment(capsys):
    env = {"LOADER_DEMO": "1", "LOADER_PIPELINE": "a=m:f, b=pkg.mod:make"}
    assert load_config(environ=env).config.pipeline == ("a=m:f", "b=pkg.mod:make")
    from loader_service.cli.main import main

    assert main(["config", "--demo", "--pipeline", "a=m:f", "--pipeline", "b=m:g"]) == 0
    assert 'pipeline = ["a=m:f", "b=m:g"]' in capsys.readouterr().out
    with pytest.raises(ValueError, match="pipeline 'a': expected NAME=MODULE:CALLABLE"):
        ServiceConfig(demo=True, pipeline=("a",))


@pytest.mark.parametrize("args, message", [
    ({"dtype": "float32"}, "pipeline 'returns' output 'x': expected uint8 (4, 4), got float32 (4, 4)"),
    ({"side": 3}, "pipeline 'returns' output 'x': expected uint8 (4, 4), got uint8 (3, 4)"),
])
def test_an_output_of_the_wrong_shape_or_dtype_is_named(make_service, args, message):
    assert message in refused(make_service, "returns", args).message


def test_returned_arrays_are_copied_into_the_slot(make_service):
    svc = make_service(pipeline=DOUBLES)
    with RemoteLoader(svc.endpoint, batch_size=8, pipeline="returns", epoch_lookahead=False) as ld:
        for batch in ld:
            for j, idx in enumerate(batch.indices):
                assert (batch["x"][j] == idx % 256).all()


def test_a_pipeline_that_raises_follows_on_error_with_its_name_and_traceback(make_service):
    svc = make_service(pipeline=DOUBLES, on_error="raise")
    with RemoteLoader(svc.endpoint, batch_size=8, pipeline="raises", shuffle=False) as ld:
        with pytest.raises(LoaderError) as info:
            collect(ld)
    e = info.value
    assert e.code == P.ErrorCode.SAMPLE_FAILED
    assert f"sample {D.RAISES_AT}" in e.message and "in pipeline 'raises': RuntimeError: boom on 5" in e.message
    assert "Traceback" in e.remote_traceback and "pipeline_doubles.py" in e.remote_traceback

    skip = make_service(pipeline=DOUBLES, on_error="skip")
    with RemoteLoader(skip.endpoint, batch_size=8, pipeline="raises", epoch_lookahead=False) as ld:
        batches = collect(ld)
    assert sorted(indices_of(batches)) == sorted(set(range(DEMO_SIZE)) - {D.RAISES_AT})
    reasons = [why for b in batches for i, why in b["skipped"] if i == D.RAISES_AT]
    assert len(reasons) == 1 and "boom on 5" in reasons[0]


def test_ranks_of_one_job_must_name_the_same_pipeline(make_service):
    svc = make_service(pipeline=DOUBLES)
    kw = dict(batch_size=8, world_size=2, job="j", epoch_lookahead=False)
    with RemoteLoader(svc.endpoint, rank=0, pipeline="two", pipeline_args={"size": 16}, **kw) as r0:
        it = iter(r0)
        next(it)  # rank 0 is connected with its plan
        with RemoteLoader(svc.endpoint, rank=1, pipeline="two", pipeline_args={"size": 24}, **kw) as r1:
            with pytest.raises(LoaderError, match=r"pipeline_args: \{'size': 24\} here, \{'size': 16\} there"):
                next(iter(r1))
        del it


def test_normalize_per_output_on_the_cpu_path(make_service):
    svc = make_service(pipeline=DOUBLES)
    with RemoteLoader(svc.endpoint, batch_size=8, pipeline="two", pipeline_args={"size": 16},
                      normalize=["big"], epoch_lookahead=False) as ld:
        batch = next(iter(ld))
    big, raw = batch["big"], batch.raw_outputs["big"]
    assert big.dtype == torch.float32 and big.shape == (8, 2, 3, 16, 16)
    mean = torch.tensor(ld.config.mean).view(3, 1, 1)
    std = torch.tensor(ld.config.std).view(3, 1, 1)
    assert torch.allclose(big[3, 1], (raw[3, 1].permute(2, 0, 1).float() - mean) / std)
    assert batch["small"].dtype == torch.uint8  # not chosen: as received
    with pytest.raises(LoaderError, match=r"normalize names \['small'\], which are not RGB outputs"):
        with RemoteLoader(svc.endpoint, batch_size=8, pipeline="two", normalize=["small"]) as ld:
            len(ld)


def test_batch_headers_without_outputs_keep_the_original_shape():
    old = P.Batch(stream=1, epoch=0, index=0, indices=[1, 2], shape=[2, 4, 4, 3])
    header = P.encode_header(old)
    import msgpack

    assert "outputs" not in msgpack.unpackb(header)  # an older client decodes it unchanged
    msg, _ = P.decode([header, b"\0" * 96, b"\0" * 16])
    assert msg.output_shapes() == [("image", (2, 4, 4, 3))]
    named = P.Batch(stream=1, epoch=0, index=0, indices=[1, 2], shape=[2], outputs=[["a", [3]], ["b", [2, 2]]])
    msg, _ = P.decode([P.encode_header(named), b"\0" * 6, b"\0" * 8, b"\0" * 16])
    assert msg.output_shapes() == [("a", (2, 3)), ("b", (2, 2, 2))]
    with pytest.raises(P.ProtocolError, match=r"Batch frames are \[6, 8, 16\] bytes, header says \[6, 18, 16\]"):
        P.decode([P.encode_header(P.Batch(stream=1, epoch=0, index=0, indices=[1, 2], shape=[2],
                                          outputs=[["a", [3]], ["b", [9]]])), b"\0" * 6, b"\0" * 8, b"\0" * 16])
