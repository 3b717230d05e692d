"""Whether a model has a live worker, checked before a job is queued (503 ``NoWorker``
otherwise), from a count of live workers per model that is at most `max_age_s` old."""

from __future__ import annotations

import time

from fastapi import Request
from redis.asyncio import Redis

from ..defaults import DEFAULT_MODEL
from ..stats import read_cluster_stats
from .errors import NoWorker

# A worker that just died is still counted this long (s); its jobs then wait in the queue
# for another, as any queued job does. Refreshing at most once a second keeps the check off
# the submit path's Redis load.
DEFAULT_MAX_AGE_S = 1.0


class LiveWorkers:
    """Live workers per model (a heartbeat key exists), cached for `max_age_s` seconds."""

    def __init__(self, redis: Redis, max_age_s: float = DEFAULT_MAX_AGE_S):
        self.redis, self.max_age_s = redis, max_age_s
        self._counts: dict[str, int] = {}
        self._read_at = -float("inf")

    async def counts(self) -> dict[str, int]:
        """Live workers by model name (models without one are absent)."""
        if time.monotonic() - self._read_at > self.max_age_s:
            self._counts = (await read_cluster_stats(self.redis)).live_workers
            self._read_at = time.monotonic()
        return self._counts


async def require_live_worker(request: Request, model: str | None) -> None:
    """Raise NoWorker when `model` (default `DEFAULT_MODEL`) is registered but no live
    worker serves it; an unregistered model is left to `submit`'s UnknownModel."""
    model = DEFAULT_MODEL if model is None else model
    if not isinstance(model, str):
        return  # submit names the bad field
    live: LiveWorkers = request.app.state.live_workers
    if (await live.counts()).get(model, 0) > 0:
        return
    registered = await request.app.state.client.models()
    if model in registered:
        raise NoWorker(f"no live worker serves model {model!r} now")
