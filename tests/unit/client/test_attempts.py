"""client/attempts.py: what a try that ends before its handshake leads to. A close, a stranger,
a silent peer or a broken handshake is retried with backoff; only a CURVE greeting read by a
probe, then one more close, refuses (a CURVE client); the timeout message counts what was met."""

import errno

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from client.attempts import BASE_S, MAX_S, PROBE_AFTER, Attempts, Probe, Refuse, Retry
from client.curve import SIGNATURE, parse_greeting

EP = "tcp://h:1"


def close(a: Attempts, now: float = 0.0, value: int = errno.EPIPE):
    a.connected()
    a.failed(value)
    return a.disconnected(now)


def test_closes_are_retried_with_backoff_and_counted():
    a = Attempts(EP, None)

    def retry(now: float) -> Retry:  # a proxy without a backend: a probe of its greeting reads nothing
        action = close(a, now)
        return a.probed(None, now) if isinstance(action, Probe) else action

    delays = [round(retry(10.0).at - 10.0, 6) for _ in range(8)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    assert a.summary() == f"connections to {EP} were accepted and closed 8 times"


def test_each_kind_of_early_end_is_named():
    a = Attempts(EP, None)
    a.connected()
    assert isinstance(a.disconnected(0), Retry)  # no handshake event: libzmq cut a peer that is not ZMTP
    close(a, value=errno.EAGAIN)  # the handshake deadline
    a.connected()
    a.failed(0x11000001, protocol=True)
    assert isinstance(a.disconnected(0), Retry)
    close(a)
    assert a.summary() == (f"connections to {EP} were answered with a broken ZeroMQ handshake 1 time, accepted and "
                           "closed 1 time, accepted with no ZeroMQ handshake within its deadline 1 time, answered "
                           "with something that is not ZeroMQ 1 time")


def test_a_plain_client_is_never_refused_by_closes_alone():
    a = Attempts(EP, None)
    for _ in range(50):
        action = close(a)
        assert isinstance(action, (Retry, Probe))
        if isinstance(action, Probe):  # what the probe read is the only thing that can refuse it
            assert isinstance(a.probed(None, 1.0), Retry) and isinstance(a.probed("NULL", 1.0), Retry)


def test_a_plain_client_whose_probe_reads_a_curve_greeting_is_told_the_service_requires_keys():
    """A busy CURVE service may close a plain client's handshake before libzmq reads the
    mechanism (no mismatch event: the container suite's 'accepted and closed 34 times')."""
    a = Attempts(EP, None)
    assert [type(close(a)) for _ in range(PROBE_AFTER)] == [Retry] * (PROBE_AFTER - 1) + [Probe]
    refused = a.probed("CURVE", 1.0)
    assert isinstance(refused, Refuse) and refused.message == (
        f"authentication failed: the service at {EP} requires CURVE keys (its greeting says CURVE); pass "
        "curve_keys=DIR (client.key_secret + server.key) or set LOADER_CURVE_KEYS")


def test_a_lost_connection_is_not_a_try():
    a = Attempts(EP, None)
    close(a)
    a.connected()
    a.succeeded()
    assert a.summary() == "" and a.streak == 0
    assert a.disconnected(5.0) is None  # the loader's business (libzmq retries it)
    assert isinstance(close(a, 6.0), Retry) and a.streak == 1


def test_a_curve_client_probes_after_closes_in_a_row_and_is_refused_only_after_a_curve_greeting():
    a = Attempts(EP, "/keys")
    assert [type(close(a)) for _ in range(PROBE_AFTER)] == [Retry] * (PROBE_AFTER - 1) + [Probe]
    assert a.probed(None, 1.0) == Retry(1.0 + a.backoff())  # nothing there that speaks: a proxy, say
    assert isinstance(close(a), Probe)
    assert a.probed("CURVE", 2.0) == Retry(2.0)  # a CURVE service answered: try again at once
    refused = close(a)
    assert isinstance(refused, Refuse)
    assert refused.message == (f"authentication failed: the service at {EP} speaks CURVE (its greeting says so) and "
                               f"closed this client's CURVE handshake {PROBE_AFTER + 2} times in a row: "
                               "/keys/server.key is not that service's key")


def test_a_curve_greeting_then_a_success_is_no_refusal():
    a = Attempts(EP, "/keys")
    for _ in range(PROBE_AFTER):
        close(a)
    a.probed("CURVE", 0.0)
    a.connected()
    a.succeeded()  # the backend came back between the probe and the try
    assert not a.curve_seen and isinstance(close(a), Retry)


def test_a_curve_client_finding_a_plain_greeting_is_refused():
    a = Attempts(EP, "/keys")
    for _ in range(PROBE_AFTER):
        close(a)
    refused = a.probed("NULL", 0.0)
    assert isinstance(refused, Refuse) and "does not (its greeting says NULL" in refused.message


@pytest.mark.parametrize("data, mechanism", [
    (SIGNATURE + b"\x03\x00" + b"CURVE".ljust(20, b"\0"), "CURVE"),
    (SIGNATURE + b"\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0" * 32, "NULL"),
    (SIGNATURE + b"\x03\x00" + b"CUR", None),  # cut short
    (b"HTTP/1.1 400 Bad Request\r\n\r\n".ljust(32, b" "), None),
    (SIGNATURE[:9] + b"\x00\x03\x00" + b"NULL".ljust(20, b"\0"), None),  # ZMTP 1.0 framing, not a greeting
    (SIGNATURE + b"\x02\x00" + b"NULL".ljust(20, b"\0"), None),  # ZMTP 2: no mechanism
    (SIGNATURE + b"\x03\x00" + b"\xffCURVE".ljust(20, b"\0"), None),
    (b"", None),
])
def test_parse_greeting(data, mechanism):
    assert parse_greeting(data) == mechanism


class AttemptsModel(RuleBasedStateMachine):
    """Random interleavings of libzmq's events and probe results: a refusal only ever follows a
    greeting that says so; a retry is never later than the backoff cap; the summary counts
    every try that ended before its handshake since the last success."""

    def __init__(self):
        super().__init__()
        self.keys = None
        self.a = Attempts(EP, None)
        self.now = 0.0
        self.ended = 0  # tries ended before their handshake since the last success
        self.up = self.handshaked = False
        self.pending_probe = False
        self.curve_greeting = False  # a probe read CURVE, and no try ended since

    @rule(keys=st.booleans())
    def restart(self, keys):
        self.__init__()
        self.keys = "/k" if keys else None
        self.a = Attempts(EP, self.keys)

    @rule(dt=st.floats(0, 5))
    def time_passes(self, dt):
        self.now += dt

    @rule()
    def connected(self):
        if not self.pending_probe:
            self.a.connected()
            self.up, self.handshaked = True, False

    @rule(value=st.sampled_from([errno.EPIPE, errno.ECONNRESET, errno.EAGAIN]), protocol=st.booleans())
    def failed(self, value, protocol):
        if self.up and not self.handshaked:
            self.a.failed(value, protocol)

    @rule()
    def succeeded(self):
        if self.up and not self.handshaked:
            self.a.succeeded()
            self.handshaked, self.ended, self.curve_greeting = True, 0, False

    @rule()
    def disconnected(self):
        if not self.up:
            return
        self.up = False
        action = self.a.disconnected(self.now)
        if self.handshaked:
            assert action is None
            return
        self.ended += 1
        self._check(action, after_close=True)

    @rule(mechanism=st.sampled_from([None, "CURVE", "NULL"]))
    def probed(self, mechanism):
        if not self.pending_probe:
            return
        self.pending_probe = False
        action = self.a.probed(mechanism, self.now)
        if isinstance(action, Refuse):  # the greeting's mechanism is not this client's
            assert mechanism == ("NULL" if self.keys is not None else "CURVE")
            self.refused()
            return
        self._check(action)
        self.curve_greeting = mechanism == "CURVE"

    def _check(self, action, after_close=False):
        if isinstance(action, Probe):
            assert self.a.streak >= PROBE_AFTER
            self.pending_probe = True
        elif isinstance(action, Refuse):
            assert self.keys is not None and after_close and self.curve_greeting
            self.refused()
        else:
            assert isinstance(action, Retry) and self.now <= action.at <= self.now + MAX_S
            if after_close:
                self.curve_greeting = False

    def refused(self):
        self.restart(self.keys is not None)  # final: the loader raises; a new one starts afresh

    @invariant()
    def counts_what_was_met(self):
        assert sum(self.a.counts.values()) == self.ended == self.a.streak
        assert (self.a.summary() == "") == (self.ended == 0)
        assert BASE_S <= self.a.backoff() <= MAX_S


TestAttemptsModel = AttemptsModel.TestCase
TestAttemptsModel.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
