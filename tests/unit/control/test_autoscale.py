"""Autoscaler decisions for given measurements.

``loader_service.control.operate.autoscale_step`` hands ``Autoscaler.step`` a fresh ServiceStatus every interval
and scales the pool to ``decision["to"]`` when it differs from ``decision["from"]``. The
autoscaler reads the interval's length from ``time.monotonic()`` itself; these tests do not
patch the clock. Instead each interval's measurements are chosen so that the decision does not
depend on how long the interval was: a client wait or busy time of a million seconds is a
stall or busy fraction far above any threshold, a wait of 0 is a fraction of exactly 0, and a
rate is compared only against a rate of 0 (no samples) or from 0.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_service.control.autoscale import AutoscalePolicy, Autoscaler
from loader_service.dispatch.status import (
    ClientStatus,
    ServiceStatus,
    StageSeconds,
    StreamStatus,
    Totals,
    WorkersStatus,
)

LOTS = 1e6  # seconds of waiting or work in one interval: a fraction above every threshold


def _stream() -> StreamStatus:
    return StreamStatus(id=1, dataset="demo", epoch=0, rank=0, world_size=1, batch_size=8, next_batch=0, sent=0,
                        to_send=0, num_batches=10, unsent=2, in_flight=0, lookahead=False, skipped=0, wait_s=0.0,
                        h2d_s=0.0)


class Service:
    """Cumulative counters as the dispatcher keeps them; each ``interval`` returns a snapshot."""

    def __init__(self, workers: int, clients: int = 1):
        self.workers, self.clients, self.idle_clients = workers, clients, 0
        self.samples, self.wait, self.busy = 0, 0.0, 0.0

    def interval(self, samples: int = 0, wait: float = 0.0, busy: float = 0.0) -> ServiceStatus:
        self.samples += samples
        self.wait += wait
        self.busy += busy
        clients = [ClientStatus(client=f"c{i}", job="", batches=0, samples=0, connected_s=1.0, stream=_stream())
                   for i in range(self.clients)]
        clients += [ClientStatus(client=f"idle{i}", job="", batches=0, samples=0, connected_s=1.0, stream=None)
                    for i in range(self.idle_clients)]
        return ServiceStatus(
            instance="test", uptime_s=1.0, healthy=True, problem="", data_port=1, datasets={},
            workers=WorkersStatus(target=self.workers, counts={}, deaths=0, hung=0, stop_kills=0, broken="", live=self.workers,
                                  busy_s_total=self.busy, list=[]),
            clients=clients, clients_total=len(clients), clients_listed=len(clients), clients_streaming=self.clients,
            throughput={}, totals=Totals(samples=self.samples),
            stage_s=StageSeconds(read=0.0, decode_augment=0.0, client_wait=self.wait, client_h2d=0.0),
            shm_bytes=0, task_deadline_s=1.0, autoscaler={})

    # the kinds of interval the tests use
    def starving(self, samples: int = 0) -> ServiceStatus:
        """Clients wait and workers are saturated."""
        return self.interval(samples, wait=LOTS, busy=LOTS)

    def idle(self, samples: int = 0) -> ServiceStatus:
        """Clients never wait and workers do nothing."""
        return self.interval(samples, wait=0.0, busy=0.0)

    def client_bound(self, samples: int = 0) -> ServiceStatus:
        """Clients wait, but workers are idle: more workers would not help."""
        return self.interval(samples, wait=LOTS, busy=0.0)


def started(lo: int, hi: int, workers: int, clients: int = 1):
    """An autoscaler that has taken its first measurement, and the service it watches."""
    scaler, svc = Autoscaler(AutoscalePolicy(lo, hi)), Service(workers, clients)
    assert scaler.step(svc.idle()) is None
    return scaler, svc


def apply(svc: Service, decision: dict) -> dict:
    """What the dispatcher does with a decision: the pool gets ``to`` workers."""
    svc.workers = decision["to"]
    return decision


def moves(decision: dict):
    return decision["action"], decision["from"], decision["to"]


# ------------------------------------------------------------------ the first step

def test_the_first_step_only_takes_a_measurement():
    scaler, svc = Autoscaler(AutoscalePolicy(1, 4)), Service(workers=2)
    assert scaler.step(svc.starving(samples=100)) is None
    assert scaler.counts == {} and list(scaler.decisions) == []


# ------------------------------------------------------------------ up, and judging the scale-up

def test_starving_clients_and_saturated_workers_add_one_worker():
    scaler, svc = started(1, 4, workers=2)
    d = scaler.step(svc.starving(samples=100))
    assert moves(d) == ("up", 2, 3)
    assert d["reason"].startswith("clients stall ") and "of the time and workers are " in d["reason"]
    assert d["stall"] > 0.05 and d["busy"] > 0.8


def test_a_scale_up_that_did_not_raise_the_rate_is_taken_back_then_the_count_holds_for_the_cooldown():
    scaler, svc = started(1, 8, workers=2)
    assert moves(apply(svc, scaler.step(svc.starving(samples=100)))) == ("up", 2, 3)
    d = apply(svc, scaler.step(svc.starving(samples=0)))  # the new worker brought nothing
    assert moves(d) == ("revert", 3, 2)
    assert "did not beat" in d["reason"] and "by 5% after the last worker" in d["reason"]
    for _ in range(3):  # cooldown_steps: starving or not, nothing moves
        d = scaler.step(svc.starving(samples=100))
        assert moves(d) == ("hold", 2, 2) and d["reason"] == "cooling down after a revert"
    assert moves(scaler.step(svc.starving(samples=100))) == ("up", 2, 3)


def test_a_scale_up_that_raised_the_rate_is_kept_and_the_climb_goes_on():
    scaler, svc = started(1, 8, workers=2)
    apply(svc, scaler.step(svc.starving(samples=0)))
    d = apply(svc, scaler.step(svc.starving(samples=1000)))
    assert moves(d) == ("hold", 3, 3) and d["reason"].startswith("last scale-up raised the rate 0 -> ")
    assert moves(scaler.step(svc.starving(samples=1000))) == ("up", 3, 4)  # no cooldown after a success


def test_a_scale_up_is_judged_on_the_interval_right_after_it_only():
    scaler, svc = started(1, 8, workers=2)
    apply(svc, scaler.step(svc.starving(samples=0)))
    apply(svc, scaler.step(svc.starving(samples=1000)))  # judged: kept
    # the rate falls to nothing, but no scale-up is being judged any more: the climb goes on
    assert moves(scaler.step(svc.starving(samples=0))) == ("up", 3, 4)


def test_a_scale_up_that_left_the_pool_at_its_minimum_is_not_taken_back():
    scaler, svc = started(2, 8, workers=2)
    scaler.step(svc.starving(samples=100))  # up to 3, but the pool did not grow (say a worker failed to start)
    assert moves(scaler.step(svc.starving(samples=0))) == ("hold", 2, 2)


def test_a_scale_up_not_taken_back_at_the_minimum_is_not_reported_as_raising_the_rate():
    scaler, svc = started(2, 8, workers=2)
    scaler.step(svc.starving(samples=100))
    d = scaler.step(svc.starving(samples=0))
    assert "raised the rate" not in d["reason"], d["reason"]


def test_a_scale_up_after_an_interval_with_no_samples_is_taken_back_if_there_are_still_none():
    scaler, svc = started(1, 8, workers=2)
    apply(svc, scaler.step(svc.starving(samples=0)))
    assert moves(scaler.step(svc.starving(samples=0)))[0] == "revert"


# ------------------------------------------------------------------ down and hold

def test_idle_workers_and_clients_that_never_wait_remove_one_worker():
    scaler, svc = started(1, 4, workers=3)
    d = scaler.step(svc.idle())
    assert moves(d) == ("down", 3, 2)
    assert d["reason"] == "clients stall 0.0% and workers are only 0% busy"
    assert (d["stall"], d["busy"], d["rate"]) == (0.0, 0.0, 0.0)


def test_the_pool_steps_down_one_worker_an_interval_to_the_minimum_and_stays_there():
    scaler, svc = started(2, 8, workers=5)
    seen = [moves(apply(svc, scaler.step(svc.idle()))) for _ in range(5)]
    assert seen == [("down", 5, 4), ("down", 4, 3), ("down", 3, 2), ("hold", 2, 2), ("hold", 2, 2)]


def test_with_no_clients_the_pool_steps_down_to_the_minimum_whatever_the_workers_do():
    scaler, svc = started(1, 8, workers=3, clients=0)
    seen = [moves(apply(svc, scaler.step(svc.starving()))) for _ in range(3)]
    assert seen == [("down", 3, 2), ("down", 2, 1), ("hold", 1, 1)]
    assert scaler.decisions[0]["reason"] == "no clients"


ONE_INTERVAL = [
    # (what it shows, (min, max), workers, (clients with a stream, clients without), interval, decision, reason)
    ("a client without a stream does not count as a client", (1, 8), 3, (0, 2), "starving", ("down", 3, 2),
     "no clients"),
    ("starving clients do not grow the pool beyond the maximum", (1, 4), 4, (1, 0), "starving", ("hold", 4, 4),
     "within thresholds"),
    ("clients that wait while workers are idle do not get more workers", (1, 8), 3, (1, 0), "client_bound",
     ("hold", 3, 3), "within thresholds"),
    ("a pool below the minimum is raised to it at once", (4, 8), 1, (1, 0), "idle", ("up", 1, 4),
     "below the minimum"),
    ("a pool above the maximum is lowered to it at once", (1, 3), 7, (1, 0), "starving", ("down", 7, 3),
     "above the maximum"),
]


@pytest.mark.parametrize("bounds, workers, clients, kind, decision, reason", [c[1:] for c in ONE_INTERVAL],
                         ids=[c[0].replace(" ", "_") for c in ONE_INTERVAL])
def test_one_interval_gives_the_decision_its_measurements_call_for(bounds, workers, clients, kind, decision, reason):
    scaler, svc = started(*bounds, workers=workers, clients=clients[0])
    svc.idle_clients = clients[1]
    d = scaler.step(getattr(svc, kind)(samples=100))
    assert moves(d) == decision and d["reason"] == reason


def test_fractions_are_measured_over_the_last_interval_not_since_the_start():
    scaler, svc = started(1, 8, workers=3)
    apply(svc, scaler.step(svc.client_bound()))  # a million seconds of waiting in the totals from now on
    assert moves(scaler.step(svc.idle())) == ("down", 3, 2)


def test_the_stall_is_the_wait_per_client_and_the_busy_fraction_the_work_per_worker():
    scaler, svc = started(1, 8, workers=4, clients=2)
    d = scaler.step(svc.interval(wait=LOTS, busy=LOTS))
    assert d["stall"] / d["busy"] == pytest.approx(4 / 2, rel=1e-3)


# ------------------------------------------------------------------ bounds

KINDS = ("starving", "idle", "client_bound")


@settings(max_examples=60, deadline=None)
@given(lo=st.integers(0, 3), span=st.integers(0, 4), start=st.integers(0, 7), clients=st.integers(0, 2),
       steps=st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from([0, 100])), min_size=1, max_size=25))
def test_the_worker_count_moves_toward_the_bounds_and_never_leaves_them(lo, span, start, clients, steps):
    hi = max(lo + span, 1)
    scaler, svc = started(lo, hi, workers=start, clients=clients)
    for kind, samples in steps:
        before = svc.workers
        d = apply(svc, scaler.step(getattr(svc, kind)(samples)))
        assert d["from"] == before
        assert (d["to"] == d["from"]) == (d["action"] == "hold")
        if lo <= before <= hi:
            assert lo <= d["to"] <= hi and abs(d["to"] - before) <= 1, d
        else:
            assert abs(d["to"] - min(max(before, lo), hi)) <= abs(before - min(max(before, lo), hi)), d


# ------------------------------------------------------------------ records and policy

def test_every_decision_is_counted_the_last_fifty_kept_and_the_last_twenty_shown():
    scaler, svc = started(1, 8, workers=3)
    seen: list[dict] = [scaler.step(svc.client_bound()) for _ in range(55)]
    assert scaler.counts == {"hold": 55}
    assert list(scaler.decisions) == seen[-50:]
    shown = scaler.status()
    assert shown["decisions"] == seen[-20:]
    assert {k: shown[k] for k in ("enabled", "min", "max", "interval_s", "counts")} == \
        {"enabled": True, "min": 1, "max": 8, "interval_s": 2.0, "counts": {"hold": 55}}


def test_a_policy_is_parsed_from_min_colon_max():
    p = AutoscalePolicy.parse("2:16", interval_s=0.5)
    assert (p.min_workers, p.max_workers, p.interval_s) == (2, 16, 0.5)
    assert (p.stall_high, p.stall_low, p.busy_high, p.busy_low, p.min_gain, p.cooldown_steps) == \
        (0.05, 0.01, 0.80, 0.50, 0.05, 3)


@pytest.mark.parametrize("text", ["4", "2-16", "a:b", "1:2:3", ""])
def test_a_policy_that_is_not_min_colon_max_is_refused(text):
    with pytest.raises(ValueError, match=r"--autoscale takes MIN:MAX \(e.g. 2:16\)"):
        AutoscalePolicy.parse(text)


@pytest.mark.parametrize("text", ["4:2", "-1:2", "0:0"])
def test_a_range_that_is_empty_or_negative_or_allows_no_worker_is_refused(text):
    with pytest.raises(ValueError, match="autoscale range must satisfy 0 <= MIN <= MAX, MAX >= 1"):
        AutoscalePolicy.parse(text)


def test_a_zero_interval_is_refused():
    with pytest.raises(ValueError, match="autoscale interval must be > 0"):
        AutoscalePolicy(1, 2, interval_s=0)
