"""The status snapshot's client list: bounded, whatever the number of sessions (issue 32: a
/v1/status over 10,000 sessions took more than 10 s), with counts over every client."""

from __future__ import annotations

from wire import protocol as P
from wire.jobspec import JobSpec
from wire.plan import make_plan
from loader_service.decode.pipelines import Registry, job_pipeline
from loader_service.dispatch import status
from loader_service.dispatch.memory import BatchMemory
from loader_service.dispatch.sending import BatchLayout
from loader_service.dispatch.sessions import Session
from loader_service.dispatch.stream_state import StreamLimits
from loader_service.dispatch.streams import Opening

SPEC = JobSpec(batch_size=4, image_size=32)
PLAN = make_plan(SPEC.plan(240, 0, 0))
LAYOUT = BatchLayout.of(job_pipeline(Registry(), SPEC), SPEC.batch_size)


class _Source:
    name = "demo"

    @staticmethod
    def describe(i: int) -> str:
        return f"sample {i}"


def _serve(memory: BatchMemory, session: Session, lookahead: bool = False) -> None:
    hello = P.Hello(stream=1, spec=SPEC, slots=2, lookahead=lookahead, client=session.client)
    o = Opening(session, hello, _Source(), PLAN, job_pipeline(Registry(), SPEC), LAYOUT, StreamLimits(),
                order=list(range(PLAN.num_batches)), final=True, nslots=2)
    session.stream = memory.open(o, 0.0)


def test_the_client_list_shows_the_busiest_clients_and_counts_them_all():
    memory = BatchMemory(1 << 30, 0, live=lambda: (), connected=lambda ident: True)
    try:
        flood = [Session(i.to_bytes(4, "big"), client=f"flood{i}", samples=1, connected=float(i))
                 for i in range(300)]
        busy = [Session(b"busy%d" % i, client=f"busy{i}", samples=1000 * (i + 1)) for i in range(3)]
        current, ahead = Session(b"cur", client="trainer"), Session(b"ahead", client="trainer")
        _serve(memory, current)
        _serve(memory, ahead, lookahead=True)  # the same loader's next epoch: one client
        listed = status.clients([*flood, ahead, *busy, current], memory, now=500.0, limit=6)
        assert listed.total == 300 + 3 + 1
        assert listed.streaming == 1
        names = [c.client for c in listed.shown]
        assert names[0] == current.name  # serving its current epoch: listed first, as the loader
        assert names[1:4] == [busy[2].name, busy[1].name, busy[0].name]  # then by samples delivered
        assert names[4:] == [flood[0].name, flood[1].name]  # then the longest connected
        (trainer,) = [c for c in listed.shown if c.client == current.name]
        assert trainer.slot_bytes == 2 * 2 * LAYOUT.slot_bytes and trainer.stream is not None
        everyone = status.clients([*flood, ahead, *busy, current], memory, now=500.0, limit=10_000)
        assert len(everyone.shown) == everyone.total == 304
    finally:
        memory.close()
