"""Jobs are consistent or refused: the rules that keep ranks of one training from getting
wrong data silently (pure; admission applies them).

A *job* is one training: every rank's loader names it (``RemoteLoader(job=...)``, by default
derived from the launcher's environment). While any rank of a job is connected, the service
keeps that rank's :class:`~wire.jobspec.JobSpec`; a rank whose spec differs is refused with
``bad_job`` naming each field and both values, because ranks that disagree on the plan
would double or drop samples. One (job, rank) belongs to one client (one ``RemoteLoader``,
across its connections): a newer client for it takes over, and the older one is told why.
An empty job name opts out (nothing to tell trainings apart by).
"""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple, Union

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.dispatch.sessions import Session


def rank_rules(session: Session, hello: P.Hello, spec: JobSpec,
               sessions: Iterable[Session]) -> Union[str, List[Session]]:
    """The rules for ``session``'s Hello of a named job, ``spec`` its JobSpec with the dataset
    resolved: the refusal (a message) if its spec differs from a connected rank's of the job, or
    it enters the same epoch at another position (the ranks loaded different checkpoints), else
    the sessions of older clients holding its (job, rank), which it takes over."""
    others = [x for x in sessions if x is not session and x.spec is not None and x.job == hello.job
              and x.client != hello.client]
    for other in others:
        diff = spec.differences(other.spec)
        if diff:
            return describe_conflicts(hello.job, hello.rank, other.rank, diff)
        if other.run is not None and other.run[0] == hello.epoch and other.run[1] != hello.entry:
            return describe_mixed_resume(hello.job, hello.rank, hello.entry, other.rank, other.run)
    return [x for x in others if x.rank == hello.rank]


def describe_conflicts(job: str, rank: int, other_rank: int, diff: List[Tuple[str, Any, Any]]) -> str:
    """The refusal of a rank whose spec differs (``diff``: :meth:`JobSpec.differences`), naming each field."""
    fields = "; ".join(f"{f}: {a!r} here, {b!r} there" for f, a, b in diff)
    return (f"rank {rank} of job {job!r} does not match the job's rank {other_rank}, which is connected: {fields}. "
            "Every rank of a job must use the same plan settings (or give this training another job name)")


def describe_mixed_resume(job: str, rank: int, entry: int, other_rank: int, other_run: Tuple[int, int]) -> str:
    """The refusal of a rank that resumes its epoch elsewhere than a connected rank of its job:
    the ranks loaded different checkpoints, and their shares would overlap or leave gaps."""
    epoch, other_entry = other_run
    return (f"rank {rank} of job {job!r} starts epoch {epoch} at sample {entry} of its global order, but the job's "
            f"rank {other_rank}, which is connected, runs it from sample {other_entry}: the ranks loaded different "
            "checkpoints. Every rank must load the same loader state (any rank's copy will do)")


def taken_over(job: str, rank: int, by: str) -> str:
    """What the older client of a (job, rank) is told when the newer one, ``by``, takes it over."""
    return f"rank {rank} of job {job!r} was taken over by a newer client ({by}); two loaders must not serve one rank"


__all__ = ["describe_conflicts", "describe_mixed_resume", "rank_rules", "taken_over"]
