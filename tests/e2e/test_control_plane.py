"""REST control plane: live scaling keeps exactly-once, auth, validation, metrics, autoscaler."""

from testkit.paths import REPO_ROOT
import itertools
import json
import os
import stat
import subprocess
import sys
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from client import RemoteLoader
from loader_service.control.http_api import scale_request_model

from tests.conftest import DEMO_SIZE
from testkit.helpers import status, wait_for

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KW = dict(batch_size=8, image_size=32, seed=1)


@pytest.fixture
def svc(make_service):
    return make_service(workers=1, api_token=TOKEN)


def put_workers(svc, count, headers=AUTH):
    return httpx.put(f"{svc.http_url}/v1/workers", json={"count": count}, headers=headers, timeout=10)


def test_scaling_1_4_1_3_mid_epoch_with_two_clients_keeps_exactly_once(svc):
    a = RemoteLoader(svc.endpoint, **KW, job="a")
    b = RemoteLoader(svc.endpoint, **dict(KW, batch_size=12, seed=2), job="b")
    got = {"a": [], "b": []}
    plan = {3: 4, 8: 1, 14: 3}  # at step -> scale to
    with a, b:
        ia, ib = iter(a), iter(b)
        done = {"a": False, "b": False}
        step = 0
        while not all(done.values()):
            for name, it in (("a", ia), ("b", ib)):
                if not done[name]:
                    try:
                        got[name].extend(next(it).indices)
                    except StopIteration:
                        done[name] = True
            if step in plan:
                r = put_workers(svc, plan[step])
                assert r.status_code == 200, r.text
                assert r.json()["target"] == plan[step]
            step += 1
    assert sorted(got["a"]) == list(range(DEMO_SIZE))
    assert sorted(got["b"]) == list(range(DEMO_SIZE))
    wait_for(lambda: status(svc)["workers"]["counts"] == {"idle": 3}, what="3 idle workers")
    assert status(svc)["workers"]["deaths"] == 0  # scale-down drained, it never killed


def test_scale_up_starts_taking_tasks(svc):
    assert put_workers(svc, 3).status_code == 200
    wait_for(lambda: status(svc)["workers"]["counts"].get("idle", 0) == 3, what="3 idle workers")
    with RemoteLoader(svc.endpoint, **KW, epoch_lookahead=False) as ld:  # count one epoch's tasks only
        assert sorted(i for b in ld for i in b.indices) == list(range(DEMO_SIZE))
    tasks = [w["tasks_done"] for w in status(svc)["workers"]["list"]]
    assert sum(tasks) == DEMO_SIZE // 8 and sum(1 for t in tasks if t) >= 2


@pytest.mark.parametrize("headers, code, detail", [
    ({}, 401, "missing Authorization header"),
    ({"Authorization": "Basic abc"}, 401, "must be 'Bearer <token>'"),
    ({"Authorization": "Bearer wrong"}, 403, "wrong API token"),
])
def test_mutations_need_the_token(svc, headers, code, detail):
    r = put_workers(svc, 2, headers)
    assert r.status_code == code and detail in r.json()["detail"]
    assert status(svc)["workers"]["target"] == 1


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b'{"count": "many"}', b""])
def test_auth_is_checked_before_the_body_is_read(svc, content):
    url = f"{svc.http_url}/v1/workers"
    r = httpx.put(url, content=content, headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    r = httpx.put(url, content=content, headers={"Content-Type": "application/json", **{"Authorization": "Bearer x"}},
                  timeout=10)
    assert r.status_code == 403
    r = httpx.put(url, content=content, headers={"Content-Type": "application/json", **AUTH}, timeout=10)
    assert r.status_code in (400, 422)  # with the token, the body's own error
    assert status(svc)["workers"]["target"] == 1


@pytest.mark.parametrize("body, field", [
    ({"count": -1}, "count"), ({"count": "many"}, "count"), ({}, "count"), ({"count": 2, "extra": 1}, "extra"),
    ({"count": 10**6}, "count"), ({"count": 257}, "count"),  # above the service's max_workers (256)
    ({"count": "2"}, "count"), ({"count": 2.0}, "count"), ({"count": False}, "count"),  # strict: not counts
])
def test_bad_bodies_get_422_naming_the_field(svc, body, field):
    r = httpx.put(f"{svc.http_url}/v1/workers", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 422
    assert any(field in str(e["loc"]) for e in r.json()["detail"])
    assert status(svc)["workers"]["target"] == 1  # refused: nothing changed


def test_read_only_endpoints_are_open_and_ready_reports_workers(svc):
    wait_for(lambda: httpx.get(f"{svc.http_url}/readyz", timeout=10).status_code == 200, what="readiness")
    r = httpx.get(f"{svc.http_url}/readyz", timeout=10).json()
    assert r["ready"] and r["data_port"] == svc.dispatcher.data_port
    assert httpx.get(f"{svc.http_url}/healthz", timeout=10).json() == {"status": "ok", "problem": ""}
    schema = httpx.get(f"{svc.http_url}/openapi.json", timeout=10).json()
    assert "/v1/workers" in schema["paths"]
    count = schema["components"]["schemas"]["ScaleRequest"]["properties"]["count"]
    assert (count["type"], count["minimum"], count["maximum"]) == ("integer", 0, svc.config.max_workers)
    assert httpx.get(f"{svc.http_url}/docs", timeout=10).status_code == 200


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_metrics_exist_and_move(svc):
    before = httpx.get(f"{svc.http_url}/metrics", timeout=10).text
    for name in ("loader_samples_total", "loader_batches_total", "loader_workers_target", "loader_clients",
                 'loader_stage_seconds_total{stage="client_wait"}', 'loader_workers{state="idle"}'):
        metric(before, name)
    assert metric(before, "loader_samples_total") == 0
    with RemoteLoader(svc.endpoint, **KW, epoch_lookahead=False) as ld:  # exactly one epoch's samples
        for _ in ld:
            pass
    put_workers(svc, 2)
    after = httpx.get(f"{svc.http_url}/metrics", timeout=10).text
    assert metric(after, "loader_samples_total") == DEMO_SIZE
    assert metric(after, "loader_batches_total") == DEMO_SIZE // 8
    assert metric(after, "loader_workers_target") == 2
    assert metric(after, 'loader_stage_seconds_total{stage="decode_augment"}') > 0
    assert metric(after, 'loader_stage_seconds_total{stage="client_wait"}') > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "PUT", "POST", "DELETE"]),
       path=st.sampled_from(["/healthz", "/readyz", "/v1/status", "/v1/workers", "/metrics", "/v1/nope", "/docs"]),
       body=st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                         lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                         max_leaves=6),
       auth=st.sampled_from([None, "Bearer test-token", "Bearer x", "junk"]))
def test_fuzzed_requests_never_get_5xx(svc, method, path, body, auth):
    headers = {"Authorization": auth} if auth else {}
    if method == "PUT" and path == "/v1/workers" and isinstance(body, dict) and isinstance(body.get("count"), int):
        body = dict(body, count=body["count"] % 4)  # keep the machine sane if it is valid
    r = httpx.request(method, f"{svc.http_url}{path}", json=body, headers=headers, timeout=10)
    if path == "/readyz" and method == "GET" and r.status_code == 503:
        assert r.json()["reason"], r.text  # an earlier example scaled the pool to 0: not ready, and says why
        return
    assert r.status_code < 500, (method, path, body, r.status_code, r.text)


# Codes a schema-generated request may honestly get besides the ones its operation documents:
# 400 is FastAPI's "There was an error parsing the body" for a body it cannot decode (bytes that are not UTF-8),
# 422 FastAPI's validation error (documented already for every operation that takes input). 401/403/409 are
# documented on PUT /v1/workers; 404/405 cannot happen, every request goes to a path and method of the schema.
UNDOCUMENTED_OK_WITH_BODY = {400, 422}
# Schema-driven auth variants; "generated" keeps whatever Authorization schemathesis made (or left out).
AUTH_VARIANTS = {"valid": f"Bearer {TOKEN}", "wrong": "Bearer wrong-token", "missing": None, "generated": ...}


def _clamp_scale(case, max_workers):
    """Keep PUT /v1/workers cheap: a body the service would accept (checked with the service's own model)
    with a count in 4..max_workers gets count % 4, so the fuzzer asks for at most 3 worker processes
    instead of up to 256. Everything else is left alone: it must get 401/403/422 and spawn nothing."""
    if case.operation.label != "PUT /v1/workers":
        return case
    body = case.body
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return case
    try:
        count = scale_request_model(max_workers).model_validate(body).count
    except ValidationError:
        return case
    if 3 < count <= max_workers:
        case.body = dict(body, count=count % 4)
    return case


def test_schema_fuzzed_requests_never_get_5xx(svc):
    """Every operation of the live /openapi.json, fuzzed from the schema itself (schemathesis): valid and
    invalid inputs, with the right, a wrong, no or a generated token. No 5xx (the one documented 5xx, 503 of
    GET /readyz while no worker is up, must be that readiness answer), and no status code nobody explains."""
    schema = schemathesis.openapi.from_url(f"{svc.http_url}/openapi.json", timeout=10)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.label for op in ops} >= {"GET /healthz", "GET /readyz", "GET /v1/status", "PUT /v1/workers",
                                        "GET /metrics"}
    ops.sort(key=lambda op: op.method.upper() == "GET")  # mutate first: the reads then see a churned pool
    max_workers = svc.config.max_workers
    for op in ops:
        takes_input = bool(op.body) or any(True for _ in op.iter_parameters())
        responses = schema.raw_schema["paths"][op.path][op.method.lower()]["responses"]
        allowed = {int(code) for code in responses if code.isdigit()}
        if op.body:
            allowed |= UNDOCUMENTED_OK_WITH_BODY
        # an operation with no input has nothing to make invalid: negative generation is unsatisfiable there
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if takes_input else [])
        for mode, auth in itertools.product(modes, AUTH_VARIANTS):
            # database=None: this inner test is one function for every operation, and the example database
            # keys on the function, so stored examples would be replayed into other operations
            @settings(max_examples=(30 if auth == "valid" else 12) if takes_input else 2, deadline=None,
                      database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
            @given(case=op.as_strategy(generation_mode=mode).map(lambda c: _clamp_scale(c, max_workers)))
            def one(case):
                value = AUTH_VARIANTS[auth]
                if value is not ...:
                    case.headers.pop("Authorization", None)  # a case-insensitive dict
                    if value is not None:
                        case.headers["Authorization"] = value
                r = case.call(base_url=svc.http_url, timeout=10)
                where = (f"{mode.value}, {auth} token, body {case.body!r}: {case.as_curl_command()}\n"
                         f"-> {r.status_code} {r.text[:500]}")  # the repr: curl shows raw bytes lossily
                if op.label == "GET /readyz" and r.status_code == 503:  # documented: not ready (e.g. scaled to 0)
                    assert r.json()["ready"] is False and r.json()["reason"], where
                else:
                    case.validate_response(r, checks=[not_a_server_error])
                assert r.status_code in allowed, where
                if r.status_code == 400:
                    assert r.json()["detail"] == "There was an error parsing the body", where

            one()


def test_operator_cli_status_and_scale(svc, tmp_path):
    root = REPO_ROOT
    env = dict(os.environ, PYTHONPATH=root, LOADER_URL=svc.http_url, LOADER_API_TOKEN=TOKEN)
    run = lambda *a, **e: subprocess.run([sys.executable, "-m", "loader_service", *a], capture_output=True,  # noqa
                                         text=True, env=dict(env, **e), timeout=60)
    r = run("scale", "2")
    assert r.returncode == 0 and "workers: 1 -> 2" in r.stdout
    r = run("status")
    assert r.returncode == 0 and "workers: target 2" in r.stdout and "demo (240 samples)" in r.stdout
    r = run("scale", "2", LOADER_API_TOKEN="wrong")
    assert r.returncode != 0 and "HTTP 403: wrong API token" in r.stderr
    # the token never goes on the command line (ps shows it to every user): refused with the reason
    r = run("scale", "2", "--token", TOKEN)
    assert r.returncode != 0 and "--token is not accepted (the command line shows in ps)" in r.stderr
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    r = run("scale", "1", "--token-file", str(token_file), LOADER_API_TOKEN="")
    assert r.returncode == 0 and "workers: 2 -> 1" in r.stdout, r.stderr
    r = run("scale", "1", LOADER_API_TOKEN="")
    assert r.returncode != 0 and "set LOADER_API_TOKEN or use --token-file FILE" in r.stderr
    r = run("scale", "--help")
    assert "--token-file" in r.stdout and "never on the command line" in r.stdout
    r = run("status", "--url", "http://127.0.0.1:9")
    assert r.returncode != 0 and "cannot reach http://127.0.0.1:9" in r.stderr


def test_manual_scaling_refused_while_autoscaling(make_service):
    svc = make_service(workers=1, api_token=TOKEN, autoscale="1:2", autoscale_interval_s=60)
    r = put_workers(svc, 2)
    assert r.status_code == 409 and "autoscaler manages the worker count (1:2)" in r.json()["detail"]


def decisions(svc):
    return status(svc)["autoscaler"]["decisions"]


def test_autoscaler_scales_up_when_a_fast_consumer_starves(make_service):
    svc = make_service(workers=1, autoscale="1:2", autoscale_interval_s=0.4)
    with RemoteLoader(svc.endpoint, batch_size=8, image_size=64, prefetch=8) as ld:
        deadline = time.monotonic() + 60
        while status(svc)["workers"]["target"] < 2 and time.monotonic() < deadline:
            for _ in ld:  # consume as fast as possible: the trainer waits on every batch
                if status(svc)["workers"]["target"] >= 2:
                    break
    assert status(svc)["workers"]["target"] == 2
    ups = [d for d in decisions(svc) if d["action"] == "up"]
    assert ups and ups[0]["from"] == 1 and ups[0]["to"] == 2 and "stall" in ups[0]["reason"]


def test_autoscaler_scales_down_when_the_consumer_is_slow(make_service):
    svc = make_service(workers=2, autoscale="1:2", autoscale_interval_s=0.4)
    with RemoteLoader(svc.endpoint, batch_size=4, image_size=32, prefetch=2) as ld:
        deadline = time.monotonic() + 60
        for _ in ld:
            time.sleep(0.1)  # a slow model step: the loader is never the bottleneck
            if status(svc)["workers"]["target"] == 1 or time.monotonic() > deadline:
                break
    assert status(svc)["workers"]["target"] == 1
    downs = [d for d in decisions(svc) if d["action"] == "down"]
    assert downs and downs[0]["from"] == 2 and "busy" in downs[0]["reason"]
    assert 'loader_autoscaler_decisions_total{action="down"}' in httpx.get(f"{svc.http_url}/metrics", timeout=10).text


def test_bad_autoscale_range_is_refused():
    from loader_service.config import ServiceConfig

    with pytest.raises(ValueError, match="MIN:MAX"):
        ServiceConfig(demo=True, autoscale="4")
    with pytest.raises(ValueError, match="0 <= MIN <= MAX"):
        ServiceConfig(demo=True, autoscale="4:2")


def test_token_sources(tmp_path, caplog):
    from loader_service.control.auth import check_bearer, resolve_token

    assert resolve_token("abc", None)[:2] == ("abc", "LOADER_API_TOKEN")
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert resolve_token("", str(f))[:2] == ("from-file", str(f))
    with pytest.raises(ValueError, match="cannot read the API token file"):
        resolve_token("", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        resolve_token("", str(tmp_path / "empty"))
    with caplog.at_level("WARNING", logger="loader_service.control.auth"):
        token, where, path = resolve_token("", "")
    try:
        # logs are shipped to aggregators: the log names the 0600 file, never the token
        assert where == "generated" and len(token) >= 24 and token not in caplog.text and path in caplog.text
        assert open(path).read().strip() == token and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        os.unlink(path)
    assert check_bearer(f"Bearer {token}", token) is None
    assert check_bearer(f"bearer {token}", token) is None


def test_status_says_how_each_client_gets_its_batches(make_service):
    """``clients[].delivery`` in /v1/status (and the status page and ``loader-service status``):
    in place for a co-located loader, bulk lanes for one on lanes, data frames for the rest."""
    from loader_service.cli.operator import format_status

    svc = make_service(lane_port=0)
    kw = dict(batch_size=8, image_size=32, prefetch=1, epoch_lookahead=False, timeout=60)
    loaders = [RemoteLoader(svc.endpoint, job="frames", **kw), RemoteLoader(svc.endpoint, job="lanes", lanes=2, **kw),
               RemoteLoader(svc.endpoint, job="local", local=True, **kw)]
    try:
        its = [iter(ld) for ld in loaders]
        for it in its:
            next(it)  # each streams, and holds its iterator mid-epoch
        want = {"frames": "data frames", "lanes": "bulk lanes (2)", "local": "in place"}
        wait_for(lambda: {c["job"]: c["delivery"] for c in status(svc)["clients"]} == want, timeout=30,
                 what=f"the status to say {want}")  # (a lane set is listed once all its lanes are here)
        text = format_status(status(svc))
        for job, how in want.items():
            assert any(f"job {job}:" in line and f", {how}  (" in line for line in text.splitlines()), text
    finally:
        for ld in loaders:
            ld.close()
