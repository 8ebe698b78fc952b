"""GET /health (liveness: the process answers) and GET /ready (readiness: a real generation works).

Neither needs an API key: load balancers and orchestrators call them.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from service.api.deps import State

router = APIRouter(tags=["health"])


def _status_body(description: str) -> dict:
    """A 503 of these probes: their own `{"status": ..., "detail": ...}` body, not an OpenAI error."""
    schema = {"type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}
    return {503: {"description": description, "content": {"application/json": {"schema": schema}}}}


@router.get("/health", responses=_status_body("the model failed to load, or the engine died: restart"))
async def health(state: State) -> JSONResponse:
    """200 while the process serves HTTP, even while models load. 503 only when restarting is the cure:
    loading failed for good, or the engine cannot go on (the process is stopping itself then)."""
    if state.load_error is not None:
        return JSONResponse({"status": "failed", "detail": state.load_error}, status_code=503)
    if state.engine_dead is not None:
        return JSONResponse(
            {"status": "dead", "detail": f"engine dead: {state.engine_dead}"}, status_code=503
        )
    return JSONResponse({"status": "ok"})


@router.get("/ready", responses=_status_body("loading, unhealthy (the probe failed), dead or shutting down"))
async def ready(state: State) -> JSONResponse:
    """200 once the model is loaded and a target forward succeeded recently (or a 1-token probe just did);
    503 while loading, when the probe fails, when the engine is dead, and while shutting down. Reports the
    OCM store's state."""
    is_ready, body = await state.readiness()
    if state.worker is not None:
        body["requests"] = {"running": state.worker.running, "waiting": state.worker.waiting}
    if state.runtime is not None:
        try:
            status = await run_in_threadpool(state.runtime.store.status)
            body["ocm_store"] = {
                "backend": status.backend,
                "healthy": status.healthy,
                "patterns": status.patterns,
                "detail": status.detail,
            }
        except Exception as exc:  # a failing store degrades the service; it does not make it unready
            body["ocm_store"] = {"healthy": False, "detail": f"status failed: {exc}"}
    headers = {} if is_ready else {"Retry-After": "5"}
    return JSONResponse(body, status_code=200 if is_ready else 503, headers=headers)
