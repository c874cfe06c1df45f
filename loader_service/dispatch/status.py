"""The service's status as a typed snapshot.

The dispatcher builds one :class:`ServiceStatus` on its own thread (from the parts built by the
functions at the end); the REST API returns it (``GET /v1/status``, whose schema is this
model), the autoscaler decides from it, the metrics and the periodic log line read it. Nothing
else reads the dispatcher's state. :func:`progress` is the status of one stream, for a client
that has waited a while (the Progress message).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Deque, Dict, Iterable, List, NamedTuple, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field
from pydantic.dataclasses import dataclass

from wire import protocol as P

if TYPE_CHECKING:
    from loader_service.dispatch.memory import BatchMemory
    from loader_service.dispatch.sessions import Session
    from loader_service.dispatch.streams import Stream
    from loader_service.dispatch.tasks import Tasks
    from loader_service.sources.base import DiskChange, Source
    from loader_service.workers.pool_state import PoolState


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class WorkerStatus(_Frozen):
    id: int
    pid: int
    state: str  # starting | idle | busy | leaving | stopping | failed
    tasks_done: int
    busy_s: float
    uptime_s: float
    task_s: Optional[float] = None  # how long its current task has run


class WorkersStatus(_Frozen):
    target: int
    counts: Dict[str, int]
    deaths: int
    hung: int  # workers killed because a task outlived its deadline
    stop_kills: int  # workers killed because they had not exited within worker_stop_s of being told to stop
    broken: str  # why no worker can start ("" when fine)
    live: int  # starting, idle or busy
    busy_s_total: float  # seconds spent on tasks by every worker so far, running tasks included
    list: List[WorkerStatus]


class StreamStatus(_Frozen):
    id: int
    dataset: str
    epoch: int
    rank: int
    world_size: int
    batch_size: int
    next_batch: int
    sent: int
    to_send: int
    num_batches: int
    unsent: int  # batches asked and not yet sent
    in_flight: int
    lookahead: bool
    skipped: int
    wait_s: float
    h2d_s: float


class ClientStatus(_Frozen):
    client: str
    job: str
    batches: int
    samples: int
    connected_s: float
    stream: Optional[StreamStatus]
    # batch memory: "stream" (its stream's slots), "reserve" (kept for its next epoch), "lent"
    # (its quiet stream's slots went to another job), "waiting" (it needs slots that are in use), ""
    slots: str = ""
    slot_bytes: int = 0
    # how its stream's batches reach it: "in place" (co-located: read from the service's shared
    # memory), "bulk lanes (N)" (the bytes on N plain TCP connections), "data frames" (on the
    # ZeroMQ socket); "" without a stream
    delivery: str = ""


# The service's running totals, one type end to end: the dispatcher counts into its one
# instance, every status snapshot carries a copy. ``/v1/status`` shows the counts as ``totals``
# and the seconds, under their API names, as ``stage_s`` (:meth:`Totals.stage_seconds`). A
# mutable dataclass, not a model, as it is counted into on every batch; no docstring, as that
# would become the description in the published schema of /v1/status.
@dataclass
class Totals:
    samples: int = 0
    batches: int = 0
    bytes: int = 0
    skipped: int = 0
    bad_messages: int = 0
    failed_tasks: int = 0
    redone_tasks: int = 0
    hung_tasks: int = 0
    streams: int = 0
    internal_errors: int = 0  # bugs met while acting for one client: that client was failed (never expected)
    refused_asks: int = 0  # Requests and Credits the door refused (outside the plan, repeated, past the window)
    refused_handshakes: int = 0  # on the data port: unknown keys, no keys, wrong server key
    refused_sessions: int = 0  # Hellos past --max-sessions or --max-waiting
    early_messages: int = 0  # messages read before their connection's accept was reported (or after it was gone)
    unreported_connections: int = 0  # of those, connections whose accept never came: gone before their message was read
    revoked: int = 0  # streams ended because their client's CURVE key was removed
    floods_cut: int = 0  # connections cut for sending past their allowance (dispatch/flood.py)
    flooded_messages: int = 0  # messages dropped unread: past an allowance, or from a connection or identity cut
    silent_cut: int = 0  # connections cut for bringing nothing for 3 of their client's heartbeats (dispatch/silence.py)
    unread_cut: int = 0  # connections cut for reading nothing of what waited for them as long (dispatch/unread.py)
    held_back: int = 0  # new streams that waited for their client to read what its earlier ones were sent (memory.py)
    denied_addresses: int = 0  # peer addresses refused new connections for their stranded ones (dispatch/silence.py)
    stale_messages: int = 0  # dropped unread: from an older connection on the fd number another client's now has
    heap_trims: int = 0  # free heap given back to the system after many sessions left (dispatch/heap.py)
    read_s: float = Field(0.0, exclude=True)  # workers' reading, summed over tasks
    decode_s: float = Field(0.0, exclude=True)  # workers' decoding and augmenting
    wait_s: float = Field(0.0, exclude=True)  # clients' stall (their messages' wait_s, summed)
    h2d_s: float = Field(0.0, exclude=True)  # clients' host-to-device copies (h2d_s, summed)

    def stage_seconds(self) -> "StageSeconds":
        """The seconds as ``stage_s`` shows them (the API's names, to the millisecond)."""
        return StageSeconds(read=round(self.read_s, 3), decode_augment=round(self.decode_s, 3),
                            client_wait=round(self.wait_s, 3), client_h2d=round(self.h2d_s, 3))


SKIPS_SHOWN = 20  # the most recent skipped samples kept for the status


class SkippedSample(_Frozen):
    dataset: str
    index: int
    reason: str


class StageSeconds(_Frozen):
    read: float
    decode_augment: float
    client_wait: float
    client_h2d: float


class DiskChangeStatus(_Frozen):
    added: int
    removed: int
    relabelled: int
    examples: List[str]
    message: str


class DatasetStatus(_Frozen):
    length: int
    num_classes: int
    fingerprint: str  # the dataset's identity (names, sizes, labels); loaders resume only on the same
    # files added or removed since the scan (ImageFolder; --watch), not served: null when none
    changed_on_disk: Optional[DiskChangeStatus] = None
    on_change: str = "restart"  # the rescan policy: a changed folder is served after a restart, never mid-run


class ServiceStatus(_Frozen):
    instance: str
    uptime_s: float
    healthy: bool
    problem: str  # why not healthy ("" when healthy)
    data_port: int
    data_port_curve: bool = False  # CURVE (--curve-keys) on the data port
    lane_port: int = -1  # the bulk-lane port (--lane-port; -1: none)
    lanes_open: int = 0  # bulk lanes of all clients, sending now
    datasets: Dict[str, DatasetStatus]
    workers: WorkersStatus
    clients: List[ClientStatus]  # the busiest CLIENTS_SHOWN clients (see clients_total)
    throughput: Dict[str, float]
    totals: Totals  # a copy: the counts only (its seconds are stage_s)
    stage_s: StageSeconds
    shm_bytes: int
    task_deadline_s: float  # the deadline a one-batch task of the median batch size gets now
    autoscaler: dict
    decode_path: str = ""  # how JPEGs are decoded: "native-roi (libjpeg-turbo X.Y.Z)" or the simplejpeg fallback
    shm_limit_bytes: int = 0  # the cap on shm_bytes (--max-shm-mb)
    skipped_recent: List[SkippedSample] = []  # the last SKIPS_SHOWN samples skipped (on_error=skip), oldest first
    # data-port connections: "open" (per the monitor), "sessions" (said Hello; ``clients`` lists
    # them one per client), "pending" (open, no session), "waiting" (new streams waiting for slots),
    # "stranded" (open, of them: cut, and libzmq will not close them before the service stops: dispatch/silence.py)
    connections: Dict[str, int] = {}
    shard_cache: Dict[str, Dict[str, float]] = {}  # dataset in object storage -> its shard cache's counters
    # every client, of which ``clients`` lists ``clients_listed`` (at most CLIENTS_SHOWN, the
    # busiest), and how many serve a stream: counts over all, whatever is listed
    clients_total: int = 0
    clients_listed: int = 0
    clients_streaming: int = 0


# ---------------------------------------------------------------------------- building the snapshot
# Pure functions of what they are given; the dispatcher calls them on its own thread.

class Rate:
    """Samples per second over the last batches sent (0 once nothing was sent for 5 s)."""

    def __init__(self, window: int = 64):
        self._points: Deque[Tuple[float, int]] = deque(maxlen=window)  # (time, samples sent by then)

    def add(self, now: float, samples: int) -> None:
        self._points.append((now, samples))

    def per_s(self, now: float, samples: int) -> float:
        if len(self._points) < 2 or now - self._points[0][0] <= 0:
            return 0.0
        t0, n0 = self._points[0]
        return (samples - n0) / (now - t0) if now - self._points[-1][0] < 5 else 0.0


def dataset(source: "Source", change: Optional["DiskChange"]) -> DatasetStatus:
    return DatasetStatus(length=len(source), num_classes=source.num_classes, fingerprint=source.fingerprint(),
                         changed_on_disk=None if change is None else DiskChangeStatus(
                             added=change.added, removed=change.removed, relabelled=change.relabelled,
                             examples=list(change.examples), message=change.describe()))


def workers(pool: "PoolState", hung: int, now: float) -> WorkersStatus:
    listed = [WorkerStatus(id=w.id, pid=w.pid, state=w.state, tasks_done=w.tasks_done, busy_s=round(w.busy_s, 3),
                           uptime_s=round(now - w.started_at, 1),
                           task_s=round(now - w.task_started, 3) if w.task is not None else None)
              for w in pool.workers.values()]
    return WorkersStatus(target=pool.target, counts=pool.counts(), deaths=pool.deaths, hung=hung,
                         stop_kills=pool.stop_kills, broken=pool.broken,
                         live=pool.live_count(), busy_s_total=round(pool.busy_seconds(), 3), list=listed)


CLIENTS_SHOWN = 100  # the most clients ``clients`` lists: the busiest (issue 32: 10,000 sessions)


class ClientList(NamedTuple):
    """``clients`` of the status: at most ``CLIENTS_SHOWN`` entries, and the counts over all."""

    shown: List[ClientStatus]
    total: int  # clients (one per loader; see :func:`clients`)
    streaming: int  # of those, clients whose shown connection serves a stream


def clients(sessions: Iterable["Session"], memory: "BatchMemory", now: float,
            limit: int = CLIENTS_SHOWN, lanes: Optional[Dict[bytes, int]] = None) -> ClientList:
    """One entry per client: a loader's connections (its epoch lookahead is a second one) are
    one client, shown by the one serving its current epoch, with the batch memory of all. At
    most ``limit`` are listed, the busiest first (serving a current epoch, then by samples
    delivered, then the longest connected): one cheap pass over the sessions, and the costly
    part, an entry, for the listed ones only, so a flood of sessions keeps the status fast.
    ``lanes``: connection -> its bulk lanes, for the sets complete and sending."""
    held: Dict[str, int] = {}
    shown: Dict[str, "Session"] = {}
    for c in sessions:
        key = c.client or c.name
        held[key] = held.get(key, 0) + memory.slot_bytes(c.ident, c.stream)
        if key not in shown or _rank(c) < _rank(shown[key]):
            shown[key] = c
    streaming = sum(1 for c in shown.values() if c.stream is not None)
    busiest = heapq.nsmallest(limit, shown.values(), key=lambda c: (_rank(c), -c.samples, c.connected))
    return ClientList([_client(c, now, memory.slots_word(c.ident, c.stream), held[c.client or c.name],
                               _delivery(c, lanes or {})) for c in busiest], len(shown), streaming)


def _delivery(c: "Session", lanes: Dict[bytes, int]) -> str:
    if c.stream is None:
        return ""
    if c.stream.hello.local:  # its client shares this host's /dev/shm (dispatch/local.py)
        return "in place"
    return f"bulk lanes ({lanes[c.ident]})" if c.ident in lanes else "data frames"


def _rank(c: "Session") -> int:
    """Which of a loader's connections shows it: its current epoch's, then a lookahead's, then any."""
    return 0 if c.stream is not None and not c.stream.lookahead else 1 if c.stream is not None else 2


def _client(c: "Session", now: float, slots: str, slot_bytes: int, delivery: str) -> ClientStatus:
    s = c.stream
    stream = None
    if s is not None:
        st, h = s.state, s.hello
        stream = StreamStatus(
            id=s.id, dataset=s.source.name, epoch=h.epoch, rank=h.rank, world_size=h.spec.world_size,
            batch_size=h.spec.batch_size,
            next_batch=st.order[st.next_send] if st.next_send < len(st.order) else s.plan.num_batches,
            sent=st.next_send, to_send=st.to_send, num_batches=s.plan.num_batches,
            unsent=len(st.order) - st.next_send, in_flight=len(st.tasks), lookahead=s.lookahead,
            skipped=st.skipped, wait_s=round(s.wait_s, 3), h2d_s=round(s.h2d_s, 3))
    return ClientStatus(client=c.name, job=c.job, batches=c.batches, samples=c.samples,
                        connected_s=round(now - c.connected, 1), stream=stream, slots=slots, slot_bytes=slot_bytes,
                        delivery=delivery)


def progress(pool: "PoolState", tasks: "Tasks", stream_id: int, s: Optional["Stream"], not_started: int,
             no_slots: bool, now: float) -> P.Progress:
    """What the service does for stream ``s`` now (None: not yet opened), for a client that
    has waited a while: its longest-running task, and the sample that task's worker is on."""
    counts = pool.counts()
    base = dict(stream=stream_id, workers=pool.live_count(), busy=counts.get("busy", 0) + counts.get("leaving", 0),
                waiting=not_started, no_slots=no_slots)
    mine = tasks.of(s) if s is not None else []
    if not mine:
        return P.Progress(tasks=0, **base)
    tid, r = min(mine, key=lambda x: x[1].started)
    task = s.state.tasks.get(tid)
    batch = task.batch if task is not None else -1
    sample, file, sample_s = -1, "", 0.0
    w = pool.workers.get(r.worker)
    if task is not None and w is not None and w.task == tid:
        pos, sample_s = w.current_sample()
        indices = s.plan.batch(task.batch)
        if task.pos >= 0:  # a one-sample task: its only sample
            pos = task.pos if pos == 0 else -1
        if 0 <= pos < len(indices):
            sample = int(indices[pos])
            try:
                file = s.source.describe(sample)
            except Exception as exc:  # a name is a courtesy; the progress report still goes
                file = f"(no name: {type(exc).__name__})"
    return P.Progress(tasks=len(mine), batch=batch, task_s=now - r.started, sample=sample, file=file,
                      sample_s=sample_s, **base)
