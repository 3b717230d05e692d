"""Which models a live worker serves (`ClusterStats.served_models`, the rule ``/health``
counts by): ``/v1/models`` lists them, and a job for any other registered model is refused
with 503 ``NoWorker`` before it is queued."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request
from redis.asyncio import Redis

from ..defaults import DEFAULT_MODEL
from ..stats import read_cluster_stats
from .errors import NoWorker

# How long a yes is kept (s): a worker that just died is still counted this long (its jobs
# then wait in the queue for another, as any queued job does), and the submits that find a
# live worker cost no Redis read more often than this.
DEFAULT_MAX_AGE_S = 1.0


class LiveWorkers:
    """The models a live worker serves, read from Redis, a yes cached for `max_age_s` (s)."""

    def __init__(self, redis: Redis, max_age_s: float = DEFAULT_MAX_AGE_S):
        self.redis, self.max_age_s = redis, max_age_s
        self._served: frozenset[str] = frozenset()
        self._read_at = -float("inf")

    async def read(self) -> frozenset[str]:
        """The models a live worker serves now (one `read_cluster_stats`, which refreshes
        the cache)."""
        self._served = (await read_cluster_stats(self.redis)).served_models
        self._read_at = time.monotonic()
        return self._served

    async def serves(self, model: str) -> bool:
        """Whether a live worker serves `model`. Only a yes is taken from the cache: a no is
        read again, so a model is taken as soon as ``/v1/models`` or ``/health`` shows it."""
        if model in self._served and time.monotonic() - self._read_at <= self.max_age_s:
            return True
        return model in await self.read()


def live_workers_of(request: Request) -> LiveWorkers:
    """The app's `LiveWorkers` (a FastAPI dependency)."""
    return request.app.state.live_workers


# A route's parameter `live: Live` is the app's `LiveWorkers`.
Live = Annotated[LiveWorkers, Depends(live_workers_of)]


async def require_live_worker(request: Request, model: str | None) -> None:
    """Raise NoWorker when `model` (default `DEFAULT_MODEL`) is registered but no live
    worker serves it; an unregistered model is left to `submit`'s UnknownModel."""
    model = DEFAULT_MODEL if model is None else model
    if not isinstance(model, str):
        return  # submit names the bad field
    if await live_workers_of(request).serves(model):
        return
    registered = await request.app.state.client.models()
    if model in registered:
        raise NoWorker(f"no live worker serves model {model!r} now")
