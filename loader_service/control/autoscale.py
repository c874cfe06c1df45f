"""Autoscaling: DataLoader's "tune num_workers by experiment", done continuously.

Every interval the autoscaler measures, over that interval, the clients' stall fraction (time
trainers spent waiting in ``next()``), the workers' busy fraction and the delivered rate, and
hill-climbs the worker count:

* clients starve and workers are saturated   -> add a worker, then check the next interval
  that the rate really rose (by ``min_gain``); if not, take it back and hold for a while
  (more workers than cores, or a client-side bottleneck, does not help);
* clients never wait and workers are mostly idle -> remove a worker (it leaves after its task, nothing lost);
* no clients at all                             -> step down toward the minimum;
* otherwise hold.

Each decision, with its measurements and reason, is logged, counted in metrics and kept in
status. It reads nothing but a :class:`~loader_service.dispatch.status.ServiceStatus` snapshot;
:func:`loader_service.control.operate.autoscale_step` builds that snapshot and applies the
decision on the dispatcher thread, like every other state change.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Deque, Optional

if TYPE_CHECKING:
    from loader_service.dispatch.status import ServiceStatus

log = logging.getLogger("loader_service.control.autoscale")


@dataclass(frozen=True)
class AutoscalePolicy:
    min_workers: int
    max_workers: int
    interval_s: float = 2.0
    stall_high: float = 0.05  # clients waiting >5% of the time: they starve
    stall_low: float = 0.01
    busy_high: float = 0.80  # workers busy >80%: they are the bottleneck
    busy_low: float = 0.50
    min_gain: float = 0.05  # a scale-up must raise the rate by 5% or it is undone
    cooldown_steps: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(f"autoscale range must satisfy 0 <= MIN <= MAX, MAX >= 1; got "
                             f"{self.min_workers}:{self.max_workers}")
        if self.interval_s <= 0:
            raise ValueError("autoscale interval must be > 0")

    @classmethod
    def parse(cls, text: str, interval_s: float = 2.0) -> "AutoscalePolicy":
        try:
            lo, hi = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"--autoscale takes MIN:MAX (e.g. 2:16), got {text!r}") from None
        return cls(lo, hi, interval_s)


class Autoscaler:
    def __init__(self, policy: AutoscalePolicy):
        self.policy = policy
        self.decisions: Deque[dict] = deque(maxlen=50)
        self.counts: Counter = Counter()
        self._last: Optional[dict] = None
        self._probe: Optional[dict] = None  # the scale-up being judged: rate before it
        self._cooldown = 0

    @staticmethod
    def _measure(st: "ServiceStatus") -> dict:
        return {"t": time.monotonic(), "samples": st.totals.samples, "wait": st.stage_s.client_wait,
                "busy": st.workers.busy_s_total, "workers": st.workers.live,
                "clients": st.clients_streaming}

    def step(self, st: "ServiceStatus") -> Optional[dict]:
        """Decide from a status snapshot. Returns the decision (None on the first call); the
        caller scales the pool to ``decision["to"]`` when it differs from ``decision["from"]``."""
        now, last = self._measure(st), self._last
        self._last = now
        if last is None:
            return None
        dt = max(now["t"] - last["t"], 1e-6)
        rate = (now["samples"] - last["samples"]) / dt
        stall = (now["wait"] - last["wait"]) / (dt * max(now["clients"], 1))
        busy = (now["busy"] - last["busy"]) / (dt * max(now["workers"], 1))
        n, p = now["workers"], self.policy
        action, target, reason = "hold", n, "within thresholds"
        if self._probe is not None:
            before = self._probe["rate"]
            self._probe = None
            # a gain is a rise: from a rate of 0 (tasks longer than an interval), 0 again is none
            gained = rate >= before * (1 + p.min_gain) if before > 0 else rate > 0
            if not gained and n > p.min_workers:
                action, target = "revert", n - 1
                reason = f"rate {rate:.0f}/s did not beat {before:.0f}/s by {p.min_gain:.0%} after the last worker"
                self._cooldown = p.cooldown_steps
            elif not gained:
                reason = (f"rate {rate:.0f}/s did not beat {before:.0f}/s after the last worker, but the pool is "
                          "at its minimum")
            else:
                reason = f"last scale-up raised the rate {before:.0f} -> {rate:.0f}/s"
        elif self._cooldown > 0:
            self._cooldown -= 1
            reason = "cooling down after a revert"
        elif n < p.min_workers:
            action, target, reason = "up", p.min_workers, "below the minimum"
        elif n > p.max_workers:
            action, target, reason = "down", p.max_workers, "above the maximum"
        elif now["clients"] == 0:
            if n > p.min_workers:
                action, target, reason = "down", n - 1, "no clients"
        elif stall > p.stall_high and busy > p.busy_high and n < p.max_workers:
            action, target = "up", n + 1
            reason = f"clients stall {stall:.0%} of the time and workers are {busy:.0%} busy"
            self._probe = {"rate": rate}
        elif stall < p.stall_low and busy < p.busy_low and n > p.min_workers:
            action, target = "down", n - 1
            reason = f"clients stall {stall:.1%} and workers are only {busy:.0%} busy"
        decision = {"time": time.time(), "action": action, "from": n, "to": target, "reason": reason,
                    "stall": round(stall, 4), "busy": round(busy, 4), "rate": round(rate, 1)}
        self.counts[action] += 1
        self.decisions.append(decision)
        if target != n:
            log.info("autoscale %s: %d -> %d workers (%s)", action, n, target, reason)
        return decision

    def status(self) -> dict:
        p = self.policy
        return {"enabled": True, "min": p.min_workers, "max": p.max_workers, "interval_s": p.interval_s,
                "counts": dict(self.counts), "decisions": list(self.decisions)[-20:]}


def make_autoscaler(config) -> Optional["Autoscaler"]:
    """The autoscaler ``config.autoscale`` asks for (``MIN:MAX``), or None when it is off."""
    if not config.autoscale:
        return None
    return Autoscaler(AutoscalePolicy.parse(config.autoscale, config.autoscale_interval_s))
