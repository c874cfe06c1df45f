"""``loader-service status`` and ``loader-service scale N``: the REST API from a terminal."""

from __future__ import annotations

import json
import sys
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


def run_operator(args) -> int:
    base = args.url.rstrip("/")
    if args.command == "scale":
        if not args.token:
            raise SystemExit("loader-service scale: needs the API token (--token or LOADER_API_TOKEN)")
        out = request(f"{base}/v1/workers", "PUT", {"count": args.count}, args.token)
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
        f"service {st['instance']}  up {st['uptime_s']:.0f}s  data port {st['data_port']}",
        f"datasets: " + ", ".join(f"{n} ({d['length']} samples)" for n, d in st["datasets"].items()),
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
    lines.append(f"clients: {len(st['clients'])}")
    for c in st["clients"]:
        s = c["stream"]
        where = (f"rank {s['rank']}/{s['world_size']} epoch {s['epoch']} batch {s['next_batch']}/{s['num_batches']}"
                 f" stall {s['wait_s']:.1f}s" if s else "idle")
        lines.append(f"  {c['client']} job {c['job'] or '-'}: {where}  ({c['samples']} samples)")
    return "\n".join(lines)


