"""HTTP errors of the gateway: every failure is a JSON body in OpenAI's shape,
``{"error": {"message": str, "type": str, "code": int}}``, whose ``type`` names the typed
error (`jobs.errors`) and whose status code follows from it.

The same mapping serves the native endpoints and ``/v1/completions``, so a client sees one
error format whichever it calls.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import errors


class HTTPError(Exception):
    """An error the gateway itself raises: `status` (HTTP code), `kind` (the body's
    ``type``) and a message."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind


class NoWorker(errors.PrefillQError):
    """The model is registered, but no live worker serves it now (HTTP 503)."""


# The first entry an error is an instance of gives its status (subclasses first).
_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (errors.UnknownModel, 404),
    (errors.JobNotFound, 404),
    (errors.PromptTooLong, 413),
    (errors.InvalidRequest, 400),
    (errors.QueueFull, 429),
    (NoWorker, 503),
    (errors.TokenizerUnavailable, 503),
    (errors.JobFailed, 409),
    (errors.JobCanceled, 409),
    (errors.JobTimeout, 504),
    # Redis, upstream of the gateway, holds a record that does not decode
    (errors.CorruptJob, 502),
)

# A failed job's ``error.type`` -> the status a blocking request answers with: the input
# errors a worker finds after tokenizing are the client's; anything else is ours.
_FAILED_JOB_STATUS = {"PromptTooLong": 413, "PromptTooLarge": 413, "EmptyPrompt": 400,
                      "TokenOutOfRange": 400, "InvalidRequest": 400, "ChatTemplateError": 400,
                      "ChatTemplateMissing": 400}


def status_of(error: Exception) -> int:
    """The HTTP status code of a typed error (500 for any other)."""
    return next((code for cls, code in _STATUS if isinstance(error, cls)), 500)


def failed_job_status(error: errors.JobFailed) -> int:
    """The status of a blocking request whose job failed: 400/413 for input errors found
    by the worker, 500 for the rest (``ModelError``, ``WorkerLost``, ...)."""
    return _FAILED_JOB_STATUS.get(error.error_type, 500)


def error_body(status: int, kind: str, message: str) -> dict:
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, kind: str, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, kind, message), status_code=status, headers=headers)


async def on_prefillq_error(_: Request, error: errors.PrefillQError) -> JSONResponse:
    return error_response(status_of(error), type(error).__name__, str(error))


async def on_http_error(_: Request, error: HTTPError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return error_response(error.status, error.kind, str(error), headers)


async def on_redis_error(_: Request, error: RedisError) -> JSONResponse:
    """Redis unreachable, or refusing a write (``OutOfMemoryError`` under maxmemory): 503,
    typed by redis-py's class. Its message names the host and port, never a password."""
    return error_response(503, type(error).__name__, f"Redis: {error}")


async def on_starlette_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (no such route, method not allowed) in the same JSON shape."""
    kinds = {404: "NotFound", 405: "MethodNotAllowed"}
    return error_response(error.status_code, kinds.get(error.status_code, "HTTPError"),
                          str(error.detail), getattr(error, "headers", None))


async def on_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    """A body or query that does not parse as the endpoint's schema: 400, not FastAPI's 422,
    naming the first offending field."""
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid body"}
    where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
    return error_response(400, "InvalidRequest", f"{where}: {first['msg']}")


HANDLERS = {
    errors.PrefillQError: on_prefillq_error,
    RedisError: on_redis_error,
    StarletteHTTPException: on_starlette_error,
    HTTPError: on_http_error,
    RequestValidationError: on_validation_error,
}
