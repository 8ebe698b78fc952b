"""GET /v1/ocm/top: the most frequent divergence patterns per drafter, decoded as text (for the playground)."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from service.api.deps import Authorized, ServingRuntime
from service.api.errors import UNAVAILABLE, APIError, bad_request
from service.api.openapi import error_responses
from service.api.schemas import OCMNamespaceTop, OCMPattern, OCMTop
from service.runtime import Runtime

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/ocm", tags=["ocm"], dependencies=[Authorized])


def _top(runtime: Runtime, n: int) -> OCMTop:
    decode = runtime.target.tokenizer.decode
    data = []
    for drafter, namespace in sorted(runtime.namespaces.items()):
        patterns = [
            OCMPattern(
                draft_token=p.draft_token,
                target_token=p.target_token,
                draft_text=decode([p.draft_token]),
                target_text=decode([p.target_token]),
                count=p.count,
            )
            for p in runtime.store.top(namespace, n)
        ]
        data.append(OCMNamespaceTop(namespace=namespace.key, drafter=drafter, patterns=patterns))
    return OCMTop(data=data)


@router.get("/top", response_model=OCMTop, responses=error_responses(400, 401, 503))
async def top_patterns(
    request: Request,
    runtime: ServingRuntime,
    n: Annotated[int, Query(ge=1, le=1000, description="patterns per drafter")] = 20,
) -> OCMTop:
    """The n most frequent (draft token, target token) divergence patterns of each drafter this server
    runs, most frequent first."""
    unknown = sorted(set(request.query_params) - {"n"})
    if unknown:  # a typo (`?top=5`) would otherwise silently give the default
        raise bad_request(f"unknown query parameter {unknown[0]!r}; this endpoint takes n", param=unknown[0])
    try:
        return await run_in_threadpool(_top, runtime, n)
    except Exception as exc:  # e.g. a shared store that cannot be reached: decoding goes on without it
        log.warning("OCM top failed: %s", exc)
        raise APIError(
            503, "the OCM store cannot be read right now", type=UNAVAILABLE, code="ocm_unavailable"
        ) from None
