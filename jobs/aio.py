"""`AsyncPrefillClient`: `PrefillClient` on redis.asyncio, for asynchronous web backends.

The same methods, arguments, results and typed errors as the sync client (both run the
plans of `jobs.core`); every call awaits Redis instead of blocking the event
loop, and every waiting `watch` or `result` shares one pub/sub connection
(`jobs.subscriber`). Imports redis, rq and msgpack only, never MLX.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import cached_property
from typing import Any

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis

from . import core, keys, protocol
from .client import redis_url
from .defaults import DEFAULT_MAX_QUEUE_DEPTH, DEFAULT_RESULT_TTL_S
from .limits import Limits
from .requests import DEFAULT_LIMITS, ModelInfo, SubmitRequest
from .result import PrefillResult
from .schema import JobStatus
from .scripts import Scripts
from .subscriber import CONNECTION_ERRORS, Subscriber
from .tokenizer import AsyncTokenizerCache, ServedTokenizer

# Connections `from_url` opens for commands; beyond them a call waits for a free one
# (redis.asyncio's plain pool raises MaxConnectionsError at 100 concurrent calls).
DEFAULT_MAX_CONNECTIONS = 64


class AsyncPrefillClient:
    """Asyncio client of the prefill queue (see `PrefillClient` for the semantics).

    Every `watch` and `result` of one client waits through its one `Subscriber`: a single
    pub/sub connection however many calls wait at once.

    Args:
        redis: a redis.asyncio connection (``decode_responses`` must be False).
        pubsub_redis: the client whose pool lends the subscriber its one connection
            (default `redis`: one of its connections, from the first wait to `aclose`);
            ``decode_responses`` False and no ``health_check_interval`` (see `Subscriber`).
        max_queue_depth, result_ttl_s, limits: as `PrefillClient`'s.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        pubsub_redis: Redis | None = None,
        max_queue_depth: int = DEFAULT_MAX_QUEUE_DEPTH,
        result_ttl_s: int = DEFAULT_RESULT_TTL_S,
        limits: Limits = DEFAULT_LIMITS,
    ):
        self.redis = redis
        self.pubsub_redis = redis if pubsub_redis is None else pubsub_redis
        self.subscriber = Subscriber(self.pubsub_redis)
        self.max_queue_depth = max_queue_depth
        self.result_ttl_s = result_ttl_s
        self.limits = limits
        self._scripts = Scripts(redis)

    @classmethod
    def from_url(cls, url: str | None = None, *,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 **kwargs: Any) -> AsyncPrefillClient:
        """Connect to `url`, default ``$PREFILLQ_REDIS_URL`` or ``redis://localhost:6379/0``
        (any URL `jobs.client.redis_url` describes: a password, an ACL user, ``rediss://``
        TLS; connections open on first use): up to `max_connections` for commands (more
        concurrent calls wait for one), and one more, of its own, for the pub/sub
        subscriber every `watch` and `result` waits through. `kwargs` go to the
        constructor."""
        url = redis_url(url)
        commands = BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                   timeout=None)
        # its own pool: commands never queue behind it, and it never waits for a command's
        pubsub = ConnectionPool.from_url(url, max_connections=1)
        # from_pool: closing the client closes its pool
        return cls(Redis.from_pool(commands), pubsub_redis=Redis.from_pool(pubsub), **kwargs)

    async def aclose(self) -> None:
        """Stop the subscriber and close the connection pools."""
        await self.subscriber.aclose()
        await self.redis.aclose()
        if self.pubsub_redis is not self.redis:
            await self.pubsub_redis.aclose()

    async def __aenter__(self) -> AsyncPrefillClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- models ------------------------------------------------------------------------

    async def models(self) -> dict[str, ModelInfo]:
        """Models registered by workers, by name."""
        return await self._run(core.models())

    @cached_property
    def _tokenizers(self) -> AsyncTokenizerCache:  # made on first use, on the loop's thread
        return AsyncTokenizerCache()

    async def tokenizer(self, model: str) -> ServedTokenizer:
        """`model`'s tokenizer as its workers publish it; errors as `PrefillClient.tokenizer`.

        Built once per model file (sha256) and client, in a thread (~1 s for Gemma 3), by
        one task that concurrent first calls share; later calls cost one HGET.
        """
        info = await self._run(core.model(model))

        async def build() -> ServedTokenizer:
            blob = await self._run(core.tokenizer_blob(info))
            return await asyncio.to_thread(protocol.tokenizer_of, info, blob)

        return await self._tokenizers.get(info.sha256, build)

    # -- submit ------------------------------------------------------------------------

    @core.submit_signature
    async def submit(self, prompt: str | None = None, **fields: Any) -> str:
        """Enqueue a prefill; returns the job id. Arguments and errors as
        `PrefillClient.submit` (InvalidRequest and its subclasses PromptTooLong,
        PromptTooLarge, UnknownModel, TokenOutOfRange; QueueFull), checked against this
        client's `limits`; the same round trips (`jobs.core.submit`), the record and its RQ
        job in one MULTI."""
        request = SubmitRequest(prompt, **fields)
        return await self._run(core.submit(request, self.limits, self.max_queue_depth,
                                           self.result_ttl_s))

    async def session_holder(self, session: str) -> str | None:
        """The live worker that keeps `session`'s slot (its next job is routed there), or
        None: no worker has kept it, or that worker's heartbeat has expired."""
        return await self._run(core.session_holder(session))

    async def _run(self, plan: core.Plan) -> Any:
        """`plan`'s value, each of its round trips awaited here."""
        run = core.Run(plan)
        while run.trip is not None:
            await run.asettle(self._send)
        return run.value

    async def _send(self, trip: core.Trip) -> list:
        if trip.call is not None:
            return [await self._scripts.run(trip.call)]
        async with self.redis.pipeline(transaction=trip.transaction) as pipe:
            trip.queue(pipe)
            return await pipe.execute(raise_on_error=trip.raise_on_error)

    # -- status, cancel, result ----------------------------------------------------------

    async def status(self, job_id: str) -> JobStatus:
        """The job's status. Raises JobNotFound, CorruptJob (as `PrefillClient.status`)."""
        return await self._run(core.status(job_id))

    async def cancel(self, job_id: str) -> bool:
        """Cancel a job; idempotent. True if this call changed anything (see
        `PrefillClient.cancel`). Raises JobNotFound."""
        return await self._run(core.cancel(job_id, self.result_ttl_s))

    async def watch(self, job_id: str, timeout: float | None = None) -> AsyncIterator[JobStatus]:
        """Yield the job's status now and after every change until it is terminal; errors
        and outages as `PrefillClient.watch`.

        Awaits the job's pub/sub channel on the client's one subscriber (no polling; a
        re-read at least every WATCH_RECHECK_S covers a lost message).
        """
        watch = protocol.Watch(job_id, timeout)
        async with self.subscriber.subscribe(keys.events(watch.job_id)) as events:
            # the first read waits for the SUBSCRIBE's confirmation: no event is missed
            await events.wait(watch.first_wait())
            while True:
                try:
                    status = await self.status(watch.job_id)
                except CONNECTION_ERRORS as error:  # the subscriber reconnects on its own
                    await asyncio.sleep(watch.retry_in(error))
                    continue
                if watch.news(status):
                    yield status
                if status.state.is_terminal:
                    return
                await events.wait(watch.wait(status))

    async def result(self, job_id: str, timeout: float | None = None) -> PrefillResult:
        """Wait up to `timeout` seconds for the job to finish and return its result; errors
        as `PrefillClient.result` (JobFailed, JobCanceled, JobTimeout, JobNotFound,
        CorruptJob)."""
        async with aclosing(self.watch(job_id, timeout)) as statuses:  # unsubscribes at once
            async for status in statuses:
                if status.state.is_terminal:
                    break
        return await self._run(core.result(job_id, status))
