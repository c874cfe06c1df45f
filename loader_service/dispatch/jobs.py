"""Jobs are consistent or refused: the rules that keep ranks of one training from getting
wrong data silently (pure; the dispatcher applies them).

A *job* is one training: every rank's loader names it (``RemoteLoader(job=...)``, by default
derived from the launcher's environment). While any rank of a job is connected, the service
keeps that rank's plan parameters; a rank whose parameters differ is refused with
``bad_job`` naming each field and both values, because ranks that disagree on the plan
would double or drop samples. One (job, rank) belongs to one client (one ``RemoteLoader``,
across its connections): a newer client for it takes over, and the older one is told why.
An empty job name opts out (nothing to tell trainings apart by).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

# what the epoch plan and the samples' bytes depend on; a rank may differ only in rank and epoch
PLAN_FIELDS = ("dataset", "world_size", "seed", "batch_size", "shuffle", "drop_last", "image_size", "train",
               "scale", "ratio", "pipeline", "pipeline_args")


def plan_params(hello, dataset: str) -> Dict[str, object]:
    """The plan parameters of ``hello`` (the dataset by its resolved name)."""
    out = {f: getattr(hello, f) for f in PLAN_FIELDS if f != "dataset"}
    out["dataset"] = dataset
    out["scale"], out["ratio"] = [float(x) for x in hello.scale], [float(x) for x in hello.ratio]
    return out


def conflicts(mine: Dict[str, object], theirs: Dict[str, object]) -> List[Tuple[str, object, object]]:
    """(field, this client's value, the job's value) for each plan parameter that differs."""
    return [(f, mine[f], theirs[f]) for f in PLAN_FIELDS if mine[f] != theirs[f]]


def describe_conflicts(job: str, rank: int, other_rank: int, diff: List[Tuple[str, object, object]]) -> str:
    fields = "; ".join(f"{f}: {a!r} here, {b!r} there" for f, a, b in diff)
    return (f"rank {rank} of job {job!r} does not match the job's rank {other_rank}, which is connected: {fields}. "
            "Every rank of a job must use the same plan settings (or give this training another job name)")


__all__ = ["PLAN_FIELDS", "plan_params", "conflicts", "describe_conflicts"]
