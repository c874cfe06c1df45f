"""Jobs are consistent or refused: the rules that keep ranks of one training from getting
wrong data silently (pure; the dispatcher applies them).

A *job* is one training: every rank's loader names it (``RemoteLoader(job=...)``, by default
derived from the launcher's environment). While any rank of a job is connected, the service
keeps that rank's :class:`~wire.jobspec.JobSpec`; a rank whose spec differs is refused with
``bad_job`` naming each field and both values, because ranks that disagree on the plan
would double or drop samples. One (job, rank) belongs to one client (one ``RemoteLoader``,
across its connections): a newer client for it takes over, and the older one is told why.
An empty job name opts out (nothing to tell trainings apart by).
"""

from __future__ import annotations

from typing import Any, List, Tuple


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


__all__ = ["describe_conflicts", "describe_mixed_resume"]
