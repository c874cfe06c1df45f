"""``loader-service status`` and ``loader-service scale N``: the REST API from a terminal."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Optional


def request(url: str, method: str = "GET", body: Optional[dict] = None, token: Optional[str] = None,
            timeout: float = 10.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("detail", detail)
        except (ValueError, AttributeError):
            pass
        raise SystemExit(f"loader-service: {method} {url} -> HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SystemExit(f"loader-service: cannot reach {url}: {reason} (is the service running? --url / LOADER_URL)") from None


def add_token_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default=os.environ.get("LOADER_API_TOKEN_FILE"), metavar="FILE",
                   help="read the API token from FILE (env LOADER_API_TOKEN_FILE); else the env LOADER_API_TOKEN. "
                        "There is no --token: a command line is visible to every user in ps")
    p.add_argument("--token", help=argparse.SUPPRESS)  # refused with the reason (see token_of)


def token_of(args) -> str:
    """The API token for ``scale``: LOADER_API_TOKEN, else the token file, else the token a service
    on this machine generated for that port (its file, when this user owns it)."""
    if args.token is not None:
        raise SystemExit("loader-service scale: --token is not accepted (the command line shows in ps); "
                         "set LOADER_API_TOKEN or use --token-file FILE")
    token = os.environ.get("LOADER_API_TOKEN", "")
    if token:
        return token
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise SystemExit(f"loader-service scale: cannot read the token file {args.token_file}: {exc.strerror}")
        if token:
            return token
        raise SystemExit(f"loader-service scale: the token file {args.token_file} is empty")
    generated = _generated_token(args.url)
    if generated:
        return generated
    raise SystemExit("loader-service scale: needs the API token: set LOADER_API_TOKEN or use --token-file FILE "
                     "(a service that generated its token logs the file it wrote it to)")


def _generated_token(url: str) -> str:
    """The token a service on this machine generated for the REST port of ``url`` (its
    loader-api-token-PORT file, if this user owns it), or ''."""
    from urllib.parse import urlsplit

    from loader_service.control.auth import read_own_token, token_file_name

    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        return ""
    return read_own_token(token_file_name(port, ""))


def run_operator(args) -> int:
    base = args.url.rstrip("/")
    if args.command == "scale":
        out = request(f"{base}/v1/workers", "PUT", {"count": args.count}, token_of(args))
        print(json.dumps(out) if args.json else f"workers: {out['previous']} -> {out['target']}")
        return 0
    st = request(f"{base}/v1/status")
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(format_status(st))
    return 0


def format_status(st: dict) -> str:
    w, t = st["workers"], st["totals"]
    lines = [
        f"service {st['instance']}  up {st['uptime_s']:.0f}s  data port {st['data_port']}"
        + (" (CURVE)" if st.get("data_port_curve") else "")
        + (f", lane port {st['lane_port']} ({st.get('lanes_open', 0)} lanes open)" if st.get("lane_port", -1) >= 0 else ""),
        "datasets: " + ", ".join(f"{n} ({d['length']} samples)" for n, d in st["datasets"].items()),
        f"workers: target {w['target']}  " + "  ".join(f"{k} {v}" for k, v in sorted(w["counts"].items()))
        + f"  deaths {w['deaths']}" + (f"  BROKEN: {w['broken'].splitlines()[0]}" if w.get("broken") else ""),
        f"throughput: {st['throughput']['samples_per_s']:.1f} samples/s  delivered {t['samples']} samples "
        f"in {t['batches']} batches  skipped {t['skipped']}  bad messages {t['bad_messages']}",
        "stage seconds: " + "  ".join(f"{k} {v:.1f}" for k, v in st["stage_s"].items()),
    ]
    a = st.get("autoscaler", {})
    if a.get("enabled"):
        last = a["decisions"][-1] if a["decisions"] else None
        lines.append(f"autoscaler {a['min']}:{a['max']}" + (f"  last: {last['action']} {last['from']}->{last['to']}"
                                                             f" ({last['reason']})" if last else ""))
    more = st["clients_total"] - st["clients_listed"]
    lines.append(f"clients: {st['clients_total']}" + (f" (the {st['clients_listed']} busiest listed)" if more else ""))
    for c in st["clients"]:
        s = c["stream"]
        where = (f"rank {s['rank']}/{s['world_size']} epoch {s['epoch']} batch {s['next_batch']}/{s['num_batches']}"
                 f" stall {s['wait_s']:.1f}s, {c['delivery']}" if s else "idle")
        lines.append(f"  {c['client']} job {c['job'] or '-'}: {where}  ({c['samples']} samples)")
    return "\n".join(lines)


