"""`PrefillClient`: submit prompts, poll status, cancel, and wait for results.

Imports redis, rq and msgpack only, so a web backend never pulls MLX.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import core, keys, protocol
from .defaults import (
    DEFAULT_MAX_QUEUE_DEPTH,
    DEFAULT_REDIS_URL,
    DEFAULT_RESULT_TTL_S,
    REDIS_URL_ENV,
)
from .limits import Limits
from .requests import DEFAULT_LIMITS, ModelInfo, SubmitRequest
from .result import PrefillResult
from .schema import JobStatus
from .scripts import Scripts
from .tokenizer import ServedTokenizer, TokenizerCache

# what a lost or refused connection raises
CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError)

def redis_url(url: str | None = None) -> str:
    """`url`, else ``$PREFILLQ_REDIS_URL``, else ``redis://localhost:6379/0``.

    Any URL redis-py takes: ``redis://[[user]:password@]host:port/db``, ``rediss://`` for
    TLS (its query passes options through, e.g. ``?ssl_ca_certs=/path/ca.pem``), or
    ``unix:///path.sock``. Show it only through `redacted`.
    """
    return url or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)


# query parameters of a Redis URL whose values are secrets (redis-py passes any through)
SECRET_QUERY_KEYS = ("password", "ssl_password")


def redacted(url: str) -> str:
    """`url` with its password, and any ``password``/``ssl_password`` query value, as
    ``***``: ``redis://alice:s3cret@host:6379/0`` -> ``redis://alice:***@host:6379/0``.
    The one way a Redis URL (or a checkpoint store's) is put in a log line or a message."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    shown = url
    user, at, host = parts.netloc.rpartition("@")
    if at and ":" in user:
        shown = shown.replace(parts.netloc, f"{user.partition(':')[0]}:***@{host}", 1)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if any(k.lower() in SECRET_QUERY_KEYS for k, _ in pairs):
        query = urlencode([(k, "***" if k.lower() in SECRET_QUERY_KEYS else v)
                           for k, v in pairs], safe="/*")
        shown = shown.replace(f"?{parts.query}", f"?{query}", 1)
    return shown


class PrefillClient:
    """Client of the prefill queue.

    Args:
        redis: a connection (``decode_responses`` must be False).
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
        max_queue_depth: int = DEFAULT_MAX_QUEUE_DEPTH,
        result_ttl_s: int = DEFAULT_RESULT_TTL_S,
        limits: Limits = DEFAULT_LIMITS,
    ):
        self.redis = redis
        self.max_queue_depth = max_queue_depth
        self.result_ttl_s = result_ttl_s
        self.limits = limits
        self._scripts = Scripts(redis)
        self._tokenizers = TokenizerCache()

    @classmethod
    def from_url(cls, url: str | None = None, **kwargs: Any) -> PrefillClient:
        """Connect to `url`, default ``$PREFILLQ_REDIS_URL`` or ``redis://localhost:6379/0``:
        any URL `redis_url` describes (a password, an ACL user, ``rediss://`` TLS)."""
        return cls(Redis.from_url(redis_url(url)), **kwargs)

    # -- models ------------------------------------------------------------------------

    def models(self) -> dict[str, ModelInfo]:
        """Models registered by workers, by name."""
        return self._run(core.models())

    def tokenizer(self, model: str) -> ServedTokenizer:
        """`model`'s tokenizer as its workers publish it (`jobs.tokenizer.ServedTokenizer`):
        the same ids, text and pieces as the worker's.

        Built once per model file (sha256) and client, ~1 s for Gemma 3 (a 5 MB GET, then
        loading); later calls cost one HGET, to follow a model name to a new file.

        Raises:
            UnknownModel: no registered worker serves `model`.
            TokenizerUnavailable: no tokenizer is published for it (workers of an older
                prefillq), or one of a newer format; TokenizerMalformed (a subclass): the
                published blob cannot be decoded.
        """
        info = self._run(core.model(model))
        return self._tokenizers.get(info.sha256, lambda: protocol.tokenizer_of(
            info, self._run(core.tokenizer_blob(info))))

    # -- submit ------------------------------------------------------------------------

    @core.submit_signature
    def submit(self, prompt: str | None = None, **fields: Any) -> str:
        """Enqueue a prefill; returns the job id.

        The keywords are `jobs.requests.SubmitRequest`'s fields, with their defaults.
        Exactly one of `prompt` (text; BOS per the model, special tokens parsed unless
        `parse_special` is False), `tokens` (ids) or `messages` is given. `messages` is a
        chat, ``[{"role": "user", "content": "..."}, ...]``: the worker renders it with the
        model's chat template (ending with the assistant's opening unless
        `add_generation_prompt` is False) and tokenizes the text once, special tokens
        parsed and no BOS added beyond the template's own. A model without a template fails
        the job with ``ChatTemplateMissing``; a template that refuses the chat (e.g. roles
        out of order) with ``ChatTemplateError`` and the template's message.

        Raises:
            InvalidRequest: a bad value of any argument (checked against `limits` before
                anything reaches Redis; `SubmitRequest.checked`), naming the field: ints
                are ints (bools, floats, numeric strings refused), flags bools.
            PromptTooLarge: over ``limits.max_prompt_bytes`` of UTF-8 text; PromptTooLong:
                more ids than the context (or ``limits.max_prompt_tokens``).
            UnknownModel: no registered worker serves `model`.
            TokenOutOfRange: a token id outside the model's vocabulary.
            QueueFull: the model's intake queue is at `max_queue_depth`, or the job's
                tenant has its quota of jobs queued (``keys.TENANT_MAX_QUEUED``).
            redis.exceptions.OutOfMemoryError: Redis refused the job's write (``maxmemory``
                under ``noeviction``); nothing of the job was written, and its
                `idempotency_key` is free again. Other RedisErrors (unreachable) likewise.
        """
        request = SubmitRequest(prompt, **fields)
        return self._run(core.submit(request, self.limits, self.max_queue_depth,
                                     self.result_ttl_s))

    def session_holder(self, session: str) -> str | None:
        """The live worker that keeps `session`'s slot (its next job is routed there), or
        None: no worker has kept it, or that worker's heartbeat has expired."""
        return self._run(core.session_holder(session))

    def _run(self, plan: core.Plan) -> Any:
        """`plan`'s value, each of its round trips sent here."""
        run = core.Run(plan)
        while run.trip is not None:
            run.settle(self._send)
        return run.value

    def _send(self, trip: core.Trip) -> list:
        if trip.call is not None:
            return [self._scripts.run(trip.call)]
        with self.redis.pipeline(transaction=trip.transaction) as pipe:
            trip.queue(pipe)
            return pipe.execute(raise_on_error=trip.raise_on_error)

    # -- status, cancel, result ----------------------------------------------------------

    def status(self, job_id: str) -> JobStatus:
        """The job's status.

        Raises:
            JobNotFound: no such job (or an id no job can have: not a non-empty str).
            CorruptJob: the job's record does not decode (written by something else).
        """
        return self._run(core.status(job_id))

    def cancel(self, job_id: str) -> bool:
        """Cancel a job; idempotent. True if this call changed anything.

        A queued job is canceled at once; an in-flight one stops at its next chunk
        boundary (state stays ``prefilling`` with ``cancel_requested`` until then).
        Raises JobNotFound.
        """
        return self._run(core.cancel(job_id, self.result_ttl_s))

    def watch(self, job_id: str, timeout: float | None = None) -> Iterator[JobStatus]:
        """Yield the job's status now and after every change until it is terminal.

        Blocks on the job's pub/sub channel (no polling). Rides out Redis being unreachable
        (a restart) for up to ``protocol.WATCH_OUTAGE_S`` seconds, never past `timeout`: it
        reconnects, subscribes again and re-reads the status.

        Raises:
            JobNotFound: no such job (also once a restart without persistence lost it).
            JobTimeout: `timeout` seconds passed before a terminal state.
            redis.ConnectionError, redis.TimeoutError: Redis stayed unreachable longer.
        """
        watch = protocol.Watch(job_id, timeout)
        pubsub = None
        try:
            while True:
                try:
                    if pubsub is None:
                        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                        pubsub.subscribe(keys.events(watch.job_id))
                    status = self.status(watch.job_id)  # read after subscribing: no missed event
                except CONNECTION_ERRORS as error:
                    pubsub = _closed(pubsub)
                    time.sleep(watch.retry_in(error))
                    continue
                if watch.news(status):
                    yield status
                if status.state.is_terminal:
                    return
                try:
                    pubsub.get_message(timeout=watch.wait(status))
                except CONNECTION_ERRORS:  # the next turn reconnects and re-reads
                    pubsub = _closed(pubsub)
        finally:
            _closed(pubsub)

    def result(self, job_id: str, timeout: float | None = None) -> PrefillResult:
        """Wait up to `timeout` seconds for the job to finish and return its result.

        Raises:
            JobFailed: the job failed (``error_type``, ``message``).
            JobCanceled: the job was canceled.
            JobTimeout: not terminal within `timeout`.
            JobNotFound: no such job.
            CorruptJob: the job's record or its stored result does not decode.
        """
        for status in self.watch(job_id, timeout):
            if status.state.is_terminal:
                break
        return self._run(core.result(job_id, status))


def _closed(pubsub) -> None:
    """Close `pubsub` (None: nothing to close); returns None for the caller to keep."""
    if pubsub is not None:
        pubsub.close()
