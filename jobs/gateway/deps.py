"""What every route needs from the app: its client, the bearer-token check, and a wait that
ends early when the HTTP client goes away."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from ..aio import AsyncPrefillClient
from ..errors import InvalidRequest
from .errors import HTTPError

T = TypeVar("T")


def client_of(request: Request) -> AsyncPrefillClient:
    """The app's `AsyncPrefillClient` (a FastAPI dependency)."""
    return request.app.state.client


# A route's parameter `client: Client` is the app's client.
Client = Annotated[AsyncPrefillClient, Depends(client_of)]


def require_api_key(request: Request) -> None:
    """Refuse with 401 unless ``Authorization: Bearer <key>`` carries the app's API key or
    one of its tenants' keys (a no-op when the app has neither); a tenant's key makes the
    request that tenant's (`request_tenant`). Compared in constant time. Every router but
    that of ``/health`` and ``/metrics`` depends on it, and FastAPI solves it before the
    route reads the body (`jobs.gateway.body`)."""
    key: str | None = request.app.state.api_key
    tenant_keys: dict[str, str] = request.app.state.tenant_keys
    request.state.tenant = None
    if key is None and not tenant_keys:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        if key is not None and secrets.compare_digest(given.encode(), key.encode()):
            return
        for tenant_key, tenant in tenant_keys.items():  # every one, in constant time each
            if secrets.compare_digest(given.encode(), tenant_key.encode()):
                request.state.tenant = tenant
        if request.state.tenant is not None:
            return
    raise HTTPError(401, "Unauthorized", "missing or wrong API key (Authorization: Bearer)")


def request_tenant(request: Request, named: str | None) -> str | None:
    """The tenant of a request's jobs: its API key's (`require_api_key`), else the one its
    body `named` (None: none).

    Raises:
        InvalidRequest: the body names a tenant other than its key's.
    """
    keyed: str | None = request.state.tenant
    if keyed is None:
        return named
    if named not in (None, keyed):
        raise InvalidRequest(f"tenant: this API key's tenant is {keyed!r}; a request may not "
                             "name another")
    return keyed


class ClientGone(Exception):
    """The HTTP client disconnected while its request waited."""


# How long a canceled wait may take to end before it is canceled again (s).
RECANCEL_S = 0.05


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or cancel it and raise ClientGone as soon as the client disconnects.

    Listens for the ASGI ``http.disconnect`` message (the body has been read by now, so the
    next message is that one), so a disconnect is seen at once, with no polling.

    `work` is canceled again every `RECANCEL_S` seconds until it ends (`cancel_until_done`):
    on Python 3.11 a cancellation that lands as an inner wait completes can be swallowed
    (CPython gh-86296, ``asyncio.wait_for``; fixed in 3.12). One landing in the result
    wait's redis-py calls can be lost (docs/benchmarks.md), and awaiting that one cancel
    kept the request waiting for its whole job, which was then never canceled.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        await cancel_until_done(task)
        raise ClientGone
    return task.result()


async def cancel_until_done(task: asyncio.Future, every_s: float = RECANCEL_S) -> None:
    """Cancel `task` and wait until it has ended, canceling it again every `every_s`
    seconds that it runs on (a swallowed cancellation costs one interval, not the rest of
    the task). Its result or error is left on it."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every_s)


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
