"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the right status.

Every LoraplexError raised below the API maps to one status here, so route code raises domain errors
and never builds responses for them.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.adapter_store.errors import AdapterUnavailableError, ConflictError, NotFoundError
from loraplex.engine.async_engine import EngineDeadError
from loraplex.errors import AdapterError, AdapterNotFoundError, CapacityError, LoraplexError, RequestError

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with OpenAI's body; raised by route code for what is not a domain error."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def not_found(message: str, code: str = "not_found", param: str | None = None) -> ApiError:
    return ApiError(404, message, "not_found_error", code, param)


def forbidden(message: str) -> ApiError:
    return ApiError(403, message, "permission_error", "forbidden")


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "authentication_error", "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def unavailable(message: str, retry_after_s: int = 5, code: str = "unavailable") -> ApiError:
    return ApiError(503, message, "service_unavailable", code, headers={"Retry-After": str(retry_after_s)})


def too_many(message: str, retry_after_s: int, code: str = "rate_limited") -> ApiError:
    return ApiError(429, message, "rate_limit_error", code, headers={"Retry-After": str(max(1, retry_after_s))})


def error_body(status: int, message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def from_exception(exc: BaseException) -> ApiError:
    """The ApiError a domain exception becomes (unknown exceptions: 500 with a generic message)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, (AdapterNotFoundError, NotFoundError)):
        return not_found(str(exc))
    if isinstance(exc, ConflictError):
        return ApiError(409, str(exc), "invalid_request_error", "conflict")
    if isinstance(exc, AdapterUnavailableError):
        # The blob failed verification: the version is marked unhealthy and never served.
        return ApiError(409, str(exc), "invalid_request_error", "adapter_unavailable")
    if isinstance(exc, AdapterError):
        return bad_request(str(exc), code="invalid_adapter")
    if isinstance(exc, CapacityError):
        return bad_request(str(exc), code="context_length_exceeded")
    if isinstance(exc, EngineDeadError):
        return unavailable(str(exc), code="engine_dead")
    if isinstance(exc, (RequestError, LoraplexError)):
        return bad_request(str(exc))
    return ApiError(500, "internal error; the server log has the details", "api_error", "internal_error")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.type, err.code, err.param), err.status,
                        headers=err.headers)


def install_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        if err.status >= 500 and not isinstance(exc, (ApiError, EngineDeadError)):
            log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(err)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header", "form")]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        err = bad_request(message, param=param)
        on_invalid = getattr(request.app.state, "on_invalid_inference", None)
        if on_invalid is not None:
            await on_invalid(request, err)
        return error_response(err)

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return error_response(ApiError(exc.status_code, str(exc.detail), type_, None, None,
                                       dict(exc.headers or {})))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(LoraplexError, on_api_error)
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(EngineDeadError, on_api_error)
    app.add_exception_handler(Exception, on_api_error)
