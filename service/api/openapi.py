"""The OpenAPI document says what the server does (issue 13, finding 7): every status an operation can return
is declared, with OpenAI's error body, and none it cannot.

FastAPI declares 422 (its validation error) on every operation with parameters; our handler answers 400 in
OpenAI's shape instead (`errors.py`), so the 422 goes and a 400 takes its place. Statuses that a router's
dependencies produce are declared once per router (`error_responses`, passed as the router's `responses`);
the ones the body middleware can answer for any request (408, 413) are added to every operation here.
`tests/api/test_schemathesis.py` holds the document to this, with every schemathesis check on.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.api.schemas import ErrorResponse

ERRORS = {
    400: "invalid or unsupported request (OpenAI's invalid_request_error)",
    401: "missing or wrong API key",
    404: "unknown model",
    408: "the request body did not arrive in full within the body timeout",
    409: "the server runs nothing this request could act on (e.g. no draft head to reload)",
    413: "request body too large",
    429: "queue full; see Retry-After",
    500: "the engine failed on this request (the server keeps serving)",
    503: "not ready (model loading), shutting down, or the OCM store cannot be read",
    504: "the request timed out",
}
# Answered by BodyLimitMiddleware before routing, whatever the operation.
EVERY_OPERATION = (408, 413)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a router or route: these statuses, each with the error body."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


def install_openapi(app: FastAPI) -> None:
    """Replace the app's OpenAPI generator by one that tells the truth about error statuses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = truthful(
                get_openapi(
                    title=app.title, version=app.version, description=app.description, routes=app.routes
                )
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def truthful(schema: dict[str, Any]) -> dict[str, Any]:
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    error_body = {"content": {"application/json": {"schema": error_ref}}}
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None:  # the validation error is our 400
                responses.setdefault("400", {"description": ERRORS[400], **error_body})
            for status in EVERY_OPERATION:
                responses.setdefault(str(status), {"description": ERRORS[status], **error_body})
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema
