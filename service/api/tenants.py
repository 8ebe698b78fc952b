"""Who a request belongs to, for what the server learns across requests: the tenant of its API key.

The suffix drafter drafts from earlier outputs (issue 34), and a draft can leak through timing (a request
that repeats another client's text runs faster), so by default one API key's outputs never shape another
key's drafts: each key is a tenant, and its tenant id names its draft pool (`SpeculativeConfig.draft_pool`).
Without API keys every client is one tenant (`OPEN`); `CSD_DRAFT_POOL_SCOPE=shared` pools every tenant.

The id is a digest of the key, never the key: it reaches Redis key fields and is the same on every replica
that has the key. The auth dependency (deps.require_api_key) records the tenant for the request's task in a
context variable; planning reads it when it builds the speculative config. Why a context variable and not
an argument: every generation route (chat, completions, Responses) plans through `plan.speculative_config`
but not all of them take the request; the variable is per request (each request runs in its own task), and
a request planned outside an authorised route has no tenant, so its drafts come from its own text alone.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from typing import Literal

OPEN = "open"  # the one tenant of a server without API keys
SHARED = "shared"  # the pool of every tenant (CSD_DRAFT_POOL_SCOPE=shared)

_tenant: ContextVar[str | None] = ContextVar("csd_tenant", default=None)


def tenant_id(api_key: str) -> str:
    """A stable, non-reversible id for an API key's tenant."""
    return "k-" + hashlib.sha256(b"csd-tenant\0" + api_key.encode("utf-8")).hexdigest()[:20]


def set_tenant(tenant: str) -> None:
    """The current request's tenant (called by the auth dependency, in the request's own task)."""
    _tenant.set(tenant)


def draft_pool(scope: Literal["tenant", "shared"]) -> str | None:
    """The draft pool of the current request: its tenant's, every tenant's, or None (no tenant known: the
    request drafts from its own text only)."""
    tenant = _tenant.get()
    if tenant is None:
        return None
    return SHARED if scope == "shared" else tenant
