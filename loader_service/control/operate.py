"""What the control plane asks of the dispatcher: the status snapshot, and the worker count set
by hand (REST) or by the autoscaler.

Each function runs on the dispatcher's thread (through ``Dispatcher.call``), so it reads one
consistent state; it reads the dispatcher's parts and changes nothing but the pool's target.
The dispatcher knows nothing of this module: the control plane reads it, never the reverse.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Optional

from loader_service.control.autoscale import Autoscaler
from loader_service.decode.jpeg import decode_path
from loader_service.dispatch import status
from loader_service.dispatch.status import ServiceStatus

if TYPE_CHECKING:
    from loader_service.dispatch.loop import Dispatcher

log = logging.getLogger("loader_service.control.operate")


class AutoscaleConflict(RuntimeError):
    """A manual scale request while autoscaling is on."""


def snapshot(d: "Dispatcher", autoscaler: Optional[Autoscaler] = None) -> ServiceStatus:
    """A consistent, typed snapshot of ``d`` (on its thread)."""
    now = time.monotonic()
    st, pool = d.state, d.pool.state
    t = st.totals
    problem = d.failure or pool.broken
    sizes = [s.hello.spec.batch_size for s in st.sessions.streams()] or [1]
    listed = status.clients(st.sessions.values(), st.memory, now,
                            lanes={ident: s.count for ident, s in d.lane_sets.items() if s.ready})
    return ServiceStatus(
        instance=d.instance, uptime_s=round(time.time() - d.started, 1), healthy=not problem,
        problem=problem, data_port=d.data_port, data_port_curve=d.guard.curve,
        lane_port=d.lanes.port if d.lanes is not None else -1,
        lanes_open=sum(s.count for s in d.lane_sets.values() if s.ready),
        datasets={n: status.dataset(s, d.disk_changes.get(n)) for n, s in d.sources.items()},
        shard_cache={n: s.cache_status() for n, s in d.sources.items() if hasattr(s, "cache_status")},
        workers=status.workers(pool, t.hung_tasks, now),
        clients=listed.shown, clients_total=listed.total, clients_listed=len(listed.shown),
        clients_streaming=listed.streaming,
        throughput={"samples_per_s": round(st.rate.per_s(now, t.samples), 1)},
        totals=dataclasses.replace(t), stage_s=t.stage_seconds(),
        shm_bytes=st.memory.in_use(),
        task_deadline_s=round(st.tasks.deadlines.deadline_s(sorted(sizes)[len(sizes) // 2]), 3),
        autoscaler=autoscaler.status() if autoscaler is not None else {"enabled": False},
        decode_path=decode_path(),
        shm_limit_bytes=st.memory.max_bytes, skipped_recent=list(st.recent_skips),
        connections={"open": st.sessions.connections, "sessions": len(st.sessions),
                     "pending": st.sessions.pending, "waiting": len(st.memory.waiting),
                     "stranded": st.silence.stranded},
    )


def status_json(d: "Dispatcher", autoscaler: Optional[Autoscaler] = None) -> dict:
    """:func:`snapshot` as plain JSON-ready data."""
    return snapshot(d, autoscaler).model_dump(mode="json")


def scale(d: "Dispatcher", n: int, autoscaler: Optional[Autoscaler] = None) -> dict:
    """Set the worker count (REST). Refused while the autoscaler owns the count."""
    if autoscaler is not None:
        p = autoscaler.policy
        raise AutoscaleConflict(f"the autoscaler manages the worker count ({p.min_workers}:{p.max_workers}); "
                                "restart without --autoscale to set it by hand")
    if not 0 <= n <= d.config.max_workers:
        raise ValueError(f"worker count must be in [0, {d.config.max_workers}], got {n}")
    before = d.pool.state.target
    d.pool.scale(n)
    log.info("worker pool scaled %d -> %d by request", before, n)
    return {"previous": before, "target": n, "workers": d.pool.state.counts()}


def autoscale_step(d: "Dispatcher", autoscaler: Autoscaler) -> Optional[dict]:
    """One autoscaler decision from a fresh snapshot, applied to the pool."""
    decision = autoscaler.step(snapshot(d, autoscaler))
    if decision is not None and decision["to"] != decision["from"]:
        d.pool.scale(decision["to"])
    return decision


def first_workers(configured: int, autoscaler: Optional[Autoscaler]) -> int:
    """The pool's size at start: the configured count, within the autoscaler's bounds if it has any."""
    if autoscaler is None:
        return configured
    p = autoscaler.policy
    return min(max(configured, p.min_workers), p.max_workers)
