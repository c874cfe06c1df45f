"""Admission without sockets: what a Hello becomes (a stream to open, with its order, credit,
slots and layout, or a refusal that names why), the job rules (a rank whose spec differs is
refused naming the fields; a newer client takes a (job, rank) over), and Describe's answer."""

from __future__ import annotations

import gc
from dataclasses import replace
from typing import List

import pytest

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.decode.pipelines import Registry
from loader_service.dispatch.admission import Admission, Refuse, TakeOver
from loader_service.dispatch.sessions import Session
from loader_service.dispatch.stream_state import StreamLimits
from loader_service.dispatch.streams import Opening

SPEC = JobSpec(batch_size=4, image_size=32, shuffle=False)


class Dataset:
    """What admission reads of a dataset: its name, length, classes and identity."""

    def __init__(self, name: str, length: int):
        self.name, self.length, self.num_classes = name, length, 3

    def __len__(self) -> int:
        return self.length

    def fingerprint(self) -> str:
        return f"fp-{self.name}-{self.length}"

    def describe(self, i: int) -> str:
        return f"{self.name}/{i}.jpg"


@pytest.fixture
def admission() -> Admission:
    return Admission({"demo": Dataset("demo", 22), "other": Dataset("other", 8)},
                     Registry(["views=testkit.pipeline_doubles:two_views"]), StreamLimits(on_error="skip"))


def hello(stream: int = 1, spec: JobSpec = SPEC, **kw) -> P.Hello:
    return P.Hello(stream=stream, spec=spec, **{"slots": 2, **kw})


def connected(ident: bytes, client: str = "", job: str = "", rank: int = -1, spec: JobSpec = None) -> Session:
    return Session(ident, client=client, job=job, rank=rank, spec=spec)


# ---------------------------------------------------------------------------- open
def test_a_hello_opens_with_the_batches_it_asks_for(admission):
    session = connected(b"a")
    v = admission.admit(session, hello(batches=[4, 1], slots=3), [session])
    o = v.outcome
    assert isinstance(o, Opening) and v.takeovers == [] and v.spec is None  # no job: no rules, no rank kept
    assert o.session is session and o.source.name == "demo" and o.plan.num_batches == 6  # 22 samples / 4
    assert (o.order, o.final, o.nslots) == ([4, 1], False, 3)
    assert o.limits == StreamLimits(on_error="skip")
    assert o.layout.slot_bytes == 4 * 32 * 32 * 3 and o.nbytes == 3 * o.layout.slot_bytes
    assert o.what == "prefetch 3 x 0.0 MiB"


def test_slots_never_outnumber_the_batches_of_the_epoch(admission):
    o = admission.admit(connected(b"a"), hello(batches=[4, 1], slots=16), []).outcome
    assert (o.order, o.nslots) == ([4, 1], 6)  # slots: at most the epoch's 6
    empty = admission.admit(connected(b"a"), hello(), []).outcome  # asks for nothing yet
    assert (empty.order, empty.nslots, empty.final) == ([], 2, False)


def test_a_hello_may_not_ask_for_more_than_its_window(admission):
    r = admission.admit(connected(b"a"), hello(batches=[0, 1, 2], window=2), []).outcome
    assert r == Refuse(P.ErrorCode.BAD_MESSAGE, "Hello asks for 3 batches at once, more than its window of 2 "
                                                "(Hello.window)")


def test_a_named_pipeline_gets_its_layout(admission):
    spec = JobSpec(batch_size=4, pipeline="views", pipeline_args={"size": 8, "small": 4})
    o = admission.admit(connected(b"a"), hello(spec=spec), []).outcome
    assert o.layout.named and [x.name for x in o.layout.outputs] == ["big", "small", "stamp"]
    assert o.layout.slot_bytes == 4 * (2 * 8 * 8 * 3 + 4 * 4 + 4)


def test_the_dataset_named_is_the_one_served(admission):
    o = admission.admit(connected(b"a"), hello(spec=JobSpec(batch_size=4, dataset="other")), []).outcome
    assert o.source.name == "other" and o.plan.num_batches == 2


# ---------------------------------------------------------------------------- refuse
def test_a_stream_that_is_not_newer_is_refused(admission):
    session = connected(b"a")
    assert admission.stale(session, hello(stream=1)) is None
    session.stream_id = 1
    assert admission.stale(session, hello(stream=1)) == Refuse(P.ErrorCode.BAD_JOB,
                                                              "stream 1 is not newer than this client's stream 1")


@pytest.mark.parametrize("kw, broken, code, message", [
    (dict(spec=JobSpec(batch_size=4, dataset="nope")), "", P.ErrorCode.UNKNOWN_DATASET,
     "unknown dataset 'nope'; this service serves ['demo', 'other']"),
    ({}, "worker could not start: ImportError", P.ErrorCode.INTERNAL, "worker could not start: ImportError"),
    (dict(rank=5, spec=JobSpec(batch_size=4, world_size=2)), "", P.ErrorCode.BAD_JOB, "rank must be in [0, 2), got 5"),
    (dict(batches=[0, 6]), "", P.ErrorCode.BAD_JOB,
     "batch 6 is past the end of the epoch (6 batches here); does the client's plan come from another dataset "
     "(replicas serving different data)?"),
    (dict(spec=JobSpec(batch_size=4, pipeline="nope")), "", P.ErrorCode.BAD_JOB, None),
])
def test_a_hello_that_cannot_be_served_is_refused_saying_why(admission, kw, broken, code, message):
    v = admission.admit(connected(b"a"), hello(**kw), [], broken)
    assert isinstance(v.outcome, Refuse) and v.outcome.code == code and v.outcome.fatal
    if message is not None:
        assert v.outcome.message == message
    else:
        assert "nope" in v.outcome.message


# ---------------------------------------------------------------------------- job rules
def _job_hello(rank: int, client: str, **spec) -> P.Hello:
    return hello(job="j", rank=rank, client=client, spec=JobSpec(**{"batch_size": 4, "world_size": 2, **spec}))


def _ranks(admission, *hellos) -> List[Session]:
    """Sessions holding the ranks ``hellos`` ask for, as admission leaves them."""
    out = []
    for i, h in enumerate(hellos):
        s = connected(bytes([i]), client=h.client, job=h.job)
        v = admission.admit(s, h, out)
        assert isinstance(v.outcome, Opening)
        s.rank, s.spec, s.run = h.rank, v.spec, (h.epoch, h.entry)  # as the loop records an admitted rank
        out.append(s)
    return out


def test_a_rank_whose_spec_differs_from_its_jobs_is_refused_naming_the_fields(admission):
    sessions = _ranks(admission, _job_hello(0, "c0"))
    assert sessions[0].spec == JobSpec(batch_size=4, world_size=2, dataset="demo")  # kept with its dataset resolved
    new = connected(b"n", client="c1", job="j")
    v = admission.admit(new, _job_hello(1, "c1", seed=7, shuffle=False), sessions)
    assert v.takeovers == [] and v.spec is None
    assert v.outcome == Refuse(P.ErrorCode.BAD_JOB, (
        "rank 1 of job 'j' does not match the job's rank 0, which is connected: seed: 7 here, 0 there; shuffle: "
        "False here, True there. Every rank of a job must use the same plan settings (or give this training "
        "another job name)"))


def test_a_rank_entering_an_epoch_elsewhere_than_a_connected_rank_is_refused_naming_both(admission):
    sessions = _ranks(admission, replace(_job_hello(0, "c0"), entry=32))
    late = replace(_job_hello(1, "c1"), entry=80)
    v = admission.admit(connected(b"n", client="c1", job="j"), late, sessions)
    assert v.outcome == Refuse(P.ErrorCode.BAD_JOB, (
        "rank 1 of job 'j' starts epoch 0 at sample 80 of its global order, but the job's rank 0, which is "
        "connected, runs it from sample 32: the ranks loaded different checkpoints. Every rank must load the same "
        "loader state (any rank's copy will do)"))
    same = replace(_job_hello(1, "c1"), entry=32)
    assert isinstance(admission.admit(connected(b"m", client="c1", job="j"), same, sessions).outcome, Opening)
    next_epoch = replace(_job_hello(1, "c1"), entry=0, epoch=1)  # another epoch: no rule
    assert isinstance(admission.admit(connected(b"o", client="c1", job="j"), next_epoch, sessions).outcome, Opening)


def test_a_rank_naming_the_default_dataset_matches_one_that_leaves_it_implicit(admission):
    sessions = _ranks(admission, _job_hello(0, "c0"))
    v = admission.admit(connected(b"n", client="c1", job="j"), _job_hello(1, "c1", dataset="demo"), sessions)
    assert isinstance(v.outcome, Opening) and v.takeovers == []


def test_a_newer_client_takes_a_rank_over_and_the_older_one_is_told_why(admission):
    sessions = _ranks(admission, _job_hello(0, "old"), _job_hello(1, "other"))
    new = connected(b"\xab" * 6, client="new", job="j")
    v = admission.admit(new, _job_hello(0, "new"), sessions)
    assert isinstance(v.outcome, Opening) and v.spec == JobSpec(batch_size=4, world_size=2, dataset="demo")
    assert v.takeovers == [TakeOver(sessions[0], "rank 0 of job 'j' was taken over by a newer client (abababababab); "
                                                 "two loaders must not serve one rank")]


def test_a_takeover_holds_even_when_the_hello_is_then_refused(admission):
    sessions = _ranks(admission, _job_hello(0, "old"))
    v = admission.admit(connected(b"n", client="new", job="j"), _job_hello(0, "new"), sessions, "no workers")
    assert [t.session for t in v.takeovers] == sessions and v.outcome == Refuse(P.ErrorCode.INTERNAL, "no workers")


def test_a_clients_own_connections_and_other_jobs_are_left_alone(admission):
    sessions = _ranks(admission, _job_hello(0, "c0"))
    lookahead = admission.admit(connected(b"n", client="c0", job="j"), _job_hello(0, "c0", seed=3), sessions)
    assert isinstance(lookahead.outcome, Opening) and lookahead.takeovers == []  # its own: no rule applies
    other_job = hello(job="k", rank=0, client="c9", spec=JobSpec(batch_size=8))
    v = admission.admit(connected(b"m", client="c9", job="k"), other_job, sessions)
    assert isinstance(v.outcome, Opening) and v.takeovers == []
    no_job = admission.admit(connected(b"z", client="c8"), hello(rank=0, client="c8"), sessions)
    assert isinstance(no_job.outcome, Opening) and no_job.spec is None


# ---------------------------------------------------------------------------- describe
def test_describe_answers_with_the_dataset_and_a_pipelines_outputs(admission):
    from loader_service.decode.jpeg import DEFAULT_OPTIONS, DecodeOptions
    from loader_service.decode.pipelines import output_identity

    assert admission.describe(P.Describe()) == P.DatasetInfo(dataset="demo", length=22, num_classes=3, outputs=[],
                                                             fingerprint="fp-demo-22",
                                                             decoding=output_identity(DEFAULT_OPTIONS, None))
    info = admission.describe(P.Describe(dataset="other", pipeline="views", pipeline_args={"size": 8}))
    assert info.dataset == "other" and info.outputs == [["big", [2, 8, 8, 3]], ["small", [8, 8]], ["stamp", [4]]]
    # how the samples become bytes: the decode settings, and a --pipeline's name and code
    decodings = {output_identity(DEFAULT_OPTIONS, None), info.decoding,
                 output_identity(DecodeOptions(fast_dct=True), None),
                 output_identity(DecodeOptions(fast_upsample=True), None),
                 output_identity(DecodeOptions(max_pixels=1000), None)}
    assert len(decodings) == 5
    assert admission.describe(P.Describe(pipeline="views", pipeline_args={"size": 8})).decoding == info.decoding
    unknown = admission.describe(P.Describe(dataset="x"))
    assert (unknown.code, unknown.stream, unknown.message) == (
        P.ErrorCode.UNKNOWN_DATASET, -1, "unknown dataset 'x'; this service serves ['demo', 'other']")
    bad = admission.describe(P.Describe(pipeline="nope"))
    assert bad.code == P.ErrorCode.BAD_JOB and "nope" in bad.message


def test_streams_of_one_plan_share_it_and_a_plan_goes_with_its_last_stream(admission):
    a = admission.admit(connected(b"a"), hello(), []).outcome
    b = admission.admit(connected(b"b"), hello(), []).outcome
    other = admission.admit(connected(b"c"), hello(epoch=1), []).outcome
    assert a.plan is b.plan and other.plan is not a.plan  # a flood of alike Hellos holds one plan
    assert not a.plan.indices.flags.writeable
    spec = a.plan.spec
    del a, b
    gc.collect()
    assert admission._plans.get(spec) is None
