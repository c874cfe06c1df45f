"""A live fuzz of a real service's data port: hostile peers beside an honest witness.

    python -m bench.live_fuzz --seconds 40 --seed 1

A service process (demo dataset, one decode worker, a short look for silent connections, bulk
lanes on, no address ever refused for stranded connections: the peers share the witness's) is
attacked for ``--seconds`` by ``--hostile`` peers, each a thread with a ``random.Random(seed + k)``
of its own, picking actions at random: valid Hellos, Hellos with hostile fields, Requests for its
own streams and for others' (past the end, repeated, after final), Releases, Byes, Describes,
raw msgpack headers with wrong types, the service's internal messages, random bytes, multi-frame
junk, bursts of up to 5,000 messages unread, reads of what waits or no reads for a while, closing
its socket (linger 0) and coming back under the same identity or a new one, a second connection
under its identity while the first still sends (a handover), the hand-made flood-and-reset peer
(testkit.hostile.flood_and_reset), garbage on the bulk-lane port and on the data port, and lanes
that said who they are and are never read.

Beside them a witness runs RemoteLoader epochs in turn over data frames, co-located (local=True)
and bulk lanes (lanes=2), and compares every batch, byte for byte, with the reference epochs
collected before the fuzz began (same seed and epoch: same order, same bytes).

``--skip ACTION,...`` leaves actions out (to look past one that takes the service down).

Prints one row: the hostile actions, the witness's epochs, mismatches and errors, whether the
service is alive (its exit code if not; then its totals as last read, marked *), its health and
totals, the connections it still counts once they have had time to drain (of them, stranded: cut,
and never closed by libzmq, dispatch/silence.py), and its RSS at the
start, peak and end. Then: each stretch of 10 s or more in which the witness got nothing, whether
a fresh loader's epoch after the fuzz is exact, the actions by kind and what the service
answered them. While it runs, stderr gets the peers' last actions whenever the service dies,
counts an internal error, loses its health or leaves the witness waiting. Exit status 0 only if
the service stayed alive, the witness (and the fresh loader) saw no mismatch and no error, and
the service counted no internal error.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import socket
import struct
import threading
import time
from collections import Counter, deque
from typing import Dict, Iterator, List, Optional

import msgpack
import psutil
import zmq

from bench.harness import command, log, machine, raise_on_sigterm, table_head, table_row
from client import RemoteLoader
from testkit.helpers import collect
from testkit.hostile import GREETING, flood_and_reset
from testkit.service import ServiceProcess
from wire import protocol as P
from wire.jobspec import JobSpec

DEMO_SIZE = 240
EPOCHS = (0, 1, 2)  # the witness's epochs, each compared with its reference
MODES: Dict[str, dict] = {"frames": {}, "local": {"local": True}, "lanes": {"lanes": 2}}
FIELDS = ("index", "indices", "images", "labels", "padding", "skipped", "shape")  # compared per batch
WITNESS_TIMEOUT_S = 120.0
JOIN_S = 15.0  # how long a hostile peer may take to stop after the deadline
STALL_S = 10.0  # the witness getting nothing this long is reported as it happens
STREAM_FIELDS = ("id", "epoch", "batch_size", "num_batches", "next_batch", "sent", "to_send", "unsent", "in_flight")
AFTER_TIMEOUT_S = 30.0  # a fresh loader's timeout once the fuzz is over
DEAD_JOIN_S = 10.0  # how long the witness may take to notice a dead service
SETTLE_S = 40.0  # how long its open connections may take to drain after the fuzz (libzmq: a 30 s handshake timeout)
MAX_HELD_LANES = 8  # lanes a peer keeps open unread at most
U64 = (1 << 64) - 1
T = P.MsgType
DROP = object()  # a raw header's field to leave out


def _spec(rng: random.Random, **kw) -> JobSpec:
    base = dict(batch_size=rng.choice([1, 2, 3, 4, 8, 16, 32]), image_size=32, seed=rng.randrange(4),
                shuffle=rng.random() < 0.8, drop_last=rng.random() < 0.3)
    base.update(kw)
    return JobSpec(**base)


def _raw(header: dict) -> bytes:
    """A msgpack header with any values at all (``v`` is the protocol's unless given; DROP leaves a field out)."""
    full = {"v": P.PROTOCOL_VERSION, **header}
    return msgpack.packb({k: v for k, v in full.items() if v is not DROP}, use_bin_type=True)


def _deep(depth: int):
    out: object = 0
    for _ in range(depth):
        out = [out]
    return out


def _raw_headers(rng: random.Random, stream: int) -> List[bytes]:
    """Headers of the right shape with the wrong types, values, versions and message types."""
    spec = {"batch_size": 4, "image_size": 32}
    return [
        _raw({"t": int(T.REQUEST), "stream": str(stream), "batches": [0]}),
        _raw({"t": int(T.REQUEST), "stream": stream, "batches": "0"}),
        _raw({"t": int(T.REQUEST), "stream": stream, "batches": [0.5, None, "x"]}),
        _raw({"t": int(T.REQUEST), "stream": True, "batches": [True, False]}),
        _raw({"t": int(T.REQUEST), "stream": U64, "batches": [U64]}),
        _raw({"t": int(T.REQUEST), "stream": -(1 << 63), "batches": [-1]}),
        _raw({"t": int(T.REQUEST), "stream": stream, "wait_s": rng.choice([float("nan"), float("inf"), -1.0])}),
        _raw({"t": int(T.REQUEST), "stream": stream, "h2d_s": "slow", "consumed": -5}),
        _raw({"t": int(T.REQUEST), "stream": stream, "released": {"a": 1}}),
        _raw({"t": int(T.REQUEST), "stream": stream, "released": list(range(P.MAX_WINDOW + 1))}),
        _raw({"t": int(T.REQUEST), "stream": stream, "batches": list(range(70000))}),
        _raw({"t": int(T.REQUEST), "stream": stream, "final": 1, "probe": "yes", "promote": None}),
        _raw({"t": int(T.REQUEST), "stream": stream, "no_such_field": 1}),
        _raw({"t": int(T.REQUEST)}),
        _raw({"t": int(T.HELLO), "stream": stream + 1, "spec": [16, 32]}),
        _raw({"t": int(T.HELLO), "stream": stream + 1, "spec": {"batch_size": "16"}}),
        _raw({"t": int(T.HELLO), "stream": stream + 1, "spec": {}}),
        _raw({"t": int(T.HELLO), "stream": stream + 1, "spec": {**spec, "pipeline_args": {"a": _deep(40)}}}),
        _raw({"t": int(T.HELLO), "stream": stream + 1, "spec": {**spec, "pipeline": "no-such", "scale": [0, 2]}}),
        _raw({"t": int(T.HELLO), "stream": stream + 1, "spec": {**spec, "ratio": [1e-9, 1e9]}}),
        _raw({"t": int(T.HELLO), "stream": stream + 1, "spec": {**spec, "world_size": 0}, "rank": -1}),
        _raw({"t": int(T.HELLO), "stream": stream + 1, "spec": spec, "batches": {"0": 1}, "window": -1}),
        _raw({"t": int(T.HELLO), "stream": stream + 1, "spec": spec, "job": b"\xff" * 10, "client": 7}),
        _raw({"t": int(T.HELLO), "stream": stream + 1}),
        _raw({"t": int(T.RELEASE), "stream": stream, "batches": list(range(20000))}),
        _raw({"t": int(T.RELEASE), "stream": stream, "batches": [0, 0]}),
        _raw({"t": int(T.DESCRIBE), "dataset": 5}),
        _raw({"t": int(T.DESCRIBE), "dataset": "no-such-dataset"}),
        _raw({"t": int(T.DESCRIBE), "pipeline": "x" * 1000, "pipeline_args": {"k": "v" * 1000}}),
        _raw({"t": int(T.BYE), "extra": 1}),
        _raw({"t": 2}),  # the old Credit
        _raw({"t": rng.choice([0, 7, 99, 255, -1, U64])}),
        _raw({"t": "5", "stream": stream}),
        _raw({"t": None}),
        _raw({"t": DROP, "stream": stream}),
        _raw({"v": rng.choice([5, 7, 0, "6", None]), "t": int(T.REQUEST), "stream": stream}),
        _raw({"v": DROP, "t": int(T.REQUEST), "stream": stream}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb("a header"),
        msgpack.packb(None),
        msgpack.packb({1: 2, 3: 4}),
        b"\x83\xa1v\x06\xa1t\x04\xa7dataset\xa2\xff\xfe",  # a map with a str that is not UTF-8
        b"\x82\xa1v\x06\xa1t",  # cut short
        b"\xdf\xff\xff\xff\xff",  # a map claiming 4 billion entries
        b"\xdd\xff\xff\xff\xff",  # an array claiming as many
    ]


def _service_messages(rng: random.Random) -> List[list]:
    """Messages only the service or its workers send, sent by a client."""
    return [
        P.encode(P.Ready(worker=rng.randrange(4), pid=os.getpid())),
        P.encode(P.Done(task=rng.randrange(100), worker=0, ok=rng.random() < 0.5)),
        P.encode(P.Task(task=1, dataset="demo", shm="loader-x", offset=0, indices=[0], seed=0, epoch=0)),
        P.encode(P.Stop()),
        P.encode(P.Unmap(shm=rng.choice(["loader-x", "../../etc/passwd", ""]))),
        P.encode(P.Accept(stream=1, epoch=0, num_batches=1, num_samples=1, dataset_length=1, dataset="demo")),
        P.encode(P.EndOfEpoch(stream=1, epoch=0, num_batches=1)),
        P.encode(P.Error(code="x", message="y")),
        P.encode(P.Batch(stream=1, epoch=0, index=0, indices=[0], shape=[1, 2, 2, 3]), b"\0" * 12, b"\0" * 8),
    ]


def _log_uniform(rng: random.Random, hi: int) -> int:
    return int(math.exp(rng.uniform(0.0, math.log(hi))))


# each action of a hostile peer (a method of Hostile) and how often it is picked, relatively
WEIGHTS = {
    "hello": 10, "hello_hostile": 5, "request": 14, "request_other": 4, "release": 4, "bye": 2, "describe": 2,
    "raw_header": 8, "service_message": 2, "random_bytes": 4, "multi_frame": 3, "big_message": 0.3, "burst": 3,
    "read": 14, "quiet": 3, "reconnect_same": 2, "reconnect_new": 2, "handover": 0.5, "flood_and_reset": 0.7,
    "lane_garbage": 2, "lane_hold": 1, "data_port_garbage": 1,
}


class Hostile(threading.Thread):
    """One hostile peer: random actions on its own DEALER until ``deadline`` (or ``stop``)."""

    def __init__(self, k: int, svc: ServiceProcess, lane_port: int, seed: int, deadline: float,
                 stop: threading.Event, journal: "Journal", skip: frozenset = frozenset()):
        super().__init__(name=f"hostile-{k}", daemon=True)
        self.k, self.endpoint, self.data_port, self.lane_port = k, svc.endpoint, svc.data_port, lane_port
        self.rng = random.Random(seed + k)
        self.deadline, self.stop = deadline, stop
        self.journal = journal
        self.actions: Counter = Counter()
        self.told: Counter = Counter()  # what the service answered, by kind
        self.fuzz_errors: Counter = Counter()  # exceptions in this peer's own code
        self.first_errors: List[str] = []
        self.identity = b""
        self.sock: Optional[zmq.Socket] = None
        self.held: List[socket.socket] = []  # lanes that said who they are, never read
        self.stream, self.num_batches, self.final = 0, 1, False
        self.local_batches: List[int] = []  # co-located batches handed over and not yet released
        self.weights = {getattr(self, name): w for name, w in WEIGHTS.items() if name not in skip}

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        acts, weights = list(self.weights), list(self.weights.values())
        try:
            self._connect(self.rng.randbytes(16))
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                act = self.rng.choices(acts, weights)[0]
                name = act.__name__
                self.actions[name] += 1
                self.journal.add(self.k, name)
                try:
                    act()
                except Exception as exc:  # a bug of the fuzz, or a socket the service cut: counted
                    self.fuzz_errors[type(exc).__name__] += 1
                    if len(self.first_errors) < 3:
                        self.first_errors.append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            self._close()

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _connect(self, identity: bytes) -> None:
        self._close()
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        # no receive cap: libzmq 4.3.5 can abort a process whose connection a cap stopped reading
        # once it is reset (issue 4841, docs/reliability.md): the peer must not take this process down
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.IDENTITY, identity)
        s.connect(self.endpoint)
        self.sock, self.identity = s, identity
        self.stream, self.num_batches, self.final, self.local_batches = 0, 1, False, []

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        for lane in self.held:
            lane.close()
        self.held = []

    def _send(self, frames: list) -> bool:
        """Without waiting: a full queue (or no connection yet) drops the message."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.actions["(send dropped: queue full)"] += 1
            return False

    def _batches(self, past_end: bool = True) -> list:
        top = self.num_batches + (3 if past_end else 0)
        return self.rng.sample(range(top), self.rng.randint(0, min(top, 8)))

    # ------------------------------------------------------------------ actions
    def hello(self) -> None:
        rng = self.rng
        world = rng.choice([1, 1, 1, 2, 3])
        spec = _spec(rng, world_size=world)
        last = self.stream  # the next, one skipped, the same again, an older one, or any
        self.stream = rng.choice([last + 1, last + 1, last + 2, last, max(0, last - 1), rng.randrange(1 << 31)])
        self.num_batches = max(1, math.ceil(DEMO_SIZE / world / spec.batch_size))
        self.final = False
        self._send(P.encode(P.Hello(stream=self.stream, spec=spec, epoch=rng.randrange(4), rank=rng.randrange(world),
                                    slots=rng.randint(1, 16), window=rng.choice([0, 1, 2, 4, 16, 64]),
                                    batches=self._batches(past_end=rng.random() < 0.2),
                                    lookahead=rng.random() < 0.2, local=rng.random() < 0.3,
                                    job=rng.choice(["", "", "fuzz", f"fuzz-{self.k}"]),
                                    client=rng.choice(["", f"peer-{self.k}", "shared"]))))

    def hello_hostile(self) -> None:
        """Hellos with fields out of range (encode checks nothing; the service must)."""
        rng = self.rng
        spec = _spec(rng)
        self.stream += 1
        bad = rng.choice([
            dict(batches=[rng.choice([1 << 62, U64, 1 << 40])]),
            dict(batches=[-1, -5]),
            dict(batches=list(range(20000))),
            dict(window=rng.choice([P.MAX_WINDOW + 1, 1 << 40, -1])),
            dict(window=0, batches=list(range(min(self.num_batches, 60)))),
            dict(slots=rng.choice([0, 257, 1 << 30, -3])),
            dict(epoch=rng.choice([-1, 1 << 31, 1 << 62])),
            dict(rank=rng.choice([1, 5, -1])),
            dict(origin=rng.choice([-1, 1 << 40, DEMO_SIZE * 2])),
            dict(entry=rng.choice([-1, 1 << 40])),
            dict(stream=rng.choice([-1, U64, 0])),
            dict(spec=JobSpec(batch_size=rng.choice([0, 1 << 17, -4]), image_size=32)),
            dict(spec=JobSpec(batch_size=1 << 16, image_size=4096), slots=256),  # terabytes a stream
            dict(spec=JobSpec(batch_size=256, image_size=1024), slots=64),  # past the memory cap
            dict(spec=JobSpec(batch_size=4, image_size=rng.choice([0, 7, 1 << 20]))),
            dict(spec=JobSpec(batch_size=4, image_size=32, world_size=1 << 20), rank=(1 << 20) - 1),
            dict(spec=JobSpec(batch_size=4, image_size=32, shuffle_window=rng.choice([-1, 1 << 40]))),
            dict(spec=JobSpec(batch_size=4, image_size=32, dataset=rng.choice(["no-such", "", "../x" * 100]))),
            dict(job="j" * 300, client="c" * 100),
        ])
        fields = dict(stream=self.stream, spec=spec, slots=4, batches=[0])
        fields.update(bad)
        self._send(P.encode(P.Hello(**fields)))

    def request(self) -> None:
        rng = self.rng
        pick = rng.random()
        if pick < 0.5:
            batches = self._batches()
        elif pick < 0.6:
            b = rng.randrange(self.num_batches)
            batches = [b, b]  # a batch twice
        elif pick < 0.7:
            start = rng.randrange(self.num_batches + 2)
            batches = list(range(start, start + _log_uniform(rng, 5000)))
        else:
            batches = []
        final = rng.random() < 0.15
        released = rng.sample(self.local_batches, min(len(self.local_batches), rng.randint(0, 3)))
        self.local_batches = [b for b in self.local_batches if b not in released]
        if rng.random() < 0.1:
            released.append(rng.randrange(self.num_batches + 5))  # one never handed over
        self._send(P.encode(P.Request(stream=self.stream, batches=batches, final=final, probe=rng.random() < 0.1,
                                      promote=rng.random() < 0.1, consumed=rng.randrange(50),
                                      wait_s=rng.random(), released=sorted(set(released)))))
        self.final = self.final or final

    def request_other(self) -> None:
        stream = self.rng.choice([0, self.stream - 1, self.stream + 1, self.rng.randrange(1 << 31), U64 >> 1])
        self._send(P.encode(P.Request(stream=max(0, stream), batches=self._batches())))

    def release(self) -> None:
        rng = self.rng
        if self.local_batches and rng.random() < 0.5:
            batches, self.local_batches = self.local_batches, []
        else:
            batches = self._batches()
        stream = self.stream if rng.random() < 0.8 else rng.randrange(1 << 31)
        self._send(P.encode(P.Release(stream=stream, batches=batches)))

    def bye(self) -> None:
        self._send(P.encode(P.Bye()))

    def describe(self) -> None:
        self._send(P.encode(self.rng.choice([P.Describe(), P.Describe(dataset="demo"), P.Describe(dataset="nope"),
                                             P.Describe(pipeline="no-such", pipeline_args={"a": 1})])))

    def raw_header(self) -> None:
        frames = [self.rng.choice(_raw_headers(self.rng, self.stream))]
        if self.rng.random() < 0.2:
            frames += [self.rng.randbytes(self.rng.randrange(64)) for _ in range(self.rng.randint(1, 3))]
        self._send(frames)

    def service_message(self) -> None:
        self._send(self.rng.choice(_service_messages(self.rng)))

    def random_bytes(self) -> None:
        self._send([self.rng.randbytes(_log_uniform(self.rng, 4096) - 1)])

    def multi_frame(self) -> None:
        rng = self.rng
        frames = [rng.randbytes(rng.randrange(100)) for _ in range(rng.randint(2, 20))]
        if rng.random() < 0.5:  # a valid header with data frames no message of its kind takes
            frames[0] = P.encode_header(P.Request(stream=self.stream, batches=[0]))
        self._send(frames)

    def big_message(self) -> None:
        """A header past MAX_HEADER_BYTES, or a message past the socket's cap."""
        if self.rng.random() < 0.5:
            self._send([b"\xc1" * (P.MAX_HEADER_BYTES + 1)])
        else:
            self._send([b"\0" * (P.MAX_CLIENT_MESSAGE_BYTES + 1)])

    def burst(self) -> None:
        """Up to 5,000 messages in a row, nothing read."""
        rng = self.rng
        kind = rng.choice(["request", "junk", "describe", "hello", "release"])
        frames = {"request": lambda: P.encode(P.Request(stream=self.stream, batches=self._batches())),
                  "junk": lambda: [b"\xc1"],
                  "describe": lambda: P.encode(P.Describe()),
                  "hello": lambda: P.encode(P.Hello(stream=self.stream + 1, spec=_spec(rng), batches=[0])),
                  "release": lambda: P.encode(P.Release(stream=self.stream, batches=[0]))}[kind]()
        for _ in range(_log_uniform(rng, 5000)):
            if not self._send(frames):
                break
        self.actions[f"burst:{kind}"] += 1

    def read(self) -> None:
        """What is waiting, without waiting."""
        for _ in range(self.rng.randint(1, 1000)):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = P.decode(frames)[0]
            except P.ProtocolError:
                self.told["(undecodable)"] += 1
                continue
            self.told[type(msg).__name__ + (f":{msg.code}" if isinstance(msg, P.Error) else "")] += 1
            if isinstance(msg, P.Accept) and msg.stream == self.stream:
                self.num_batches = max(1, msg.num_batches)
                self.lane_port = msg.lanes or self.lane_port
            elif isinstance(msg, P.Batch) and msg.local:
                self.local_batches.append(msg.index)

    def quiet(self) -> None:
        """Neither read nor send for a while."""
        self.stop.wait(min(self._left(), self.rng.uniform(0.0, 0.5)))

    def reconnect_same(self) -> None:
        self._connect(self.identity)

    def reconnect_new(self) -> None:
        self._connect(self.rng.randbytes(16))

    def handover(self) -> None:
        """A second connection under this peer's identity while the first still sends (the data
        port's ROUTER_HANDOVER gives the identity to the new one), then the first closed with
        linger 0: a reset, as the service's answers wait unread on it."""
        old, self.sock = self.sock, None
        try:
            for burst in (self.rng.randint(100, 1000), self.rng.randint(100, 3000)):
                for _ in range(burst):
                    old.send(b"\xc1", zmq.NOBLOCK)
                if self.sock is None:
                    self._connect(self.identity)
            self.stop.wait(min(self._left(), 0.02))
        except zmq.Again:
            self.actions["(send dropped: queue full)"] += 1
        finally:
            old.close(0)
            if self.sock is None:
                self._connect(self.identity)

    def flood_and_reset(self) -> None:
        flood_and_reset(self.data_port, messages=self.rng.choice([100, 1000, 5000, 20000]),
                        ping_every=self.rng.choice([0, 1, 10, 100]),
                        body=self.rng.choice([b"\xc1", b"", P.encode_header(P.Describe())]))

    def _lane(self, rst: bool = False) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.lane_port), timeout=min(2.0, self._left() + 0.1))
        if rst:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return s

    def lane_garbage(self) -> None:
        """Garbage on the lane port, or a lane hello that lies, then a close (a FIN or a reset)."""
        if not self.lane_port:
            self.actions["(no lane port)"] += 1
            return
        rng = self.rng
        with self._lane(rst=rng.random() < 0.5) as s:
            pick = rng.random()
            if pick < 0.3:
                s.sendall(rng.randbytes(rng.randrange(200)))
            elif pick < 0.6:
                ident = self.identity if rng.random() < 0.5 else rng.randbytes(16)
                lanes = rng.randint(1, P.MAX_LANES)
                hello = struct.pack("<4s16sBBI", rng.choice([P.LANE_MAGIC, b"RLL0"]), ident,
                                    rng.randrange(256), lanes, rng.randrange(1 << 32))
                s.sendall(hello + rng.randbytes(rng.randrange(64)))
            elif pick < 0.8:
                s.sendall(P.LANE_MAGIC + self.identity[:rng.randrange(16)])  # a hello cut short
            # else: connect and say nothing

    def lane_hold(self) -> None:
        """A lane for this peer's own connection, which never reads what it is sent."""
        if not self.lane_port:
            self.actions["(no lane port)"] += 1
            return
        if len(self.held) >= MAX_HELD_LANES:
            self.held.pop(0).close()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(2.0)
        try:
            s.connect(("127.0.0.1", self.lane_port))
            s.sendall(P.lane_hello(self.identity, 0, 1, self.rng.randrange(1 << 32)))
        except OSError:
            s.close()
            raise
        self.held.append(s)

    def data_port_garbage(self) -> None:
        """Random bytes on the data port (libzmq takes most for a ZMTP 1.0 peer: no greeting, its
        first byte a frame's length), or a ZMTP 3 greeting cut short; then a reset."""
        with socket.create_connection(("127.0.0.1", self.data_port), timeout=2.0) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            if self.rng.random() < 0.5:
                s.sendall(self.rng.randbytes(self.rng.randrange(1, 300)))
            else:
                s.sendall(GREETING[:11])  # the signature and the major version, no more


# --------------------------------------------------------------------------- the witness
def _differ(ref: List[dict], got: List[dict]) -> str:
    """The first difference between two epochs as :func:`collect` keeps them ("" if none)."""
    if len(ref) != len(got):
        return f"{len(got)} batches, the reference {len(ref)}"
    for k, (a, b) in enumerate(zip(ref, got)):
        for name in FIELDS:
            if a[name] != b[name]:
                return f"batch {k}: {name} differs"
    return ""


class Witness(threading.Thread):
    """Epochs through RemoteLoaders until the deadline, each compared with its reference. Where
    it is (``at``) and when it last got a batch or started a loader (``progressed``) are kept for
    the watch, which reports a stall."""

    def __init__(self, endpoint: str, seed: int, refs: Dict[int, List[dict]], t0: float, deadline: float,
                 stop: threading.Event):
        super().__init__(name="witness", daemon=True)
        self.endpoint, self.seed, self.refs, self.stop = endpoint, seed, refs, stop
        self.t0, self.deadline = t0, deadline
        self.epochs: Counter = Counter()  # by mode
        self.local_batches = 0
        self.mismatches: List[str] = []
        self.errors: List[str] = []
        self.at, self.progressed = "starting", time.monotonic()

    def _over(self) -> bool:
        return self.stop.is_set() or time.monotonic() >= self.deadline

    def _step(self, at: str) -> None:
        self.at, self.progressed = at, time.monotonic()

    def _batches(self, loader: RemoteLoader, where: str) -> Iterator:
        """``loader``'s batches, each one noted as progress."""
        self._step(f"{where}, waiting for batch 0")
        for k, batch in enumerate(loader):
            self._step(f"{where}, waiting for batch {k + 1} (of {len(self.refs[0])})")
            yield batch

    def _note(self, kind: str, text: str) -> None:
        log(f"witness {kind} at {time.monotonic() - self.t0:.1f}s: {text}")

    def run(self) -> None:
        turn = 0
        while not self._over():
            mode = list(MODES)[turn % len(MODES)]
            turn += 1
            try:
                self._step(f"{mode}: starting a loader")
                with RemoteLoader(self.endpoint, batch_size=16, image_size=32, timeout=WITNESS_TIMEOUT_S,
                                  seed=self.seed, epoch_lookahead=False, **MODES[mode]) as ld:
                    for epoch in EPOCHS:
                        if self._over():
                            break
                        ld.set_epoch(epoch)
                        diff = _differ(self.refs[epoch], collect(self._batches(ld, f"{mode} epoch {epoch}")))
                        self.epochs[mode] += 1
                        if diff:
                            self.mismatches.append(f"{mode} epoch {epoch}: {diff}")
                            self._note("mismatch", f"{mode} epoch {epoch}: {diff}")
                    self.local_batches += ld.stats()["local_batches"]
            except Exception as exc:
                self.errors.append(f"{self.at}: {type(exc).__name__}: {exc}")
                self._note("error", self.errors[-1])
                self.stop.wait(0.5)


def _fresh_epoch(endpoint: str, seed: int, ref: List[dict]) -> str:
    """One epoch of a new loader once the fuzz is over: "exact", or what went wrong."""
    try:
        with RemoteLoader(endpoint, batch_size=16, image_size=32, timeout=AFTER_TIMEOUT_S, seed=seed,
                          epoch_lookahead=False) as ld:
            ld.set_epoch(0)
            return _differ(ref, collect(ld)) or "exact"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def references(endpoint: str, seed: int) -> Dict[int, List[dict]]:
    """Each of :data:`EPOCHS` collected over data frames before any hostile peer starts."""
    with RemoteLoader(endpoint, batch_size=16, image_size=32, timeout=WITNESS_TIMEOUT_S, seed=seed,
                      epoch_lookahead=False) as ld:
        out = {}
        for epoch in EPOCHS:
            ld.set_epoch(epoch)
            out[epoch] = collect(ld)
        return out


# --------------------------------------------------------------------------- the run
class Journal:
    """The hostile peers' latest actions, (when, peer, action): what preceded anything the
    service did wrong."""

    def __init__(self, t0: float, size: int = 400):
        self.t0, self._lock, self._items = t0, threading.Lock(), deque(maxlen=size)

    def add(self, peer: int, action: str) -> None:
        with self._lock:
            self._items.append((time.monotonic(), peer, action))

    def dump(self, n: int) -> None:
        with self._lock:
            last = list(self._items)[-n:]
        log("  " + "; ".join(f"{when - self.t0:.2f}s peer {k} {name}" for when, k, name in last))


class Watch:
    """The service and the witness watched while the fuzz runs: the service's RSS peak, its
    status each second (an internal error or lost health logged with the actions before it, the
    last totals kept for when it dies), the moment it died, and each time the witness got nothing
    for :data:`STALL_S` (logged with what the service says of its clients and the actions before)."""

    def __init__(self, svc: ServiceProcess, journal: Journal):
        self.svc, self.journal = svc, journal
        self.proc = psutil.Process(svc.proc.pid)
        self.rss_start = self.peak = self.proc.memory_info().rss
        self.last: Optional[dict] = _status(svc)  # the latest status read
        self.last_at = 0.0
        self.died_at: Optional[float] = None
        self.stalls: Dict[float, list] = {}  # the witness's last progress -> [where, seconds without any]
        self.at_deadline: Optional[dict] = None  # the totals as the hostile peers stopped

    def run_until(self, deadline: float, witness: "Witness") -> None:
        """Until the deadline, and after it while the witness finishes its epoch."""
        internal, healthy, next_status = 0, True, 0.0
        last_call = deadline + WITNESS_TIMEOUT_S + 30
        while time.monotonic() < deadline or witness.is_alive() and time.monotonic() < last_call:
            time.sleep(0.2)
            if self.svc.proc.poll() is not None:
                self.died_at = time.monotonic()
                log(f"the service died at {self.died_at - self.journal.t0:.1f}s (exit code "
                    f"{self.svc.proc.returncode}); the last actions:")
                self.journal.dump(60)
                return
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                continue
            if time.monotonic() < next_status:
                continue
            next_status = time.monotonic() + 1.0
            st = _status(self.svc)
            if st is None:
                continue
            self.last, self.last_at = st, time.monotonic() - self.journal.t0
            if self.at_deadline is None and time.monotonic() >= deadline:
                self.at_deadline = st["totals"]
            if st["totals"]["internal_errors"] > internal or st["healthy"] != healthy:
                internal, healthy = st["totals"]["internal_errors"], st["healthy"]
                log(f"at {self.last_at:.1f}s: internal_errors {internal}, healthy {healthy} ({st['problem']!r}); "
                    "the last actions:")
                self.journal.dump(30)
            self._stall(st, witness)

    def _stall(self, st: dict, witness: "Witness") -> None:
        since, at = witness.progressed, witness.at
        stalled = time.monotonic() - since
        if stalled < STALL_S or not witness.is_alive():
            return
        if since in self.stalls:
            self.stalls[since][1] = stalled
            return
        self.stalls[since] = [at, stalled]
        log(f"at {self.last_at:.1f}s: the witness has got nothing for {stalled:.0f}s ({at}); the service: "
            f"connections {st['connections']}, workers {st['workers']['counts']}, totals "
            + ", ".join(f"{k} {st['totals'][k]}" for k in TOTALS) + "; its clients:")
        for c in st["clients"]:
            stream = c["stream"] and {k: c["stream"][k] for k in STREAM_FIELDS}
            log(f"  {c['client']} job {c['job']!r}, {c['connected_s']}s connected, {c['batches']} batches, "
                f"slots {c['slots']!r}, delivery {c['delivery']!r}, stream {stream}")
        log("the last actions:")
        self.journal.dump(40)


def _status(svc: ServiceProcess) -> Optional[dict]:
    try:
        return svc.status()
    except Exception:  # gone, or too busy to answer within its timeout
        return None


def _mib(rss: int) -> float:
    return round(rss / 2**20, 1)


def _counts(counter: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items()))


TOTALS = ("internal_errors", "floods_cut", "silent_cut", "flooded_messages", "stale_messages", "bad_messages",
          "refused_asks")


def _unsettled(st: dict) -> int:
    """Open connections but the stranded ones (which stay open until the service stops)."""
    return st["connections"]["open"] - st["connections"]["stranded"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live_fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hostile", type=int, default=4, help="hostile peers (threads)")
    p.add_argument("--heartbeat", type=float, default=0.05,
                   help="how often the service looks for silent connections (its --heartbeat), seconds")
    p.add_argument("--skip", default="", metavar="ACTION,...",
                   help=f"actions the hostile peers leave out, of: {', '.join(WEIGHTS)}")
    a = p.parse_args(argv)
    skip = frozenset(filter(None, a.skip.split(",")))
    if skip - WEIGHTS.keys():
        p.error(f"no such action: {', '.join(sorted(skip - WEIGHTS.keys()))}")
    raise_on_sigterm()
    print(command("bench.live_fuzz", argv), machine(), sep="\n")
    svc = ServiceProcess(args=["--demo", "--demo-size", str(DEMO_SIZE), "--workers", "1", "--heartbeat",
                               str(a.heartbeat), "--lane-port", "0", "--max-stranded-per-address", "0"],
                         drain=True, ready_timeout=180)
    stop = threading.Event()
    peers: List[Hostile] = []
    try:
        refs = references(svc.endpoint, a.seed)
        t0 = time.monotonic()
        deadline = t0 + a.seconds
        journal = Journal(t0)
        watch = Watch(svc, journal)
        lane_port = (watch.last or {}).get("lane_port") or 0
        peers = [Hostile(k, svc, lane_port, a.seed, deadline, stop, journal, skip) for k in range(a.hostile)]
        witness = Witness(svc.endpoint, a.seed, refs, t0, deadline, stop)
        for t in [*peers, witness]:
            t.start()
        watch.run_until(deadline, witness)
        stop.set()  # before the deadline if the service died
        for t in peers:
            t.join(JOIN_S)
        witness.join(DEAD_JOIN_S)  # done unless it waits on a dead service (for its whole timeout)
        time.sleep(1.0)  # what the peers sent last, read; their connections closed
        alive = svc.proc.poll() is None
        st = _status(svc) if alive else None
        drained = time.monotonic()
        while st and _unsettled(st) and time.monotonic() < drained + SETTLE_S:
            time.sleep(0.5)  # a connection that never sent a message is let go of later
            st = _status(svc)
        drained = time.monotonic() - drained
        after = _fresh_epoch(svc.endpoint, a.seed, refs[0]) if alive else "-"
        if alive and after != "exact":
            witness.errors.append(f"a fresh loader after the fuzz: {after}")
        rss_end = watch.proc.memory_info().rss if alive else 0
        peak = max(watch.peak, rss_end)
        # a dead service's totals: as last read, marked with a *
        totals, mark = ((st or {}).get("totals", {}), "") if alive else ((watch.last or {}).get("totals", {}), "*")
        actions: Counter = sum((t.actions for t in peers), Counter())
        hostile_actions = sum(v for k, v in actions.items() if not k.startswith(("(", "burst:")))
        print(table_head(["seconds", "seed", "hostile actions", "witness epochs", "witness mismatches",
                          "witness errors", "service alive (exit code)", "healthy", *TOTALS,
                          "open (stranded) connections at end (waited)", "RSS start/peak/end MiB"],
                         "rrrrrrllrrrrrrrrl"))
        print(table_row([a.seconds, a.seed, hostile_actions, sum(witness.epochs.values()), len(witness.mismatches),
                         len(witness.errors), "yes" if alive else f"no ({svc.proc.returncode})",
                         st["healthy"] if st else "-", *(f"{totals.get(k, '-')}{mark}" for k in TOTALS),
                         f"{st['connections']['open']} ({st['connections']['stranded']}) ({drained:.1f} s)"
                         if st else "-",
                         f"{_mib(watch.rss_start)} / {_mib(peak)} / {_mib(rss_end) if alive else '-'}"]))
        print()
        if st and _unsettled(st):  # what the count stands for: sockets, or only its bookkeeping
            sockets = Counter(c.status for c in watch.proc.net_connections("tcp")
                              if c.laddr.port == svc.data_port and c.status != psutil.CONN_LISTEN)
            print(f"the service counts {st['connections']} on its data port after {drained:.0f} s; "
                  f"its TCP sockets there: {_counts(sockets) or 'none'}; its clients: "
                  + "; ".join(f"{c['client']} ({c['connected_s']}s connected, {c['batches']} batches, stream "
                              f"{c['stream'] and c['stream']['id']})" for c in st["clients"]))
        print(f"a fresh loader's epoch 0 after the fuzz: {after}")
        if watch.died_at is not None:
            print(f"the service died {watch.died_at - t0:.1f}s into the fuzz (exit code {svc.proc.returncode}); "
                  f"* its totals as last read, {watch.last_at:.1f}s in")
        for since, (at, seconds) in watch.stalls.items():
            print(f"the witness got nothing for {seconds:.0f} s from {since - t0:.1f}s in ({at})")
        late = {k: v - watch.at_deadline.get(k, 0) for k, v in (watch.last or {}).get("totals", {}).items()
                if watch.at_deadline and isinstance(v, int) and v != watch.at_deadline.get(k, 0)}
        if late and watch.stalls:  # the hostile peers had stopped: the witness's own messages
            print(f"counted after the deadline (the witness alone): {_counts(Counter(late))}")
        print("witness epochs by mode: " + ", ".join(f"{m} {witness.epochs[m]}" for m in MODES)
              + f" ({witness.local_batches} batches read in place)")
        print(f"actions: {_counts(actions)}")
        print(f"the service answered: {_counts(sum((t.told for t in peers), Counter()))}")
        fuzz_errors: Counter = sum((t.fuzz_errors for t in peers), Counter())
        if fuzz_errors:
            print(f"exceptions in the peers' actions: {_counts(fuzz_errors)}; first: "
                  + " | ".join(e for t in peers for e in t.first_errors[:1]))
        for line in witness.mismatches + witness.errors:
            print(f"witness: {line}")
        stuck = [t.name for t in [*peers, witness] if t.is_alive()]
        if stuck:
            print(f"threads still running after the deadline: {', '.join(stuck)}")
        ok = alive and not witness.mismatches and not witness.errors and totals.get("internal_errors") == 0
        if not ok or (st and not st["healthy"]):
            log(f"status problem: {(st or {}).get('problem', '-')!r}; the service's stderr (last lines):")
            log("\n".join(svc.stderr_tail))
        return 0 if ok else 1
    finally:
        stop.set()
        for t in peers:
            t.join(JOIN_S)
        svc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
