"""Every error leaves the server as OpenAI's `{"error": {"message", "type", "param", "code"}}`, except on the
Anthropic routes (/v1/messages...), where it has Anthropic's shape: `{"type": "error", "error": {"type",
"message"}}`."""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from reuse_server.api.auth import Unauthorized
from reuse_server.api.protocol import ErrorDetail, ErrorResponse
from reuse_server.engine.request_errors import (EngineStalled, EngineUnavailable, QueueFull, RequestTimedOut,
                                                ServerDraining)
from reuse_server.engine.sampling_params import InvalidRequest, PromptTooLong

logger = logging.getLogger("reuse_server.api")

# Seconds a client is told to wait. A full queue frees places with every request that finishes, and the
# openai client adds its own backoff; a draining server is gone within --shutdown-timeout, so a client behind
# a load balancer should come back a little later, to another replica.
RETRY_AFTER_QUEUE_FULL = 1
RETRY_AFTER_DRAINING = 5
RETRY_AFTER_STALLED = 5  # a stalled engine may recover when its step returns; meanwhile, another replica


class ModelNotFound(Exception):
    def __init__(self, requested: str, served: str):
        super().__init__(f"The model '{requested}' does not exist; this server serves '{served}'.")
        self.message = str(self)


class NotFound(Exception):
    """A stored object (a response) that does not exist for this tenant; answered with 404."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready; its request was aborted."""


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


ANTHROPIC_PATH = "/v1/messages"

# Anthropic's error types by status (its API errors page); 408 is ours, a timeout.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                                                   else "invalid_request_error"),
                                       "message": message}}


def anthropic_message(exc: InvalidRequest) -> str:
    """An invalid request's message as Anthropic words it where clients read the words: Claude Code compacts
    its conversation on `prompt is too long: N tokens > M maximum` (matched by a regular expression in Claude
    Code 2.1.197). Anthropic's maximum is the longest prompt: here one token less than the context, which must
    leave room for one token of answer. (Its other overflow, `input length and `max_tokens` exceed context
    limit`, never happens here: a max_tokens beyond the room left is fitted to it.)"""
    if isinstance(exc, PromptTooLong):
        return f"prompt is too long: {exc.prompt_tokens} tokens > {exc.limit - 1} maximum"
    return exc.message


def is_anthropic(request: Request | None) -> bool:
    return request is not None and request.url.path.startswith(ANTHROPIC_PATH)


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None, request: Request | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the shape of the route's dialect."""
    if is_anthropic(request):
        body = anthropic_error_body(status, message)
    else:
        body = error_body(message, type_, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


class ServiceError(NamedTuple):
    """How a refusal that is not the request's fault (auth, load, timeout, shutdown) leaves the server."""
    status: int
    message: str
    type: str
    code: str
    headers: dict[str, str]

    def body(self) -> dict:
        return error_body(self.message, self.type, None, self.code)

    def response(self, request: Request | None = None) -> JSONResponse:
        return error_response(self.status, self.message, self.type, None, self.code, request, self.headers)


def service_error(exc: BaseException) -> ServiceError | None:
    """The status and OpenAI-style error for the exceptions the server raises on purpose, or None.
    A request timeout is 408, as Azure OpenAI answers a server-side timeout (and the openai client retries
    it): a limit the operator chose ran out, not a failure of the server, so it is not counted as a 5xx."""
    if isinstance(exc, Unauthorized):
        return ServiceError(401, exc.message, "invalid_request_error", "invalid_api_key",
                            {"WWW-Authenticate": "Bearer"})
    if isinstance(exc, QueueFull):
        return ServiceError(429, str(exc), "rate_limit_error", "queue_full",
                            {"Retry-After": str(RETRY_AFTER_QUEUE_FULL)})
    if isinstance(exc, RequestTimedOut):
        return ServiceError(408, str(exc), "timeout_error", "request_timeout", {})
    if isinstance(exc, ServerDraining):
        return ServiceError(503, f"The server is not accepting requests: {exc}.", "server_error",
                            "server_shutting_down", {"Retry-After": str(RETRY_AFTER_DRAINING)})
    if isinstance(exc, EngineStalled):
        return ServiceError(503, f"The server cannot serve requests: {exc}.", "server_error", "engine_stalled",
                            {"Retry-After": str(RETRY_AFTER_STALLED)})
    if isinstance(exc, EngineUnavailable):
        return ServiceError(503, f"The server cannot serve requests: {exc}.", "server_error", "engine_unavailable",
                            {})
    return None


SERVICE_ERRORS = (Unauthorized, QueueFull, RequestTimedOut, EngineUnavailable)


def _field_path(loc: tuple) -> str:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message naming the offending field(s), and the first field as `param`."""
    if any(e.get("type") == "json_invalid" for e in errors):
        err = next(e for e in errors if e.get("type") == "json_invalid")
        detail = (err.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".rstrip(": "), None
    parts, first = [], None
    for e in errors[:5]:
        field = _field_path(tuple(e.get("loc", ())))
        first = first or field or None
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{field or 'request body'}: {msg}")
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    return "Invalid request: " + "; ".join(parts), first


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers schema errors with 400, not FastAPI's default 422.
        message, param = describe_validation_error(list(exc.errors()))
        return error_response(400, message, param=param, request=request)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> JSONResponse:
        message = anthropic_message(exc) if is_anthropic(request) else exc.message
        return error_response(400, message, param=exc.param, code=exc.code, request=request)

    @app.exception_handler(ModelNotFound)
    async def _model(request: Request, exc: ModelNotFound) -> JSONResponse:
        return error_response(404, exc.message, param="model", code="model_not_found", request=request)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound) -> JSONResponse:
        return error_response(404, exc.message, param=exc.param, code="not_found", request=request)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> JSONResponse:
        # Nobody reads this; 499 is the conventional "client closed request" for access logs.
        return error_response(499, "The client closed the connection; the request was aborted.", request=request)

    for kind in SERVICE_ERRORS:
        @app.exception_handler(kind)
        async def _service(request: Request, exc: Exception) -> JSONResponse:
            return service_error(exc).response(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, message, type_, request=request, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(request)


def internal_error(request: Request) -> JSONResponse:
    """A 500 for an unexpected exception; call from an `except` block so the traceback is logged."""
    logger.exception("Unhandled error while serving %s %s", request.method, request.url.path)
    return error_response(500, "The server had an internal error while processing the request.", "server_error",
                          request=request)
