"""`PrefillClient`: submit prompts, poll status, cancel, and wait for results.

Imports redis, rq and msgpack only, so a web backend never pulls MLX.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq import Queue

from . import keys
from .errors import (
    InvalidRequest,
    JobCanceled,
    JobFailed,
    JobNotFound,
    JobTimeout,
    QueueFull,
    TokenOutOfRange,
    UnknownModel,
)
from .schema import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_RESULT_TTL_S,
    JobState,
    JobStatus,
    LogitsMode,
    PrefillResult,
    now,
)
from .scripts import Scripts
from .serializer import MsgpackSerializer, packb, unpackb

REDIS_URL_ENV = "PREFILLQ_REDIS_URL"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_TOP_K = 20
MAX_TOP_K = 1000
DEFAULT_MAX_QUEUE_DEPTH = 10_000
# The allow-listed job function a worker runs: one bounded chunk of one job.
CHUNK_FUNCTION = "worker.tasks.advance_prefill"
# `watch` re-reads the job at least this often (seconds), in case a pub/sub message was lost.
WATCH_RECHECK_S = 1.0


@dataclass(frozen=True)
class ModelInfo:
    """What a worker registered for a model name."""

    name: str
    vocab_size: int
    context_length: int
    architecture: str
    sha256: str


def redis_url(url: str | None = None) -> str:
    """`url`, else ``$PREFILLQ_REDIS_URL``, else ``redis://localhost:6379/0``."""
    return url or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)


def intake_queue(redis: Redis, model: str, priority: int = 0) -> Queue:
    """The RQ intake queue of `model` at `priority` (msgpack serializer)."""
    return Queue(
        keys.intake_queue(model, priority), connection=redis, serializer=MsgpackSerializer
    )


def intake_priorities(redis: Redis, model: str) -> list[int]:
    """Priorities that have an intake queue for `model`, highest first (0 always)."""
    levels = {0} | {int(p) for p in redis.smembers(keys.priorities(model))}
    return sorted(levels, reverse=True)


def requeue_to_intake(redis: Redis, job_id: str, pipeline) -> None:
    """Enqueue `job_id` on its model's intake queue at its priority (inside `pipeline`)."""
    model, priority = redis.hmget(keys.job(job_id), "model", "priority")
    if model is not None:  # an expired record needs no RQ job
        queue = intake_queue(redis, model.decode(), int(priority or 0))
        enqueue_chunk(queue, job_id, pipeline=pipeline)


def enqueue_chunk(queue: Queue, job_id: str, *, pipeline=None, at_front: bool = False) -> None:
    """Put one chunk execution of `job_id` on `queue` (an RQ job with a fresh id).

    Chunks never time out inside RQ: a chunk is bounded by its token count, and an
    exception thrown into MLX work would leave the cache half written.
    """
    queue.enqueue_call(
        CHUNK_FUNCTION,
        args=(job_id,),
        job_id=f"{job_id}-{uuid.uuid4().hex[:12]}",
        timeout=-1,
        result_ttl=0,
        failure_ttl=DEFAULT_RESULT_TTL_S,
        description=f"prefill chunk of {job_id}",
        pipeline=pipeline,
        at_front=at_front,
    )


class PrefillClient:
    """Client of the prefill queue.

    Args:
        redis: a connection (``decode_responses`` must be False).
        max_queue_depth: `submit` raises QueueFull when a model's intake holds this many.
        result_ttl_s: lifetime of the record of a job canceled before it started (workers
            set it for the jobs they end; keep the two equal).
    """

    def __init__(
        self,
        redis: Redis,
        *,
        max_queue_depth: int = DEFAULT_MAX_QUEUE_DEPTH,
        result_ttl_s: int = DEFAULT_RESULT_TTL_S,
    ):
        self.redis = redis
        self.max_queue_depth = max_queue_depth
        self.result_ttl_s = result_ttl_s
        self._scripts = Scripts(redis)

    @classmethod
    def from_url(cls, url: str | None = None, **kwargs: Any) -> PrefillClient:
        """Connect to `url`, default ``$PREFILLQ_REDIS_URL`` or ``redis://localhost:6379/0``."""
        return cls(Redis.from_url(redis_url(url)), **kwargs)

    # -- models ------------------------------------------------------------------------

    def models(self) -> dict[str, ModelInfo]:
        """Models registered by workers, by name."""
        out = {}
        for name, blob in self.redis.hgetall(keys.MODELS).items():
            info = unpackb(blob)
            out[name.decode()] = ModelInfo(name=name.decode(), **info)
        return out

    def _model(self, name: str) -> ModelInfo:
        blob = self.redis.hget(keys.MODELS, name)
        if blob is None:
            known = ", ".join(sorted(self.models())) or "none"
            raise UnknownModel(f"no registered worker serves model {name!r} (registered: {known})")
        return ModelInfo(name=name, **unpackb(blob))

    # -- submit ------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        model: str = "gemma3-270m",
        top_k: int = DEFAULT_TOP_K,
        logits: str | LogitsMode = LogitsMode.TOP_K,
        parse_special: bool = True,
        session: str | None = None,
        priority: int = 0,
        chunk_tokens: int | None = None,
        idempotency_key: str | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> str:
        """Enqueue a prefill; returns the job id.

        Exactly one of `prompt` (text; BOS per the model, special tokens parsed unless
        `parse_special` is False) or `tokens` (ids) is given. `messages` (chat) arrives
        with sessions and is rejected for now.

        Raises:
            InvalidRequest: no input or two, empty/whitespace prompt, bad top_k, logits,
                chunk_tokens or max_attempts.
            UnknownModel: no registered worker serves `model`.
            TokenOutOfRange: a token id outside the model's vocabulary.
            QueueFull: the model's intake queue is at `max_queue_depth`.
        """
        given = [x is not None for x in (prompt, tokens, messages)]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of prompt, tokens or messages")
        if messages is not None:
            raise InvalidRequest("messages (chat templates) are not supported yet")
        if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
            raise InvalidRequest("prompt is empty")
        if tokens is not None and len(tokens) == 0:
            raise InvalidRequest("tokens is empty")
        if not 0 <= int(top_k) <= MAX_TOP_K:
            raise InvalidRequest(f"top_k must be in [0, {MAX_TOP_K}], got {top_k}")
        try:
            logits_mode = LogitsMode(logits)
        except ValueError as e:
            raise InvalidRequest(f"logits must be none, top_k or full, got {logits!r}") from e
        if chunk_tokens is not None and int(chunk_tokens) < 1:
            raise InvalidRequest(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if int(max_attempts) < 1:
            raise InvalidRequest(f"max_attempts must be >= 1, got {max_attempts}")
        info = self._model(model)
        if tokens is not None:
            tokens = [int(t) for t in tokens]
            bad = next((t for t in tokens if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise TokenOutOfRange(
                    f"token id {bad} is outside the vocabulary of {model} [0, {info.vocab_size})"
                )
            if len(tokens) > info.context_length:
                raise InvalidRequest(
                    f"{len(tokens)} tokens exceed the context length {info.context_length} "
                    f"of {model}"
                )
        depth = sum(len(intake_queue(self.redis, model, p))
                    for p in intake_priorities(self.redis, model))
        if depth >= self.max_queue_depth:
            raise QueueFull(f"intake queues of {model} hold {self.max_queue_depth} jobs")
        queue = intake_queue(self.redis, model, int(priority))

        job_id = uuid.uuid4().hex
        if idempotency_key is not None:
            claimed = self.redis.set(
                keys.idempotency(idempotency_key), job_id, nx=True, ex=DEFAULT_RESULT_TTL_S
            )
            if not claimed:
                return self.redis.get(keys.idempotency(idempotency_key)).decode()
        record = {
            "job_id": job_id,
            "state": JobState.QUEUED.value,
            "model": model,
            "top_k": int(top_k),
            "logits_mode": logits_mode.value,
            "parse_special": int(bool(parse_special)),
            "priority": int(priority),
            "max_attempts": int(max_attempts),
            "attempts": 0,
            "cursor": 0,
            "chunks_done": 0,
            "cached_tokens": 0,
            "cancel_requested": 0,
            "enqueued_at": now(),
        }
        if prompt is not None:
            record["prompt"] = prompt
        else:
            record["tokens"] = packb(tokens)
        if chunk_tokens is not None:
            record["chunk_tokens"] = int(chunk_tokens)
        if session is not None:
            record["session"] = session
        if idempotency_key is not None:
            record["idempotency_key"] = idempotency_key
        with self.redis.pipeline() as pipe:  # MULTI: the record and its RQ job land together
            pipe.multi()
            pipe.hset(keys.job(job_id), mapping=record)
            pipe.sadd(keys.priorities(model), int(priority))
            enqueue_chunk(queue, job_id, pipeline=pipe)
            pipe.execute()
        return job_id

    # -- status, cancel, result ----------------------------------------------------------

    def status(self, job_id: str) -> JobStatus:
        """The job's status. Raises JobNotFound."""
        raw = self.redis.hgetall(keys.job(job_id))
        if not raw:
            raise JobNotFound(f"no job {job_id!r} (never submitted, or expired)")
        return JobStatus.from_hash(job_id, raw)

    def cancel(self, job_id: str) -> bool:
        """Cancel a job; idempotent. True if this call changed anything.

        A queued job is canceled at once; an in-flight one stops at its next chunk
        boundary (state stays ``prefilling`` with ``cancel_requested`` until then).
        Raises JobNotFound.
        """
        outcome = self._scripts.cancel(
            keys=[keys.job(job_id), keys.cancel(job_id), keys.events(job_id)],
            args=[now(), self.result_ttl_s],
        ).decode()
        if outcome == "missing":
            raise JobNotFound(f"no job {job_id!r} (never submitted, or expired)")
        return outcome in ("canceled", "requested")

    def watch(self, job_id: str, timeout: float | None = None) -> Iterator[JobStatus]:
        """Yield the job's status now and after every change until it is terminal.

        Blocks on the job's pub/sub channel (no polling). Raises JobNotFound, and
        JobTimeout when `timeout` seconds pass before a terminal state.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(keys.events(job_id))
        last = None
        try:
            while True:
                status = self.status(job_id)  # read after subscribing: no missed event
                if status != last:
                    yield status
                    last = status
                if status.state.is_terminal:
                    return
                left = WATCH_RECHECK_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise JobTimeout(f"job {job_id} is still {status.state.value}")
                pubsub.get_message(timeout=min(left, WATCH_RECHECK_S))
        finally:
            pubsub.close()

    def result(self, job_id: str, timeout: float | None = None) -> PrefillResult:
        """Wait up to `timeout` seconds for the job to finish and return its result.

        Raises:
            JobFailed: the job failed (``error_type``, ``message``).
            JobCanceled: the job was canceled.
            JobTimeout: not terminal within `timeout`.
            JobNotFound: no such job.
        """
        for status in self.watch(job_id, timeout):
            if status.state.is_terminal:
                break
        if status.state == JobState.FAILED:
            raise JobFailed(job_id, status.error["type"], status.error["message"])
        if status.state == JobState.CANCELED:
            raise JobCanceled(f"job {job_id} was canceled at cursor {status.cursor}")
        blob = self.redis.hget(keys.job(job_id), "result")
        return PrefillResult.from_blob(job_id, blob, self.redis.get(keys.logits(job_id)))
