"""FastAPI dependencies, as `Annotated` types: the service state, API-key auth, and "ready to serve"."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.api.errors import AUTHENTICATION, APIError
from service.api.state import ServiceState
from service.api.tenants import OPEN, set_tenant, tenant_id
from service.api.worker import EngineWorker
from service.runtime import Runtime


def get_state(request: Request) -> ServiceState:
    return request.app.state.csd


State = Annotated[ServiceState, Depends(get_state)]

_bearer = HTTPBearer(
    auto_error=False,
    description="`Authorization: Bearer <key>`, when the server has API keys (CSD_API_KEYS)",
)


async def require_api_key(
    state: State, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Without configured keys everyone is let in; with them, a Bearer key must match one.

    Keys are compared in constant time (hmac.compare_digest) against every configured key, so neither the
    time nor the position of a match says anything about a key. Keys are never logged. The matching key's
    tenant is recorded for the request (tenants.py: whose earlier outputs may shape its drafts); async, so
    that it is recorded in the request's own task and not in a worker thread's copy of its context.
    """
    keys = state.settings.api_keys
    if not keys:
        set_tenant(OPEN)
        return
    given = credentials.credentials.encode() if credentials is not None else b""
    matched = False
    tenant = ""
    for key in keys:
        secret = key.get_secret_value()
        same = hmac.compare_digest(given, secret.encode())
        matched |= same
        candidate = tenant_id(secret)  # computed for every key: the time says nothing of which matched
        tenant = candidate if same else tenant
    if not matched:
        raise APIError(
            401,
            "a valid API key is required: send the header 'Authorization: Bearer <key>'"
            if credentials is None
            else "the API key is not valid",
            type=AUTHENTICATION,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    set_tenant(tenant)


Authorized = Depends(require_api_key)


def _serving_runtime(state: State) -> Runtime:
    return state.require_serving()[0]


def _serving_worker(state: State) -> EngineWorker:
    return state.require_serving()[1]


ServingRuntime = Annotated[Runtime, Depends(_serving_runtime)]
ServingWorker = Annotated[EngineWorker, Depends(_serving_worker)]
