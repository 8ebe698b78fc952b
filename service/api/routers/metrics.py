"""GET /metrics: Prometheus text format (no API key: scrapers call it)."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from service.api.deps import State

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    # The OCM collector asks the store for its status, which may touch the network: off the loop.
    body = await run_in_threadpool(generate_latest, state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
