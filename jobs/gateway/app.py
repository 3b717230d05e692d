"""The gateway's ASGI app: `create_app` builds it over an `AsyncPrefillClient`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..aio import AsyncPrefillClient
from ..defaults import DEFAULT_MAX_BODY_BYTES
from . import completions, native, observe, score, tokenize
from .errors import HANDLERS, error_response
from .limits import BodyLimit, BodyTooLarge
from .liveness import LiveWorkers

# Every route of the app, by module.
ROUTERS = (native.router, completions.router, score.router, tokenize.router, observe.router)


def create_app(client: AsyncPrefillClient, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               score_with_bos: bool = False,
               tenant_keys: dict[str, str] | None = None) -> FastAPI:
    """The gateway over `client`, which the app closes when it shuts down.

    Args:
        client: the asyncio client every request goes through.
        api_key: when set, every endpoint but ``/health`` and ``/metrics`` wants
            ``Authorization: Bearer <api_key>`` (401 otherwise).
        max_body_bytes: larger request bodies are refused with 413.
        score_with_bos: ``/v1/completions`` scores token ids that do not start with the
            model's BOS as if it preceded them; the echo still covers only the client's ids.
        tenant_keys: API key -> tenant: a request bearing one is accepted (beside
            `api_key`) and its jobs are that tenant's (`jobs.gateway.deps.request_tenant`).
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="prefillq gateway", lifespan=lifespan,
                  description="Chunked, resumable, exact prefill as an HTTP service.")
    app.state.client = client
    app.state.api_key = api_key
    app.state.tenant_keys = dict(tenant_keys or {})
    app.state.score_with_bos = score_with_bos
    app.state.live_workers = LiveWorkers(client.redis)
    for error_type, handler in HANDLERS.items():
        app.add_exception_handler(error_type, handler)
    app.add_exception_handler(BodyTooLarge, _on_body_too_large)
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    for router in ROUTERS:
        app.include_router(router)
    return app


async def _on_body_too_large(_: Request, error: Exception) -> JSONResponse:
    return error_response(413, "RequestTooLarge", str(error))


async def _on_unexpected(_: Request, error: Exception) -> JSONResponse:
    # Starlette re-raises after this answer, so the server logs the traceback once
    return error_response(500, "InternalError", f"{type(error).__name__}: the gateway failed "
                          "on this request (its log has the traceback)")
