"""Every error the service returns, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Errors are mapped here and only here: request validation (400, not FastAPI's 422), unknown routes (404),
wrong methods (405), our own `APIError`s, and anything unexpected (500 with a generic message; the
traceback goes to the server log, never to the client).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.decoding.requests import FailReason

log = logging.getLogger(__name__)

# OpenAI's error types; the status code tells the same story for clients that only look at that.
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
TIMEOUT = "timeout_error"
UNAVAILABLE = "service_unavailable_error"
SERVER = "server_error"

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first": only ever seen in metrics


class APIError(Exception):
    """An error with everything its HTTP response needs."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# 400 codes for what a request's JSON Schema cannot state (the OpenAPI document says types and ranges): the
# conformance fuzzer (tests/api/test_schemathesis.py) lets a schema-valid request be refused only with these
# or with a server setting's code, so every other refusal of a schema-valid request is a bug.
INVALID_TOKEN_ID = "invalid_token_id"  # outside this model's vocabulary (a property of the served model)
INVALID_GRAMMAR = "invalid_grammar"  # a JSON Schema, regex or grammar that does not compile
INCONSISTENT = "inconsistent_parameters"  # fields that contradict each other, or one that needs another
TOO_MANY_CHOICES = "batch_size_exceeded"  # n above this server's max_batch_size (a setting)
PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"  # an id this server does not hold (its state)
PREVIOUS_RESPONSE_NOT_COMPLETED = "previous_response_not_completed"  # queued, running, failed or cancelled
SCHEMA_UNSTATED = frozenset(
    {
        INVALID_TOKEN_ID,
        INVALID_GRAMMAR,
        INCONSISTENT,
        TOO_MANY_CHOICES,
        PREVIOUS_RESPONSE_NOT_FOUND,
        PREVIOUS_RESPONSE_NOT_COMPLETED,
    }
)
# The stored responses' routes (GET, DELETE /v1/responses/{id}, POST .../cancel)
RESPONSE_NOT_FOUND = "response_not_found"  # 404: an id this server does not hold
NOT_CANCELLABLE = "response_not_cancellable"  # only a background response can be cancelled


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str | None = None) -> APIError:
    return APIError(
        400,
        f"{what or param!s} is not supported by this server",
        param=param,
        code="unsupported_parameter",
    )


def shutting_down(message: str = "the server is shutting down") -> APIError:
    return APIError(503, message, type=UNAVAILABLE, code="shutting_down")


def timed_out(message: str = "the request timed out before its generation finished") -> APIError:
    return APIError(504, message, type=TIMEOUT, code="timeout")


def engine_failure() -> APIError:
    return APIError(
        500,
        "the generation failed inside the engine; the server keeps serving (details in the server log)",
        type=SERVER,
        code="engine_error",
    )


def engine_dead() -> APIError:
    """The engine cannot go on (why is in the server log): the process is stopping to be restarted."""
    return APIError(
        503,
        "the engine stopped and this server is restarting; retry on another replica",
        type=UNAVAILABLE,
        code="engine_dead",
    )


def queue_full(retry_after_s: int, running: int, waiting: int) -> APIError:
    return APIError(
        429,
        f"the server is busy ({running} running, {waiting} waiting); retry after {retry_after_s}s",
        type=RATE_LIMIT,
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def from_engine(reason: FailReason, message: str, cancel_reason: str = "") -> APIError:
    """The one mapping from why the engine core gave a request up to the error its client gets.
    `cancel_reason`: why this side aborted it (client disconnected, timeout, shutdown), for ABORTED."""
    if reason is FailReason.INVALID:
        return bad_request(message)
    if reason is FailReason.TOO_MANY_ROWS:
        return APIError(400, "n is above this server's batch size", param="n", code=TOO_MANY_CHOICES)
    if reason is FailReason.TIMEOUT or cancel_reason == "timeout":
        return timed_out()
    if reason is FailReason.ABORTED:
        if cancel_reason == "shutdown":
            return shutting_down()
        return APIError(
            CLIENT_CLOSED_REQUEST, f"generation stopped: {cancel_reason or 'aborted'}", code="cancelled"
        )
    return engine_failure()


def error_response(error: APIError) -> Response:
    # ensure_ascii: a message may quote user input, which can hold lone surrogates that UTF-8 cannot encode.
    return Response(
        json.dumps(error.body(), ensure_ascii=True),
        status_code=error.status_code,
        headers=error.headers,
        media_type="application/json",
    )


def sse_error_event(error: APIError) -> bytes:
    """An error after a stream has begun: the status line is long gone, so it travels as the last event."""
    return b"data: " + json.dumps(error.body(), ensure_ascii=True).encode() + b"\n\n"


def _validation_message(error: dict[str, Any]) -> tuple[str, str | None]:
    """One pydantic error -> (message, param). The location drops FastAPI's "body" prefix."""
    loc = [str(part) for part in error.get("loc", ()) if part not in ("body", "query", "path", "header")]
    # Union members add their type names to the location (e.g. "str", "list[str]"): not field names.
    loc = [part for part in loc if not any(c in part for c in "[]()") and part not in _TYPE_NAMES]
    param = ".".join(loc) or None
    if error.get("type") == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "invalid JSON")
        return f"the request body is not valid JSON ({reason})", None
    if error.get("type") == "missing":
        if param is None:  # the body itself: empty or absent
            return "a request body is required: a JSON object, sent with Content-Type: application/json", None
        return f"{param} is required", param
    if param is None and error.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object, sent with Content-Type: application/json", None
    msg = error.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")  # our own validators' messages stand on their own
    return (f"{param}: {msg}" if param else msg), param


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}
# the tags of a discriminated union (the Responses API's input items) are no field names either
_TYPE_NAMES |= {"message", "function_call", "function_call_output"}


async def _on_validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    if not errors:
        return error_response(bad_request("invalid request"))
    message, param = _validation_message(errors[0])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    code = "invalid_json" if errors[0].get("type") == "json_invalid" else "invalid_value"
    return error_response(bad_request(message, param=param, code=code))


async def _on_api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        error = APIError(
            404,
            f"no route {request.method} {request.url.path}",
            type=NOT_FOUND,
            code="route_not_found",
            headers=headers,
        )
    elif exc.status_code == 405:
        error = APIError(
            405,
            f"method {request.method} is not allowed on {request.url.path}",
            code="method_not_allowed",
            headers=headers,
        )
    elif exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
        error = _unparsable_body(exc.__cause__)
    else:
        kind = SERVER if exc.status_code >= 500 else INVALID_REQUEST
        code = "server_error" if exc.status_code >= 500 else "invalid_request"
        error = APIError(exc.status_code, str(exc.detail), type=kind, code=code, headers=headers)
    return error_response(error)


def _unparsable_body(cause: BaseException) -> APIError:
    """What FastAPI's "There was an error parsing the body" was (it raises it from the parser's error)."""
    if isinstance(cause, UnicodeDecodeError):
        return bad_request(
            f"the request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset "
            f"{cause.start}); JSON must be sent as UTF-8",
            code="invalid_utf8",
        )
    if isinstance(cause, RecursionError):
        return bad_request(
            "the request body's JSON is nested too deeply to parse; no request needs that depth",
            code="json_too_deep",
        )
    return bad_request(f"the request body could not be parsed ({type(cause).__name__})", code="invalid_json")


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(
        APIError(500, "internal server error; see the server log", type=SERVER, code="internal_error")
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)
