"""The job rules (jobs.py) on their own: a rank whose spec differs is refused naming every field,
a rank entering an epoch elsewhere than a connected rank is refused naming both positions, a
newer client takes a (job, rank) over, and other jobs, the same client and an unnamed job are
none of the rules' business."""

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.dispatch.jobs import describe_conflicts, describe_mixed_resume, rank_rules, taken_over
from loader_service.dispatch.sessions import Session

SPEC = JobSpec(batch_size=4, world_size=2, dataset="demo")


def holder(ident: bytes, client: str, rank: int, job: str = "j", spec: JobSpec = SPEC, run=(0, 0)) -> Session:
    return Session(ident, client=client, job=job, rank=rank, spec=spec, run=run)


def hello(rank: int, client: str, job: str = "j", epoch: int = 0, entry: int = 0) -> P.Hello:
    return P.Hello(stream=1, spec=SPEC, job=job, rank=rank, client=client, epoch=epoch, entry=entry)


def test_a_rank_that_agrees_with_its_job_takes_over_only_an_older_client_of_its_own_rank():
    me = Session(b"me", client="new", job="j")
    older, peer = holder(b"a", "old", 1), holder(b"b", "c0", 0)
    assert rank_rules(me, hello(1, "new"), SPEC, [me, older, peer]) == [older]
    assert rank_rules(me, hello(1, "new"), SPEC, [me, peer]) == []


def test_a_differing_spec_is_refused_naming_each_field_and_both_values():
    me, peer = Session(b"me", client="c1", job="j"), holder(b"b", "c0", 0)
    mine = JobSpec(batch_size=8, world_size=2, dataset="demo", seed=3)
    why = rank_rules(me, P.Hello(stream=1, spec=mine, job="j", rank=1, client="c1"), mine, [peer])
    assert why == describe_conflicts("j", 1, 0, [("batch_size", 8, 4), ("seed", 3, 0)])
    assert "batch_size: 8 here, 4 there; seed: 3 here, 0 there" in why


def test_mixed_checkpoints_are_refused_in_the_same_epoch_only():
    me, peer = Session(b"me", client="c1", job="j"), holder(b"b", "c0", 0, run=(2, 64))
    assert rank_rules(me, hello(1, "c1", epoch=2, entry=96), SPEC, [peer]) == describe_mixed_resume(
        "j", 1, 96, 0, (2, 64))
    assert rank_rules(me, hello(1, "c1", epoch=2, entry=64), SPEC, [peer]) == []
    assert rank_rules(me, hello(1, "c1", epoch=3, entry=0), SPEC, [peer]) == []  # a rank already in the next epoch


def test_other_jobs_the_same_client_and_ranks_without_a_spec_are_left_alone():
    me = Session(b"me", client="c1", job="j")
    others = [holder(b"x", "c9", 1, job="other", spec=JobSpec(batch_size=99)),  # another training
              holder(b"y", "c1", 1, spec=JobSpec(batch_size=99)),  # this loader's own other connection
              Session(b"z", client="c8", job="j", rank=1)]  # connected, but holding no rank yet
    assert rank_rules(me, hello(1, "c1"), SPEC, others) == []


def test_the_taken_over_client_is_told_who_took_its_rank():
    assert taken_over("j", 1, "c1 (tcp://x)") == (
        "rank 1 of job 'j' was taken over by a newer client (c1 (tcp://x)); two loaders must not serve one rank")
