"""The REST control plane (FastAPI). Handlers never touch dispatcher state directly: they
submit a call to the dispatcher thread and await its Future, so the API stays responsive and
every state change goes through one place."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from .service import Service


def make_app(service: "Service") -> FastAPI:
    app = FastAPI(title="loader-service", version=_version(),
                  description="Control plane of the disaggregated data-loading service.")

    async def on_dispatcher(fn, *args):
        d = service.dispatcher
        assert d is not None
        return await asyncio.wrap_future(d.call(fn, *args))

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz():
        """Readiness: the data port is bound and at least one worker is up."""
        d = service.dispatcher
        if d is None:
            return JSONResponse({"ready": False, "reason": "starting"}, status_code=503)
        counts = await on_dispatcher(d.pool.counts)
        if d.pool.broken:
            return JSONResponse({"ready": False, "reason": d.pool.broken, "workers": counts}, status_code=503)
        up = sum(v for k, v in counts.items() if k in ("idle", "busy"))
        if up == 0:
            return JSONResponse({"ready": False, "reason": "no worker is up", "workers": counts}, status_code=503)
        return {"ready": True, "workers": counts, "data_port": d.data_port}

    @app.get("/v1/status", tags=["status"])
    async def status() -> dict:
        """Workers, clients with their epoch progress, throughput and per-stage times."""
        d = service.dispatcher
        assert d is not None
        return await on_dispatcher(d.status)

    return app


def _version() -> str:
    from . import __version__

    return __version__
