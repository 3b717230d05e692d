"""`AsyncPrefillClient`: `PrefillClient` on redis.asyncio, for asynchronous web backends.

The same methods, arguments, results and typed errors as the sync client (both build and
decode through `jobs.protocol`); every call awaits Redis instead of blocking the event
loop, and every waiting `watch` or `result` shares one pub/sub connection
(`jobs.subscriber`). Imports redis, rq and msgpack only, never MLX.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from functools import cached_property
from typing import Any

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis

from . import keys, protocol, scripts, stats
from .client import redis_url
from .defaults import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_QUEUE_DEPTH,
    DEFAULT_MODEL,
    DEFAULT_RESULT_TTL_S,
    DEFAULT_TOP_K,
)
from .limits import Limits
from .queues import intake_levels, new_admission, rq_queue_key
from .requests import DEFAULT_LIMITS, ModelInfo, check_against_model, name_of
from .result import PrefillResult
from .schema import JobStatus, LogitsMode
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
        max_queue_depth: `submit` raises QueueFull when a model's intake holds this many.
        result_ttl_s: lifetime of the record of a job canceled before it started (workers
            set it for the jobs they end; keep the two equal), and of an idempotency key's
            claim from its submit: with equal TTLs the claim ends before the record it
            names (by the job's queueing and run time), never naming an expired job.
        limits: what `submit` accepts (`jobs.limits.Limits`: prompt bytes and tokens,
            top_k, prompt_logprobs); workers check every job again against theirs.
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
        return protocol.models_of(await self.redis.hgetall(keys.MODELS))

    async def _model(self, name: str) -> ModelInfo:
        blob = await self.redis.hget(keys.MODELS, name_of("model", name))
        if blob is None:
            raise protocol.unknown_model(name, await self.models())
        return protocol.model_info(name, blob)

    @cached_property
    def _tokenizers(self) -> AsyncTokenizerCache:  # made on first use, on the loop's thread
        return AsyncTokenizerCache()

    async def tokenizer(self, model: str) -> ServedTokenizer:
        """`model`'s tokenizer as its workers publish it; errors as `PrefillClient.tokenizer`.

        Built once per model file (sha256) and client, in a thread (~1 s for Gemma 3), by
        one task that concurrent first calls share; later calls cost one HGET.
        """
        info = await self._model(model)

        async def build() -> ServedTokenizer:
            blob = await self.redis.get(keys.tokenizer(info.sha256))
            return await asyncio.to_thread(protocol.tokenizer_of, info, blob)

        return await self._tokenizers.get(info.sha256, build)

    async def _intake_depth(self, model: str) -> int:
        levels = intake_levels(await self.redis.smembers(keys.priorities(model)))
        async with self.redis.pipeline(transaction=False) as pipe:
            for priority in levels:
                pipe.llen(rq_queue_key(keys.intake_queue(model, priority)))
            return sum(await pipe.execute())

    # -- submit ------------------------------------------------------------------------

    async def submit(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
        model: str = DEFAULT_MODEL,
        top_k: int = DEFAULT_TOP_K,
        logits: str | LogitsMode = LogitsMode.TOP_K,
        parse_special: bool = True,
        session: str | None = None,
        priority: int = 0,
        prompt_logprobs: int | None = None,
        chunk_tokens: int | None = None,
        idempotency_key: str | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> str:
        """Enqueue a prefill; returns the job id. Arguments and errors as
        `PrefillClient.submit` (InvalidRequest and its subclasses PromptTooLong,
        PromptTooLarge, UnknownModel, TokenOutOfRange; QueueFull), checked against this
        client's `limits`.

        The record, the RQ job hash and its queue push land in one MULTI, as the sync
        client's; its writes are `jobs.queues.new_admission`'s, as the sync client's.
        """
        record = protocol.submitted_record(
            self.limits, prompt=prompt, tokens=tokens, messages=messages,
            add_generation_prompt=add_generation_prompt, model=model, top_k=top_k,
            logits=logits, parse_special=parse_special, session=session, priority=priority,
            chunk_tokens=chunk_tokens, idempotency_key=idempotency_key,
            max_attempts=max_attempts, prompt_logprobs=prompt_logprobs,
        )
        check_against_model(record, await self._model(model), self.limits)
        protocol.check_depth(model, await self._intake_depth(model), self.max_queue_depth)
        claim = None if idempotency_key is None else keys.idempotency(idempotency_key)
        if claim is not None:
            if not await self.redis.set(claim, record.job_id, nx=True, ex=self.result_ttl_s):
                return (await self.redis.get(claim)).decode()
        try:
            worker = await self.session_holder(session) if session else None
            async with self.redis.pipeline(transaction=True) as pipe:  # MULTI, as the sync one
                pipe.hset(keys.job(record.job_id), mapping=record.to_hash())
                new_admission(self.redis, record.job_id, model, record.priority,
                              worker=worker).send(pipe)
                stats.record_submitted(pipe)
                await pipe.execute()
        except Exception:
            if claim is not None:  # as the sync client: the key is free again
                try:
                    await self._scripts.run(scripts.release(claim, record.job_id))
                except Exception:
                    pass
            raise
        return record.job_id

    async def session_holder(self, session: str) -> str | None:
        """The live worker that keeps `session`'s slot (its next job is routed there), or
        None: no worker has kept it, or that worker's heartbeat has expired."""
        holder = await self.redis.get(keys.session_holder(session))
        alive = holder is not None and await self.redis.exists(
            keys.worker_heartbeat(holder.decode()))
        return protocol.live_holder(holder, bool(alive))

    # -- status, cancel, result ----------------------------------------------------------

    async def status(self, job_id: str) -> JobStatus:
        """The job's status. Raises JobNotFound, CorruptJob (as `PrefillClient.status`)."""
        job_id = protocol.checked_id(job_id)
        return protocol.status_of(job_id, await self.redis.hgetall(keys.job(job_id)))

    async def cancel(self, job_id: str) -> bool:
        """Cancel a job; idempotent. True if this call changed anything (see
        `PrefillClient.cancel`). Raises JobNotFound."""
        outcome = await self._scripts.run(protocol.cancel_call(job_id, self.result_ttl_s))
        ended = stats.terminal(outcome)  # a queued job canceled: no worker will count it
        if ended:
            async with self.redis.pipeline(transaction=False) as pipe:
                stats.record_terminal(pipe, ended)
                await pipe.execute(raise_on_error=False)  # best effort: the cancel has landed
        return protocol.cancel_changed(job_id, outcome)

    async def watch(self, job_id: str, timeout: float | None = None) -> AsyncIterator[JobStatus]:
        """Yield the job's status now and after every change until it is terminal.

        Awaits the job's pub/sub channel on the client's one subscriber (no polling; a
        re-read at least every WATCH_RECHECK_S covers a lost message). Rides out Redis being
        unreachable (a restart) for up to ``protocol.WATCH_OUTAGE_S`` seconds, never past
        `timeout`, as `PrefillClient.watch` does.

        Raises:
            JobNotFound: no such job (also once a restart without persistence lost it).
            JobTimeout: `timeout` seconds passed before a terminal state.
            redis.ConnectionError, redis.TimeoutError: Redis stayed unreachable longer.
        """
        job_id = protocol.checked_id(job_id)
        deadline = protocol.watch_deadline(timeout)
        outage = protocol.Outage()
        async with self.subscriber.subscribe(keys.events(job_id)) as events:
            # the first read waits for the SUBSCRIBE's confirmation: no event is missed
            await events.wait(protocol.subscribe_wait(deadline))
            last = None
            while True:
                try:
                    status = await self.status(job_id)
                except CONNECTION_ERRORS as error:  # the subscriber reconnects on its own
                    delay = outage.retry_in(deadline)
                    if delay is None:
                        raise error
                    await asyncio.sleep(delay)
                    continue
                outage.ended()
                if status != last:
                    yield status
                    last = status
                if status.state.is_terminal:
                    return
                await events.wait(protocol.watch_wait(job_id, status, deadline))

    async def result(self, job_id: str, timeout: float | None = None) -> PrefillResult:
        """Wait up to `timeout` seconds for the job to finish and return its result.

        Raises:
            JobFailed: the job failed (``error_type``, ``message``).
            JobCanceled: the job was canceled.
            JobTimeout: not terminal within `timeout`.
            JobNotFound: no such job.
            CorruptJob: the job's record or its stored result does not decode.
        """
        async with aclosing(self.watch(job_id, timeout)) as statuses:  # unsubscribes at once
            async for status in statuses:
                if status.state.is_terminal:
                    break
        protocol.check_finished(job_id, status)
        blob = await self.redis.hget(keys.job(job_id), "result")
        logits, logprobs = await self.redis.mget(keys.logits(job_id),
                                                 keys.prompt_logprobs(job_id))
        return protocol.result_of(job_id, blob, logits, logprobs)
