"""Looking up the names a loader follows (:mod:`client.membership`): which endpoints are names,
and one lookup of them at a time on a background thread, so that a slow resolver never stalls
the trainer.

Two resolvers:

* the system's (``socket.getaddrinfo``), by default: /etc/hosts, the search domains of
  /etc/resolv.conf (a Kubernetes pod's ``loader-headless`` is found in its namespace), NSS;
  it has no deadline of its own, so the thread may outlive the loader's wait for it (the
  loader goes on with its current replicas, and starts no second lookup meanwhile);
* one DNS server asked directly (``dns_server="host:port"``, or ``LOADER_DNS_SERVER``), through
  dnspython, with a deadline per lookup: for a resolver on a port other than 53 (a test's
  dnsmasq on loopback), which getaddrinfo cannot be pointed at. Names are asked as given
  (absolute, no search domains).

Only IPv4 addresses (A records) are taken: the loader's sockets connect over IPv4, as libzmq's
do by default.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from typing import Dict, Mapping, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from client.membership import Answer

DNS_SERVER_ENV = "LOADER_DNS_SERVER"


def follows(endpoint: str) -> bool:
    """Whether ``endpoint`` is ``tcp://NAME:port`` with a host name (not an address) to look up."""
    u = urlsplit(endpoint)
    if u.scheme != "tcp" or not u.hostname:
        return False
    try:
        ipaddress.ip_address(u.hostname)
        return False
    except ValueError:
        return u.hostname != "*"


def host_port(endpoint: str) -> Tuple[str, int]:
    """``tcp://host:port`` -> (host, port); a ValueError otherwise."""
    u = urlsplit(endpoint)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or not port:
        raise ValueError(f"expected tcp://host:port, got {endpoint!r}")
    return u.hostname, port


def endpoint_of(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def parse_server(server: str) -> Tuple[str, int]:
    """``"ip"`` or ``"ip:port"`` (port 53 if none) of a DNS server; a ValueError naming the setting otherwise."""
    host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "53")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(f"dns_server ({DNS_SERVER_ENV}) must be an IP address with an optional :port, "
                         f"got {server!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"dns_server ({DNS_SERVER_ENV}): port out of range in {server!r}")
    return host, number


def default_server() -> Optional[str]:
    return os.environ.get(DNS_SERVER_ENV) or None


def lookup(endpoint: str, server: Optional[str], timeout: float) -> Answer:
    """The endpoints ``endpoint``'s name resolves to (IPv4, on its port), or why none."""
    host, port = host_port(endpoint)
    try:
        if server is None:
            infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
            addresses = {i[4][0] for i in infos}
        else:
            addresses = _ask_server(host, server, timeout)
    except socket.gaierror as exc:
        return f"{host}: {exc.strerror or exc}"
    except Exception as exc:  # dnspython's timeouts and malformed answers: the name resolved to nothing
        return f"{host}: {type(exc).__name__}: {exc}"[:300]
    return frozenset(endpoint_of(a, port) for a in addresses)


def _ask_server(host: str, server: str, timeout: float) -> set:
    import dns.exception
    import dns.resolver

    ip, port = parse_server(server)
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.port = [ip], port
    try:
        answer = resolver.resolve(host.rstrip(".") + ".", "A", lifetime=timeout, search=False)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return set()
    except dns.exception.Timeout:
        raise TimeoutError(f"no answer from the DNS server at {server} within {timeout:g}s") from None
    return {r.address for r in answer}


class Lookups:
    """One lookup of all ``names`` at a time, on a daemon thread: :meth:`start` it, then
    :meth:`result` says what it found once it finished (None until then)."""

    def __init__(self, names: Sequence[str], server: Optional[str], timeout: float):
        self.names, self.server, self.timeout = tuple(names), server, timeout
        if server is not None:
            parse_server(server)  # a bad setting is an error at once, not a name that never resolves
        self._done: Optional[Dict[str, Answer]] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._done = None
            self._thread = threading.Thread(target=self._run, name="loader-dns", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self._done = {n: lookup(n, self.server, self.timeout) for n in self.names}

    def result(self) -> Optional[Mapping[str, Answer]]:
        """The finished lookup's answers (each once), or None while it runs or if none was started."""
        if self._thread is None or self._done is None:
            return None
        self._thread.join()  # it has finished: its result is set last
        done, self._done, self._thread = self._done, None, None
        return done

    def now(self, deadline_s: float) -> Optional[Mapping[str, Answer]]:
        """Start a lookup (if none runs) and wait for it up to ``deadline_s``."""
        self.start()
        assert self._thread is not None
        self._thread.join(deadline_s)
        return self.result()


__all__ = ["follows", "host_port", "endpoint_of", "lookup", "Lookups", "DNS_SERVER_ENV", "parse_server"]
