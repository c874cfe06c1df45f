"""The REST control plane (FastAPI).

Handlers never touch dispatcher state directly: they submit a call to the dispatcher thread
and await its Future, so the API stays responsive while the data plane runs, and every state
change goes through one place. Mutating endpoints need ``Authorization: Bearer <token>``;
health, readiness, status and metrics stay open.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the body model from the handler's
# annotation, and that model is built per service (scale_request_model), so it must be the class
# itself, not a name to look up in this module.
import asyncio
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Callable, Dict, Optional

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from loader_service.control.auth import check_bearer
from loader_service.control.http_limits import BodyLimit
from loader_service.control.metrics import make_registry
from loader_service.control import operate
from loader_service.control.operate import AutoscaleConflict
from loader_service.dispatch.status import ServiceStatus

if TYPE_CHECKING:
    from loader_service.control.autoscale import Autoscaler
    from loader_service.dispatch.loop import Dispatcher

log = logging.getLogger(__name__)
STUCK_LOG_EVERY_S = 60.0  # a probe every few seconds must not flood the log with the same stack


def scale_request_model(max_workers: int) -> type:
    """The body of ``PUT /v1/workers`` for a service that allows at most ``max_workers``.

    Strict: ``"2"``, ``2.0`` and ``false`` are not counts. The bound is the service's own, so
    the schema tells clients the real limit and every refusal is the same 422 shape.
    """

    class ScaleRequest(BaseModel):
        """Set the number of decode worker processes."""

        model_config = ConfigDict(extra="forbid", strict=True)
        count: int = Field(..., ge=0, le=max_workers, description="target number of worker processes")

    return ScaleRequest


class ScaleResponse(BaseModel):
    previous: int
    target: int
    workers: Dict[str, int] = Field(description="workers by state right after the request")


class Health(BaseModel):
    status: str  # "ok" or "failing"
    problem: str = ""  # why it is failing: the dispatcher died, or no worker can start


class Readiness(BaseModel):
    ready: bool
    reason: str = ""
    workers: Dict[str, int] = {}
    data_port: Optional[int] = None


GUARDED_PATHS = frozenset({"/v1/workers"})  # every method but GET/HEAD/OPTIONS needs the token


class AuthFirst:
    """ASGI middleware: a request that would change something is answered 401/403 before its
    body is read. FastAPI parses a body before it runs dependencies, so without this an
    unauthenticated caller with malformed JSON learns about validation (422) instead of auth."""

    def __init__(self, app, token: Callable[[], str]):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope["path"] in GUARDED_PATHS
                and scope["method"] not in ("GET", "HEAD", "OPTIONS")):
            header = dict(scope["headers"]).get(b"authorization")
            problem = check_bearer(header.decode("latin-1") if header is not None else None, self.token())
            if problem is not None:
                status, reason = problem
                response = JSONResponse({"detail": reason}, status_code=status,
                                        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def make_app(d: "Dispatcher", token: Callable[[], str], problem: Callable[[], str],
             autoscaler: Optional["Autoscaler"] = None) -> FastAPI:
    """The REST app for one service: ``d`` is its dispatcher (every read and change goes through
    ``d.call``), ``token()`` the bearer token, ``problem()`` why the service is failing ("" if not),
    ``autoscaler`` the one that owns the worker count (None: scaled by hand)."""
    app = FastAPI(title="loader-service", version=_version(),
                  description="Control plane of the disaggregated data-loading service: health, status, "
                              "metrics, and live scaling of the decode worker pool.")
    app.add_middleware(BodyLimit, max_bytes=d.config.max_http_body_bytes)  # inside AuthFirst: auth comes first
    app.add_middleware(AuthFirst, token=token)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input, and JSON cannot carry 1e400 (inf) or NaN:
        # the response would fail to render and the client get a 500 for its own mistake.
        return JSONResponse({"detail": _json_safe(jsonable_encoder(exc.errors()))}, status_code=422)

    async def loop_answer(fn, *args):
        """``fn(*args)`` on the dispatcher thread; asyncio.TimeoutError if the loop does not answer
        within --loop-answer (the call is then cancelled: it will not run late)."""
        return await asyncio.wait_for(asyncio.wrap_future(d.call(fn, *args)), d.config.loop_answer_s)

    async def on_dispatcher(fn, *args):
        """:func:`loop_answer` for a route: 503 when the loop is stuck or the service stopping."""
        try:
            return await loop_answer(fn, *args)
        except asyncio.TimeoutError:
            raise HTTPException(503, stuck()) from None
        except RuntimeError as exc:  # stopped while we waited
            if "stopped" in str(exc):
                raise HTTPException(503, "the service is stopping") from None
            raise

    last_stuck_log = [-math.inf]

    def stuck() -> str:
        why = (f"the dispatcher loop has not answered for {d.config.loop_answer_s:g}s (stuck: every client stalls; "
               "its stack is in the log)")
        now = time.monotonic()
        if now - last_stuck_log[0] >= STUCK_LOG_EVERY_S:
            last_stuck_log[0] = now
            log.error("%s; the loop thread is at:\n%s", why, d.loop_stack())
        return why

    # Per route: documents the header in the schema and enforces it even on a route missing from
    # GUARDED_PATHS (AuthFirst only moves the check ahead of the body for the listed paths).
    def require_token(authorization: Optional[str] = Header(None, description="Bearer <token>")) -> None:
        refused = check_bearer(authorization, token())
        if refused is not None:
            status, reason = refused
            raise HTTPException(status, reason, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)

    @app.get("/healthz", tags=["health"], response_model=Health,
             responses={503: {"model": Health, "description": "failing: the dispatcher died or is stuck, or no "
                                                                 "worker can start"}})
    async def healthz():
        """Liveness: the process answers, its dispatcher loop answers a probe in time, and
        workers can start."""
        why = problem()
        if not why:
            try:
                await loop_answer(int)
            except asyncio.TimeoutError:
                why = stuck()
            except RuntimeError:  # stopped meanwhile: problem() says why, if anything
                why = problem()
        if why:
            return JSONResponse(Health(status="failing", problem=why).model_dump(), status_code=503)
        return Health(status="ok")

    @app.get("/readyz", tags=["health"], response_model=Readiness,
             responses={503: {"model": Readiness, "description": "not ready"}})
    async def readyz():
        """Readiness: the data port is bound and at least one worker is up."""
        counts = await on_dispatcher(d.pool.state.counts)
        reason = ""
        if d.pool.state.broken:
            reason = d.pool.state.broken
        elif counts.get("idle", 0) + counts.get("busy", 0) == 0:
            reason = "no worker is up"
        body = Readiness(ready=not reason, reason=reason, workers=counts, data_port=d.data_port)
        return JSONResponse(body.model_dump(), status_code=503 if reason else 200)

    @app.get("/v1/status", tags=["status"], response_model=ServiceStatus)
    async def status() -> ServiceStatus:
        """Workers with their state, clients with their epoch progress, throughput, per-stage
        seconds, client stall, and the autoscaler's recent decisions."""
        return await on_dispatcher(operate.snapshot, d, autoscaler)

    ScaleRequest = scale_request_model(d.config.max_workers)

    @app.put("/v1/workers", tags=["control"], response_model=ScaleResponse, dependencies=[Depends(require_token)],
             responses={401: {"description": "no token"}, 403: {"description": "wrong token"},
                        409: {"description": "the autoscaler owns the worker count"}})
    async def scale(body: ScaleRequest) -> ScaleResponse:
        """Scale the worker pool live. New workers take tasks at once; surplus workers finish
        their task before they exit, so no sample is lost or doubled."""
        try:
            return ScaleResponse(**await on_dispatcher(operate.scale, d, body.count, autoscaler))
        except AutoscaleConflict as exc:
            raise HTTPException(409, str(exc)) from None
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None

    mount_status_page(app)

    registry = make_registry(lambda: d.call(operate.status_json, d, autoscaler).result(timeout=10))

    @app.get("/metrics", tags=["status"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics."""
        data = await asyncio.get_running_loop().run_in_executor(None, generate_latest, registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    return app


def _json_safe(value):
    """``value`` with every non-finite float replaced by its name (``"inf"``, ``"nan"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# The page loads nothing from elsewhere (no CDN): a browser refuses anything but this origin.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                           "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
                "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


class _PageFiles(StaticFiles):
    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


def mount_status_page(app: FastAPI) -> None:
    """The status page at ``/`` (static files, read-only, no token: it only reads /v1/status)."""

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(os.path.join(STATIC_DIR, "index.html"), headers=PAGE_HEADERS)

    app.mount("/static", _PageFiles(directory=STATIC_DIR), name="static")


def _version() -> str:
    from loader_service import __version__

    return __version__
