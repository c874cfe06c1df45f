"""A real DNS server on loopback for the fleet tests: Debian's dnsmasq, serving only the records of
a hosts file that the test rewrites (dnsmasq rereads it on SIGHUP), on 127.0.0.1:<free port>.

Skipped with the reason when dnsmasq is missing, unless ``LOADER_REQUIRE_DNS=1`` (CI installs it
with .ci/dns-prereqs.sh), which makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, Iterable, Optional, Sequence

import pytest

REQUIRED = os.environ.get("LOADER_REQUIRE_DNS", "") not in ("", "0", "false", "no")
START_S = 10.0


def dnsmasq_or_skip() -> str:
    path = shutil.which("dnsmasq") or next((p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.path.exists(p)),
                                           None)
    if path is None:
        why = "dnsmasq is not installed (apt-get install dnsmasq-base, or bash .ci/dns-prereqs.sh)"
        if REQUIRED:
            pytest.fail(f"DNS tests required (LOADER_REQUIRE_DNS=1) but {why}", pytrace=False)
        pytest.skip(why)
    return path


def port_free_on(hosts: Sequence[str], kinds: Sequence[int] = (socket.SOCK_STREAM,)) -> int:
    """A port free right now on every one of ``hosts`` for every socket kind in ``kinds``
    (the fleet's services share one port on 127.0.0.1-3; dnsmasq needs UDP and TCP)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, kinds[0]) as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for host in hosts:
                for kind in kinds:
                    with socket.socket(socket.AF_INET, kind) as s:
                        s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on {', '.join(hosts)}")


class DnsServer:
    """dnsmasq answering A records from a hosts file: :meth:`set` rewrites it (name -> addresses)
    and waits until the server answers with the new records. ``server`` is the
    ``ip:port`` for the loader's ``dns_server``."""

    def __init__(self):
        binary = dnsmasq_or_skip()
        self.dir = tempfile.mkdtemp(prefix="loader-dns-")
        self.hosts = os.path.join(self.dir, "hosts")
        self.port = port_free_on(["127.0.0.1"], (socket.SOCK_DGRAM, socket.SOCK_STREAM))
        self.server = f"127.0.0.1:{self.port}"
        self._write({})
        cmd = [binary, "--no-daemon", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}",
               f"--port={self.port}", "--listen-address=127.0.0.1", "--bind-interfaces", "--pid-file=",
               "--local-ttl=0", "--cache-size=0"]
        if os.geteuid() == 0:
            cmd.append("--user=root")  # keep reading the hosts file we own (it drops to nobody otherwise)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            self._wait(lambda answer: answer is not None, "dnsmasq to answer")
        except BaseException:
            self.close()
            raise

    def _write(self, records: Dict[str, Iterable[str]]) -> None:
        tmp = self.hosts + ".tmp"
        with open(tmp, "w") as f:
            for name, addresses in records.items():
                for a in addresses:
                    f.write(f"{a} {name}\n")
        os.replace(tmp, self.hosts)

    def set(self, records: Dict[str, Iterable[str]]) -> None:
        """Serve ``records`` from now on (the names not listed resolve to nothing)."""
        records = {k: sorted(v) for k, v in records.items()}
        self._write(records)
        self.proc.send_signal(signal.SIGHUP)
        for name, addresses in records.items():
            self._wait(lambda answer, want=set(addresses): answer == want, f"dnsmasq to serve {name} -> {addresses}",
                       name)

    def ask(self, name: str) -> Optional[set]:
        """The addresses dnsmasq gives for ``name`` now; None if it does not answer."""
        import dns.exception
        import dns.resolver

        r = dns.resolver.Resolver(configure=False)
        r.nameservers, r.port = ["127.0.0.1"], self.port
        try:
            return {a.address for a in r.resolve(name + ".", "A", lifetime=0.5, search=False)}
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer, dns.resolver.NoNameservers):
            return set()  # NoNameservers: it answered REFUSED (no upstream for names it does not hold)
        except dns.exception.DNSException:
            return None

    def _wait(self, ok, what: str, name: str = "probe.invalid") -> None:
        deadline = time.monotonic() + START_S
        while not ok(self.ask(name)):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"dnsmasq exited with {self.proc.returncode}: {err.strip()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {START_S}s waiting for {what}")
            time.sleep(0.02)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "DnsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
