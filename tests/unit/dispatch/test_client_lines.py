"""The dispatch state's lines about what one client does (a stream started, refused or failed; a
client gone), within their budget (``state.CLIENT_LINES`` per ``CLIENT_LINES_S``, per kind): a
flood of Hellos writes that many lines and a count, not one line each, and a line left out is
always counted, in the next line of its kind or in a summary at the state's next deadline."""

from __future__ import annotations

import logging
import uuid

import pytest
import zmq

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig
from loader_service.dispatch.state import CLIENT_LINES, CLIENT_LINES_S
from testkit.dispatcher import close, deliver, loopless

SPEC = JobSpec(batch_size=8, image_size=16, seed=1)
STARTED = "asked at once for"
LOGGER = "loader_service.dispatch.loop"


@pytest.fixture
def d(demo_source):
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0,
                               max_sessions=2000), demo_source, workers=1)
    yield d
    close(d)


def _hellos(d, n: int, first_fd: int):
    idents = [uuid.uuid4().bytes for _ in range(n)]
    for k, ident in enumerate(idents):
        deliver(d, ident, P.Hello(stream=1, spec=SPEC, slots=1, batches=[0]), fd=first_fd + k)
    return idents


def _lines(caplog, part: str):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and part in r.getMessage()]


def test_a_flood_of_hellos_writes_the_budget_then_one_summary_that_counts_the_rest(d, caplog):
    n = 3 * CLIENT_LINES + 17
    with caplog.at_level(logging.INFO, logger=LOGGER):
        t0 = d.now
        _hellos(d, n, 100)
        assert d.totals.streams == n  # every one served: only the log is bounded
        assert len(_lines(caplog, STARTED)) == CLIENT_LINES
        due = t0 + CLIENT_LINES_S / CLIENT_LINES  # when the kind has earned a line back
        d.tick()  # the first look for silent connections, due at once, is done (next: a heartbeat on)
        assert not _lines(caplog, "were left out of the log")
        assert d.state.next_deadline(d.now) == pytest.approx(due)
        d.now = due
        d.tick()
        summary = _lines(caplog, "were left out of the log")
        assert summary == [f"{n - CLIENT_LINES} more lines like 'client %s job %r rank %d/%d epoch %d: stream %d "
                           f"asked at once for %d of %d batches%s' were left out of the log in the last 0 s (at most "
                           f"{CLIENT_LINES} of a kind are written per {CLIENT_LINES_S:.0f} s)"]
        assert d.state.client_lines.next_due() is None  # counted once
        # the clients leaving are a kind of their own, with a budget of its own
        for fd in range(100, 100 + n):
            d.event(zmq.EVENT_DISCONNECTED, fd)
        d.read_monitor()
        assert len(_lines(caplog, " disconnected")) == CLIENT_LINES and not d.sessions.connections
        # once the budget is earned back, lines are written one each again, with no note
        d.now += CLIENT_LINES_S
        d.tick()
        caplog.clear()
        _hellos(d, 5, 5000)
        started = _lines(caplog, STARTED)
        assert len(started) == 5 and not any("more like this" in s for s in started)


def test_a_line_written_after_some_were_left_out_says_how_many(d, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _hellos(d, CLIENT_LINES + 7, 100)
        d.now += CLIENT_LINES_S / CLIENT_LINES  # one line earned back, and no tick before the next Hello
        _hellos(d, 1, 1000)
        started = _lines(caplog, STARTED)
        assert len(started) == CLIENT_LINES + 1
        assert started[-1].endswith(" [7 more like this in the last 0 s]")
        assert d.state.client_lines.next_due() is None  # nothing left to summarize


LENT = "has asked for nothing for"


@pytest.fixture
def tight(demo_source):
    """Room for one stream's slots at a time, lent at once by a stream that asks for nothing."""
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0,
                               max_sessions=2000, max_shm_mb=1, reclaim_idle_s=0), demo_source, workers=1)
    yield d
    close(d)


def test_streams_that_lend_their_slots_one_after_another_write_the_budget_and_a_count(tight, caplog):
    """The batch memory's lines about one client's stream (its slots lent, its wait for them) are
    the state's, within the same budget: a client that opens stream after stream asking for
    nothing, each lending its slots to the next, cannot grow the log by a line each."""
    d, n = tight, CLIENT_LINES + 9
    spec = JobSpec(batch_size=8, image_size=128, seed=1)  # 384 KiB a slot: two slots, one stream in 1 MiB
    with caplog.at_level(logging.INFO):  # whichever logger writes them
        for k in range(n + 1):
            deliver(d, uuid.uuid4().bytes, P.Hello(stream=1, spec=spec, slots=2, batches=[]), fd=100 + k)
        assert d.totals.streams == n + 1
        lent = [r.getMessage() for r in caplog.records if LENT in r.getMessage()]
        assert len(lent) == CLIENT_LINES
        d.now += CLIENT_LINES_S / CLIENT_LINES
        d.tick()
        summary = [s for s in _lines(caplog, "were left out of the log") if LENT in s]
        assert len(summary) == 1 and summary[0].startswith(f"{n - CLIENT_LINES} more lines like 'client %s stream %d "
                                                           f"{LENT}")


def test_a_client_that_meets_a_bug_with_every_message_writes_its_traceback_within_the_budget(d, caplog,
                                                                                           monkeypatch):
    """A bug a client can reach (the last was a header with text and bytes keys, which did not sort)
    fails that client each time; its traceback is logged within the clients' budget, not once per
    message, and every one is counted."""
    def bug(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(type(d.state), "_on_request", bug)
    n = CLIENT_LINES + 40
    ident = uuid.uuid4().bytes
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(n):
            deliver(d, ident, P.Request(stream=1), fd=100)
        said = [r for r in caplog.records if r.levelno == logging.ERROR and "error while" in r.getMessage()]
        assert d.totals.internal_errors == n
        assert len(said) == CLIENT_LINES and "RuntimeError: a bug" in said[0].getMessage()
        assert "Traceback" in said[0].getMessage()
        d.now += CLIENT_LINES_S
        d.tick()
        assert _lines(caplog, "were left out of the log")[-1].startswith("40 more lines like 'error while %s for client")
