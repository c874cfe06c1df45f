"""TaskDeadlines on its own: the deadline arithmetic the dispatcher relies on.

The dispatcher gives a task of n samples, started at ``t``, the deadline
``t + deadline_s(n)``, kills its worker once the clock passes it, and reports every finished
task with ``observe(samples, seconds)``. ``tests/e2e/test_deadlines.py`` checks that story on live
services; these tests check the numbers.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_service.dispatch.deadlines import TaskDeadlines


def test_before_anything_is_measured_a_task_gets_six_times_the_floor():
    d = TaskDeadlines(floor_s=10.0)
    assert d.deadline_s(1) == 60.0
    assert d.deadline_s(512) == 60.0


def test_the_defaults_are_a_ten_second_floor_and_a_factor_of_ten():
    d = TaskDeadlines()
    assert (d.fixed_s, d.floor_s, d.factor) == (0.0, 10.0, 10.0)
    d.observe(1, 2.0)
    assert d.deadline_s(1) == 20.0


def test_the_deadline_is_factor_times_the_slowest_time_per_sample_times_the_samples():
    d = TaskDeadlines(floor_s=1.0, factor=10.0)
    d.observe(4, 2.0)  # 0.5 s a sample: the slowest
    d.observe(10, 1.0)  # 0.1 s a sample
    assert d.deadline_s(8) == pytest.approx(10 * 0.5 * 8)
    assert d.deadline_s(1) == pytest.approx(10 * 0.5)


def test_a_faster_task_does_not_lower_the_deadline_a_slower_recent_one_set():
    d = TaskDeadlines(floor_s=1.0, factor=4.0)
    d.observe(2, 3.0)
    before = d.deadline_s(2)
    d.observe(2, 0.2)
    assert d.deadline_s(2) == before == pytest.approx(4 * 1.5 * 2)


def test_the_deadline_never_falls_below_the_floor():
    d = TaskDeadlines(floor_s=2.5, factor=10.0)
    d.observe(100, 0.01)  # 0.1 ms a sample: 1 ms for a one-sample task
    assert d.deadline_s(1) == 2.5
    assert d.deadline_s(100) == 2.5  # 10 ms computed, floor wins


def test_one_fast_measurement_replaces_the_generous_first_deadline_with_the_floor():
    d = TaskDeadlines(floor_s=3.0)
    assert d.deadline_s(16) == 18.0
    d.observe(16, 0.0)  # an instant task still counts as a measurement
    assert d.deadline_s(16) == 3.0


def test_a_task_of_no_samples_is_given_the_deadline_of_one_sample():
    d = TaskDeadlines(floor_s=0.1, factor=2.0)
    d.observe(1, 1.0)
    assert d.deadline_s(0) == d.deadline_s(1) == pytest.approx(2.0)


def test_only_the_most_recent_window_of_measurements_counts():
    d = TaskDeadlines(floor_s=0.01, factor=1.0, window=3)
    d.observe(1, 5.0)  # slow, then three fast ones push it out of the window
    d.observe(1, 1.0)
    d.observe(1, 1.0)
    assert d.deadline_s(1) == pytest.approx(5.0)
    d.observe(1, 1.0)
    assert d.deadline_s(1) == pytest.approx(1.0)


@pytest.mark.parametrize("samples, seconds", [(0, 5.0), (-3, 5.0), (4, -1.0)])
def test_a_report_of_no_samples_or_negative_time_is_ignored(samples, seconds):
    d = TaskDeadlines(floor_s=1.0)
    d.observe(samples, seconds)
    assert d.deadline_s(4) == 6.0  # still nothing measured


def test_a_fixed_deadline_overrides_the_first_guess_and_every_measurement():
    d = TaskDeadlines(fixed_s=3.0, floor_s=10.0)
    assert d.deadline_s(1) == 3.0
    d.observe(1, 100.0)
    assert d.deadline_s(64) == 3.0


@pytest.mark.parametrize("kw", [{"fixed_s": -1.0}, {"floor_s": 0.0}, {"floor_s": -1.0}, {"factor": 0.99},
                                {"window": 0}])
def test_settings_that_make_no_sense_are_refused(kw):
    with pytest.raises(ValueError, match="fixed_s >= 0, floor_s > 0, factor >= 1, window >= 1"):
        TaskDeadlines(**kw)


def test_a_task_factor_times_slower_than_the_slowest_measured_one_is_hung_and_a_bit_faster_is_not():
    # the dispatcher's rule: a task started at t with n samples is hung once now >= t + deadline_s(n)
    d = TaskDeadlines(floor_s=1.0, factor=10.0)
    d.observe(4, 0.8)  # 0.2 s a sample
    started, due = 1000.0, 1000.0 + d.deadline_s(4)
    assert due <= started + 4 * 0.2 * 10  # ten times slower: hung
    assert due > started + 4 * 0.2 * 9.9  # a little less: still running


_report = st.tuples(st.integers(-2, 64), st.floats(-1.0, 30.0, allow_nan=False))


@settings(max_examples=150, deadline=None)
@given(reports=st.lists(_report, max_size=20), window=st.integers(1, 6), samples=st.integers(0, 256),
       floor=st.floats(0.01, 20.0), factor=st.floats(1.0, 20.0))
def test_the_deadline_follows_the_slowest_per_sample_time_of_the_last_window_valid_reports(
        reports, window, samples, floor, factor):
    d = TaskDeadlines(floor_s=floor, factor=factor, window=window)
    for n, s in reports:
        d.observe(n, s)
    valid = [s / n for n, s in reports if n > 0 and s >= 0][-window:]
    if not valid:
        assert d.deadline_s(samples) == 6 * floor
        return
    assert d.deadline_s(samples) == pytest.approx(max(floor, factor * max(valid) * max(1, samples)))
    # so a task no slower per sample than the slowest recent one is never taken for hung
    assert d.deadline_s(samples) >= max(valid) * max(1, samples)
