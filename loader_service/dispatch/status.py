"""The service's status as a typed snapshot.

The dispatcher builds one :class:`ServiceStatus` on its own thread; the REST API returns it
(``GET /v1/status``, whose schema is this model), the autoscaler decides from it, the metrics
and the periodic log line read it. Nothing else reads the dispatcher's state.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from pydantic import BaseModel, ConfigDict, Field
from pydantic.dataclasses import dataclass


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
    credits: int
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
    internal_errors: int = 0
    refused_handshakes: int = 0  # on the data port: unknown keys, no keys, wrong server key
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


class ServiceStatus(_Frozen):
    instance: str
    uptime_s: float
    healthy: bool
    problem: str  # why not healthy ("" when healthy)
    data_port: int
    data_port_curve: bool = False  # CURVE (--curve-keys) on the data port
    datasets: Dict[str, Dict[str, int]]
    workers: WorkersStatus
    clients: List[ClientStatus]
    throughput: Dict[str, float]
    totals: Totals  # a copy: the counts only (its seconds are stage_s)
    stage_s: StageSeconds
    shm_bytes: int
    task_deadline_s: float  # the deadline a one-batch task of the median batch size gets now
    autoscaler: dict
    decode_path: str = ""  # how JPEGs are decoded: "native-roi (libjpeg-turbo X.Y.Z)" or the simplejpeg fallback
    shm_limit_bytes: int = 0  # the cap on shm_bytes (--max-shm-mb)
    skipped_recent: List[SkippedSample] = []  # the last SKIPS_SHOWN samples skipped (on_error=skip), oldest first
