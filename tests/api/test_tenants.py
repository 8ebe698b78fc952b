"""Tenant ids and draft pools (service/api/tenants.py): what names a request's pool, without a server."""

from __future__ import annotations

import contextvars

from service.api.tenants import OPEN, SHARED, draft_pool, set_tenant, tenant_id


def test_a_tenant_id_is_stable_per_key_and_never_the_key():
    first, second = tenant_id("sk-first-secret"), tenant_id("sk-second-secret")
    assert first == tenant_id("sk-first-secret") and first != second
    assert "secret" not in first and "sk-" not in first


def _pool_after(tenant: str | None, scope: str) -> str | None:
    """The pool planning would give a request whose auth recorded `tenant`, in a context of its own (as each
    request's task has)."""

    def plan() -> str | None:
        if tenant is not None:
            set_tenant(tenant)
        return draft_pool(scope)

    return contextvars.Context().run(plan)


def test_the_pool_is_the_tenant_unless_shared_and_none_without_a_tenant():
    key = tenant_id("sk-a")
    assert _pool_after(key, "tenant") == key
    assert _pool_after(OPEN, "tenant") == OPEN
    assert _pool_after(key, "shared") == SHARED
    assert _pool_after(None, "tenant") is None  # planned outside an authorised route: its own text only
    assert _pool_after(None, "shared") is None
