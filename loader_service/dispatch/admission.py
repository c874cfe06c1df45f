"""Admission: what a client's Hello becomes, a stream to open or a refusal that says why, and
the answer to a Describe (pure: no sockets, no memory; the loop applies the verdict).

A Hello is checked in this order, and the first failure is the refusal:

1. its stream is newer than the connection's last one (:meth:`Admission.stale`); the loop then
   retires the connection's current stream, whatever follows;
2. the dataset is one this service serves;
3. the job rules (:mod:`jobs`): a rank whose spec differs from its job's is refused naming
   the fields; a (job, rank) held by an older client is taken over;
4. workers can start; the plan can be made; ``batches`` are in the epoch, and no more than
   its window at once (:mod:`door`);
5. the pipeline is one the service can run.

What passes is an :class:`~loader_service.dispatch.streams.Opening` with its
:class:`~loader_service.dispatch.sending.BatchLayout`: the batch memory gives it slots next.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Union

from wire import protocol as P
from wire.jobspec import JobSpec
from wire.plan import PlanSpec, RankPlan, make_plan
from loader_service.decode.jpeg import DEFAULT_OPTIONS, DecodeOptions
from loader_service.decode.pipelines import (JobPipeline, PipelineError, Registry, job_pipeline, named_pipeline,
                                              output_identity)
from loader_service.dispatch.door import past_the_end, window_of
from loader_service.dispatch.jobs import rank_rules, taken_over
from loader_service.dispatch.sending import BatchLayout
from loader_service.dispatch.sessions import Session
from loader_service.dispatch.stream_state import StreamLimits
from loader_service.dispatch.streams import Opening
from loader_service.sources import Source


@dataclass(frozen=True)
class Refuse:
    """The Error a refused Hello gets (for its stream)."""

    code: str
    message: str
    fatal: bool = True


@dataclass(frozen=True)
class TakeOver:
    """``session``, an older client of the (job, rank), loses it and is told ``why``."""

    session: Session
    why: str


@dataclass(frozen=True)
class Verdict:
    """What becomes of a Hello: ``takeovers`` first, then the session holds its rank of the
    job under ``spec`` (when set), then ``outcome``."""

    outcome: Union[Opening, Refuse]
    takeovers: List[TakeOver] = field(default_factory=list)
    spec: Optional[JobSpec] = None


class Admission:
    """What the service serves (datasets, pipelines) and the rules a Hello must pass."""

    def __init__(self, sources: Dict[str, Source], pipelines: Registry, limits: StreamLimits,
                 decode: DecodeOptions = DEFAULT_OPTIONS):
        self.sources, self.pipelines, self.limits, self.decode = sources, pipelines, limits, decode
        self.default_dataset = next(iter(sources))
        # streams of one plan share it (its arrays cost 9 bytes per sample: a flood of 10,000 alike
        # Hellos made 10,000 copies); a plan no stream holds any more goes with its last stream
        self._plans: "weakref.WeakValueDictionary[PlanSpec, RankPlan]" = weakref.WeakValueDictionary()

    def source(self, name: Optional[str]) -> Union[Source, Refuse]:
        """The dataset called ``name`` (None or "": the first one)."""
        source = self.sources.get(name or self.default_dataset)
        if source is None:
            return Refuse(P.ErrorCode.UNKNOWN_DATASET,
                          f"unknown dataset {name!r}; this service serves {sorted(self.sources)}")
        return source

    def describe(self, msg: P.Describe) -> P.Message:
        """The answer to a Describe: the dataset, and the outputs of the pipeline it names."""
        source = self.source(msg.dataset)
        if isinstance(source, Refuse):
            return P.Error(code=source.code, stream=-1, message=source.message)
        outputs, pipe = [], None
        if msg.pipeline:
            try:
                pipe = named_pipeline(self.pipelines, msg.pipeline, msg.pipeline_args)
            except PipelineError as exc:
                return P.Error(code=P.ErrorCode.BAD_JOB, message=str(exc))
            outputs = pipe.outputs()
        return P.DatasetInfo(dataset=source.name, length=len(source), num_classes=source.num_classes, outputs=outputs,
                             fingerprint=source.fingerprint(), decoding=output_identity(self.decode, pipe))

    def decoding(self, pipe: JobPipeline) -> str:
        """Accept.decoding of a stream that runs ``pipe``."""
        return output_identity(self.decode, pipe)

    def plan(self, spec: PlanSpec) -> RankPlan:
        """The plan of ``spec``, shared with the streams that have it already (read-only arrays)."""
        plan = self._plans.get(spec)
        if plan is None:
            plan = make_plan(spec)
            plan.indices.flags.writeable = plan.padding.flags.writeable = False
            self._plans[spec] = plan
        return plan

    @staticmethod
    def stale(session: Session, hello: P.Hello) -> Optional[Refuse]:
        """Step 1: the refusal of a Hello whose stream is not newer than the connection's last."""
        if hello.stream <= session.stream_id:
            return Refuse(P.ErrorCode.BAD_JOB,
                          f"stream {hello.stream} is not newer than this client's stream {session.stream_id}")
        return None

    def admit(self, session: Session, hello: P.Hello, sessions: Iterable[Session], broken: str = "") -> Verdict:
        """Steps 2 to 5 for ``session``'s Hello; ``sessions``: every connection (for the job
        rules); ``broken``: why no worker can start ("" when they can)."""
        source = self.source(hello.spec.dataset)
        if isinstance(source, Refuse):
            return Verdict(source)
        takeovers, spec = [], None
        if hello.job:
            spec = hello.spec.on(source.name)
            rules = rank_rules(session, hello, spec, sessions)
            if isinstance(rules, str):
                return Verdict(Refuse(P.ErrorCode.BAD_JOB, rules))
            takeovers = [TakeOver(other, taken_over(hello.job, hello.rank, session.name)) for other in rules]
        return Verdict(self._opening(session, hello, source, broken), takeovers, spec)

    def _opening(self, session: Session, hello: P.Hello, source: Source, broken: str) -> Union[Opening, Refuse]:
        if broken:
            return Refuse(P.ErrorCode.INTERNAL, broken)
        try:
            blocks = source.blocks() if hello.spec.shuffle_window else None
            plan = self.plan(hello.spec.plan(len(source), hello.epoch, hello.rank, hello.origin, blocks))
        except ValueError as exc:
            return Refuse(P.ErrorCode.BAD_JOB, str(exc))
        nb = plan.num_batches
        if hello.batches and max(hello.batches) >= nb:
            return Refuse(P.ErrorCode.BAD_JOB, past_the_end(max(hello.batches), nb))
        if len(hello.batches) > window_of(hello):
            return Refuse(P.ErrorCode.BAD_MESSAGE, (
                f"Hello asks for {len(hello.batches)} batches at once, more than its window of "
                f"{window_of(hello)} (Hello.window)"))
        try:
            pipe = job_pipeline(self.pipelines, hello.spec)
        except PipelineError as exc:
            return Refuse(P.ErrorCode.BAD_JOB, str(exc))
        layout = BatchLayout.of(pipe, hello.spec.batch_size)
        return Opening(session, hello, source, plan, pipe, layout, self.limits, list(hello.batches), False,
                       max(1, min(hello.slots, nb)))
