"""The budget of log lines per kind (loader_service/log_budget.py): at most ``burst`` at once,
earned back at ``burst`` per interval, and nothing left out without a count; then a model with
random kinds, times and summaries checked against a recount of every line."""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from loader_service.log_budget import LineBudget


def test_a_kind_writes_its_burst_then_counts_and_its_next_line_says_how_many_were_left_out():
    b = LineBudget(3, 3.0)  # a line a second earned back
    assert [b.take("a", 0.0) for _ in range(5)] == ["", "", "", None, None]
    assert b.take("b", 0.0) == ""  # another kind has its own budget
    assert b.take("a", 0.5) is None  # half a line earned: not yet
    assert b.take("a", 1.0) == " [3 more like this in the last 1 s]"
    assert b.take("a", 1.2) is None
    assert b.take("a", 2.0) == " [1 more like this in the last 1 s]"
    assert b.take("a", 10.0) == ""  # nothing left out since
    assert [b.take("a", 10.0) for _ in range(3)] == ["", "", None]  # earned back up to the burst, no more


def test_lines_left_out_with_no_line_after_them_are_due_as_a_summary_once_a_line_is_earned_back():
    b = LineBudget(2, 10.0)  # one line per 5 s
    assert b.next_due() is None
    for _ in range(7):
        b.take("a", 100.0)
    assert b.next_due() == pytest.approx(105.0)
    assert b.overdue(104.9) == []
    assert b.overdue(105.0) == [("a", 5, 5.0)]
    assert b.next_due() is None and b.overdue(200.0) == []  # counted once
    # the summary spent the line it earned: the next one waits for another
    assert b.take("a", 105.0) is None and b.next_due() == pytest.approx(110.0)


def test_a_line_is_there_at_the_time_next_due_names_whatever_the_float_rounding():
    b = LineBudget(100, 10.0)
    t = 18180.186114431  # a monotonic clock's reading: t + 0.1 - t is 0.0999999... in floats
    for _ in range(101):
        b.take("a", t)
    assert (t + 0.1 - t) * 10.0 < 1.0
    assert b.take("a", t + 0.1) == " [1 more like this in the last 0 s]"


def test_a_budget_must_allow_a_line():
    for burst, interval in ((0, 1.0), (1, 0.0), (1, -1.0), (1, math.nan)):
        with pytest.raises(ValueError):
            LineBudget(burst, interval)


class LineBudgetModel(RuleBasedStateMachine):
    """Lines of three kinds at random times, summaries asked for at random times. Checked
    against the record of every line: no kind writes more than ``burst + rate * t`` lines
    (summaries included) in any span of t seconds; every line is written, or counted exactly once
    in a later written line's note or in a summary; a summary comes exactly when one is due."""

    BURST, INTERVAL = 3, 2.0

    def __init__(self):
        super().__init__()
        self.b = LineBudget(self.BURST, self.INTERVAL)
        self.now = 0.0
        self.out: Dict[str, List[float]] = {}  # kind -> times of what it wrote (its lines and summaries)
        self.taken: Dict[str, int] = {}  # lines asked for
        self.written: Dict[str, int] = {}  # lines written
        self.counted: Dict[str, int] = {}  # lines left out, as notes and summaries said

    @rule(dt=st.sampled_from([0.0, 0.0, 0.1, 0.3, 0.7, 1.0, 2.5]))
    def time_passes(self, dt):
        self.now += dt

    @rule(kind=st.sampled_from("abc"))
    def line(self, kind):
        self.taken[kind] = self.taken.get(kind, 0) + 1
        note = self.b.take(kind, self.now)
        if note is None:
            return
        self.out.setdefault(kind, []).append(self.now)
        self.written[kind] = self.written.get(kind, 0) + 1
        if note:
            assert note.startswith(" [") and note.endswith(" s]"), note
            self.counted[kind] = self.counted.get(kind, 0) + int(note[2:].split(" ", 1)[0])

    @rule()
    def summaries(self):
        due = self.b.next_due()
        got = self._summaries(self.now)
        assert bool(got) == (due is not None and self.now >= due)

    def _summaries(self, now: float) -> List[Tuple[str, int, float]]:
        got = self.b.overdue(now)
        for kind, n, _ in got:
            assert n >= 1
            self.out.setdefault(kind, []).append(now)
            self.counted[kind] = self.counted.get(kind, 0) + n
        return got

    def _waiting(self, kind: str) -> int:
        return self.taken[kind] - self.written.get(kind, 0) - self.counted.get(kind, 0)

    @invariant()
    def within_its_budget(self):
        rate = self.BURST / self.INTERVAL
        for times in self.out.values():
            for i, t0 in enumerate(times):
                for j in range(i, len(times)):
                    assert j - i + 1 <= self.BURST + rate * (times[j] - t0) + 1e-9, times

    @invariant()
    def what_is_left_out_is_counted_once_or_waits_to_be(self):
        for kind in self.taken:
            assert self._waiting(kind) >= 0
        assert (self.b.next_due() is not None) == any(self._waiting(k) for k in self.taken)

    def teardown(self):
        self._summaries(self.now + 1e6)  # long after: every count comes out, exactly
        assert all(self._waiting(k) == 0 for k in self.taken) and self.b.next_due() is None


TestLineBudgetModel = LineBudgetModel.TestCase
TestLineBudgetModel.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
