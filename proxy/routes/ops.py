"""Operations: liveness/readiness and Prometheus metrics (no key: scraped by infrastructure)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.deps import ServicesDep

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz(svc: ServicesDep) -> JSONResponse:
    """200 when the store answers and at least one replica is healthy; 503 otherwise, saying why."""
    replicas = {r.name: r.healthy for r in svc.upstreams.replicas}
    try:
        await svc.repo.ping()
        store = "ok"
    except Exception as exc:  # report, do not raise: this is the health answer
        store = f"error: {type(exc).__name__}"
    ok = store == "ok" and any(replicas.values())
    body = {
        "status": "ok" if ok else "degraded",
        "store": store,
        "replicas": replicas,
        "policy_version": svc.adapters.version,
        "recorder_queue": svc.recorder.queue_depth,
    }
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(svc: ServicesDep) -> Response:
    m = svc.metrics
    m.queue_depth.set(svc.recorder.queue_depth)
    layout = svc.repo.layout
    m.calls_stored.labels("delta").set(layout.calls_delta)
    m.calls_stored.labels("whole").set(layout.calls_whole)
    m.base_reads.set(layout.base_reads)
    m.replicas_healthy.set(sum(r.healthy for r in svc.upstreams.replicas))
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
