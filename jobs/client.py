"""`PrefillClient`: submit prompts, poll status, cancel, and wait for results.

Imports redis, rq and msgpack only, so a web backend never pulls MLX.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import keys, protocol, scripts, stats
from .defaults import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_QUEUE_DEPTH,
    DEFAULT_MODEL,
    DEFAULT_REDIS_URL,
    DEFAULT_RESULT_TTL_S,
    DEFAULT_TOP_K,
    REDIS_URL_ENV,
)
from .limits import Limits
from .queues import intake_depth, new_admission
from .requests import DEFAULT_LIMITS, ModelInfo, check_against_model, name_of
from .result import PrefillResult
from .schema import JobStatus, LogitsMode
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
        return protocol.models_of(self.redis.hgetall(keys.MODELS))

    def _model(self, name: str) -> ModelInfo:
        blob = self.redis.hget(keys.MODELS, name_of("model", name))
        if blob is None:
            raise protocol.unknown_model(name, self.models())
        return protocol.model_info(name, blob)

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
        info = self._model(model)
        return self._tokenizers.get(info.sha256, lambda: protocol.tokenizer_of(
            info, self.redis.get(keys.tokenizer(info.sha256))))

    # -- submit ------------------------------------------------------------------------

    def submit(
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
        """Enqueue a prefill; returns the job id.

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
                anything reaches Redis; `jobs.requests.new_record`), naming the field: ints
                are ints (bools, floats, numeric strings refused), flags bools.
            PromptTooLarge: over ``limits.max_prompt_bytes`` of UTF-8 text; PromptTooLong:
                more ids than the context (or ``limits.max_prompt_tokens``).
            UnknownModel: no registered worker serves `model`.
            TokenOutOfRange: a token id outside the model's vocabulary.
            QueueFull: the model's intake queue is at `max_queue_depth`.
            redis.exceptions.OutOfMemoryError: Redis refused the job's write (``maxmemory``
                under ``noeviction``); nothing of the job was written, and its
                `idempotency_key` is free again. Other RedisErrors (unreachable) likewise.
        """
        record = protocol.submitted_record(
            self.limits, prompt=prompt, tokens=tokens, messages=messages,
            add_generation_prompt=add_generation_prompt, model=model, top_k=top_k,
            logits=logits, parse_special=parse_special, session=session, priority=priority,
            chunk_tokens=chunk_tokens, idempotency_key=idempotency_key,
            max_attempts=max_attempts, prompt_logprobs=prompt_logprobs,
        )
        check_against_model(record, self._model(model), self.limits)
        protocol.check_depth(model, intake_depth(self.redis, model), self.max_queue_depth)
        claim = None if idempotency_key is None else keys.idempotency(idempotency_key)
        if claim is not None:
            if not self.redis.set(claim, record.job_id, nx=True, ex=self.result_ttl_s):
                return self.redis.get(claim).decode()
        self._enqueue(record, claim)
        return record.job_id

    def _enqueue(self, record, claim: str | None) -> None:
        """Write `record` and its RQ job in one MULTI; if that fails (a write Redis refused),
        give the idempotency `claim` back before raising."""
        try:
            with self.redis.pipeline() as pipe:  # MULTI: the record and its RQ job together
                pipe.multi()
                pipe.hset(keys.job(record.job_id), mapping=record.to_hash())
                worker = self.session_holder(record.session) if record.session else None
                new_admission(self.redis, record.job_id, record.model, record.priority,
                              worker=worker).send(pipe)
                stats.record_submitted(pipe)
                pipe.execute()
        except Exception:
            if claim is not None:
                try:  # best effort: the caller sees the submit's own error
                    self._scripts.run(scripts.release(claim, record.job_id))
                except Exception:
                    pass
            raise

    def session_holder(self, session: str) -> str | None:
        """The live worker that keeps `session`'s slot (its next job is routed there), or
        None: no worker has kept it, or that worker's heartbeat has expired."""
        holder = self.redis.get(keys.session_holder(session))
        alive = holder is not None and self.redis.exists(keys.worker_heartbeat(holder.decode()))
        return protocol.live_holder(holder, bool(alive))

    # -- status, cancel, result ----------------------------------------------------------

    def status(self, job_id: str) -> JobStatus:
        """The job's status.

        Raises:
            JobNotFound: no such job (or an id no job can have: not a non-empty str).
            CorruptJob: the job's record does not decode (written by something else).
        """
        job_id = protocol.checked_id(job_id)
        return protocol.status_of(job_id, self.redis.hgetall(keys.job(job_id)))

    def cancel(self, job_id: str) -> bool:
        """Cancel a job; idempotent. True if this call changed anything.

        A queued job is canceled at once; an in-flight one stops at its next chunk
        boundary (state stays ``prefilling`` with ``cancel_requested`` until then).
        Raises JobNotFound.
        """
        outcome = self._scripts.run(protocol.cancel_call(job_id, self.result_ttl_s))
        ended = stats.terminal(outcome)  # a queued job canceled: no worker will count it
        if ended:
            with self.redis.pipeline(transaction=False) as pipe:
                stats.record_terminal(pipe, ended)
                pipe.execute(raise_on_error=False)  # best effort: the cancel has landed
        return protocol.cancel_changed(job_id, outcome)

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
        job_id = protocol.checked_id(job_id)
        deadline = protocol.watch_deadline(timeout)
        outage = protocol.Outage()
        pubsub = None
        last = None
        try:
            while True:
                try:
                    if pubsub is None:
                        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                        pubsub.subscribe(keys.events(job_id))
                    status = self.status(job_id)  # read after subscribing: no missed event
                except CONNECTION_ERRORS as error:
                    pubsub = _closed(pubsub)
                    _pause_or_raise(outage, deadline, error)
                    continue
                outage.ended()
                if status != last:
                    yield status
                    last = status
                if status.state.is_terminal:
                    return
                try:
                    pubsub.get_message(timeout=protocol.watch_wait(job_id, status, deadline))
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
        protocol.check_finished(job_id, status)
        blob = self.redis.hget(keys.job(job_id), "result")
        logits, logprobs = self.redis.mget(keys.logits(job_id), keys.prompt_logprobs(job_id))
        return protocol.result_of(job_id, blob, logits, logprobs)


def _closed(pubsub) -> None:
    """Close `pubsub` (None: nothing to close); returns None for the caller to keep."""
    if pubsub is not None:
        pubsub.close()


def _pause_or_raise(outage: protocol.Outage, deadline: float | None,
                    error: Exception) -> None:
    """Sleep before the next try during an outage, or raise `error` once it lasted too long."""
    delay = outage.retry_in(deadline)
    if delay is None:
        raise error
    time.sleep(delay)
