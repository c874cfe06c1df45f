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


__all__ = ["describe_conflicts"]
