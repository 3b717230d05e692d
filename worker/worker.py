"""`PrefillWorker`: an RQ SimpleWorker that advances prefill jobs one bounded chunk at a time.

The model and every admitted job's KV cache live in this process across RQ executions.
One execution of ``worker.tasks.advance_prefill(job_id)`` (DESIGN.md §4):

1. a canceled job is stopped (cache dropped, ``canceled`` recorded) before any compute;
2. on its first execution here the job is started (atomically ``queued -> prefilling``),
   tokenized, validated and planned, and its cache allocated;
3. the next chunk runs and its cache state is evaluated;
4. cursor and chunk count are recorded unless the job was canceled or taken from us;
5. after the last chunk the final logits and ``finished`` are published in one script;
   otherwise the continuation is enqueued on this worker's sticky queue in the same MULTI
   as step 4, so the cache holder is the only one that continues it.

Admission: while fewer than ``max_active`` jobs are resident the intake queues are read
before the sticky queue, so a new job waits at most for the chunk in progress; admitted
jobs then advance round-robin (the sticky queue is FIFO).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.timeouts import BaseDeathPenalty

from jobs import keys
from jobs.defaults import (
    DEFAULT_HEARTBEAT_TTL_S,
    DEFAULT_LOGITS_TTL_S,
    DEFAULT_MAX_ACTIVE,
    DEFAULT_RESULT_TTL_S,
    MAX_ERROR_CHARS,
)
from jobs.queues import (
    CHUNK_FUNCTION,
    enqueue_chunk,
    intake_priorities,
    intake_queue,
    requeue_to_intake,
    sticky_queue,
)
from jobs.reaper import reap
from jobs.record import JobRecord
from jobs.schema import LogitsMode, now
from jobs.scripts import Scripts
from jobs.serializer import MsgpackSerializer, packb
from model.prefill import Prefill, PrefillError, top_k
from model.registry import LoadedModel
from model.tokenizer import TokenizerError

log = logging.getLogger("prefillq.worker")



class NoDeathPenalty(BaseDeathPenalty):
    """Chunks are never interrupted: an exception thrown into MLX work would leave the cache
    half written. A chunk is bounded by its token count instead of a timer."""

    def setup_death_penalty(self) -> None:
        pass

    def cancel_death_penalty(self) -> None:
        pass


@dataclass
class ActiveJob:
    """A job whose KV cache this worker holds."""

    job_id: str
    attempt: int
    max_attempts: int
    model: LoadedModel
    prefill: Prefill
    top_k: int
    logits_mode: LogitsMode
    enqueued_at: float
    first_started_at: float
    started_at: float

    @property
    def keys(self) -> list[str]:
        """KEYS of the fenced scripts: job hash, cancel flag, events channel, logits."""
        j = self.job_id
        return [keys.job(j), keys.cancel(j), keys.events(j), keys.logits(j)]


_current = threading.local()


def current_worker() -> PrefillWorker:
    """The worker executing the current RQ job (set around each execution)."""
    worker = getattr(_current, "worker", None)
    if worker is None:
        raise RuntimeError("advance_prefill runs only inside a PrefillWorker")
    return worker


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class PrefillWorker(SimpleWorker):
    """Serves the models in `models` from their intake queues.

    Args:
        models: loaded models by registry name.
        connection: Redis connection (bytes responses).
        name: worker name (also names its sticky queue); default host-pid-random.
        chunk_tokens: cap on chunk size in tokens (a job's own cap may be smaller).
        max_active: jobs resident at once.
        kv_budget_bytes: no new job is admitted while resident KV bytes exceed this.
        result_ttl_s, logits_ttl_s: lifetime of a terminal job's record and full logits.
        heartbeat_ttl_s: the worker counts as dead this long after its last heartbeat.
    """

    death_penalty_class = NoDeathPenalty

    def __init__(
        self,
        models: dict[str, LoadedModel],
        connection,
        *,
        name: str | None = None,
        chunk_tokens: int | None = None,
        max_active: int = DEFAULT_MAX_ACTIVE,
        kv_budget_bytes: int | None = None,
        result_ttl_s: int = DEFAULT_RESULT_TTL_S,
        logits_ttl_s: int = DEFAULT_LOGITS_TTL_S,
        heartbeat_ttl_s: int = DEFAULT_HEARTBEAT_TTL_S,
    ):
        if not models:
            raise ValueError("a worker needs at least one model")
        name = name or default_worker_name()
        self.models = models
        self.chunk_tokens = chunk_tokens
        self.max_active = max(1, max_active)
        self.kv_budget_bytes = kv_budget_bytes
        self.result_ttl_s, self.logits_ttl_s = result_ttl_s, logits_ttl_s
        self.heartbeat_ttl_s = max(1, heartbeat_ttl_s)
        self.intake = [intake_queue(connection, m) for m in models]
        self.sticky = sticky_queue(connection, name)
        super().__init__(
            [self.sticky, *self.intake],
            connection=connection,
            name=name,
            serializer=MsgpackSerializer,
        )
        self.active: dict[str, ActiveJob] = {}
        self._room_needed = False  # a job waits for KV room: admit nothing until one leaves
        self.scripts = Scripts(connection)
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    # -- registration and liveness ----------------------------------------------------

    def register_models(self) -> None:
        """Advertise this worker's models (vocab, context) so clients can validate submits."""
        for name, loaded in self.models.items():
            info = {
                "vocab_size": loaded.vocab_size,
                "context_length": loaded.context_length,
                "architecture": loaded.architecture,
                "sha256": loaded.sha256,
            }
            self.connection.hset(keys.MODELS, name, packb(info))
        self.connection.sadd(keys.WORKERS, self.name)
        self._beat()

    def _beat(self) -> None:
        self.connection.set(keys.worker_heartbeat(self.name), now(), ex=self.heartbeat_ttl_s)

    def _heartbeat_loop(self) -> None:
        # The key outlives several missed beats (refreshed every ttl/6 from this thread, so a
        # long chunk never delays it); dead workers are looked for once per ttl.
        interval = self.heartbeat_ttl_s / 6
        next_reap = time.monotonic() + self.heartbeat_ttl_s
        while not self._heartbeat_stop.wait(interval):
            try:
                self.register_models()  # idempotent; restores a Redis that lost its data
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + self.heartbeat_ttl_s
                    reap(self.connection, result_ttl_s=self.result_ttl_s)
            except Exception:  # a Redis outage must not kill the beat thread
                log.warning("heartbeat or reap failed; retrying", exc_info=True)

    def bootstrap(self, *args, **kwargs) -> None:
        super().bootstrap(*args, **kwargs)
        self.register_models()
        self._heartbeat_stop.clear()
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name="prefillq-heartbeat", daemon=True
        )
        self._heartbeat_thread.start()

    def teardown(self) -> None:
        self.hand_back_active()
        try:  # continuations of handed-back jobs: nobody holds their caches any more
            self.sticky.delete(delete_jobs=True)
        except Exception:
            log.warning("could not delete sticky queue %s", self.sticky.name, exc_info=True)
        self._heartbeat_stop.set()
        try:
            self.connection.delete(keys.worker_heartbeat(self.name))
            self.connection.srem(keys.WORKERS, self.name)
        except Exception:
            log.warning("could not deregister %s", self.name, exc_info=True)
        super().teardown()

    # -- admission ----------------------------------------------------------------------

    @property
    def resident_kv_bytes(self) -> int:
        return sum(a.prefill.cache.nbytes for a in self.active.values())

    def admitting(self) -> bool:
        if len(self.active) >= self.max_active or self._room_needed:
            return False
        return self.kv_budget_bytes is None or self.resident_kv_bytes < self.kv_budget_bytes

    def intake_by_priority(self) -> list[Queue]:
        """Every intake queue of every served model, highest priority first."""
        levels = sorted(
            ((p, m) for m in self.models for p in intake_priorities(self.connection, m)),
            key=lambda level: -level[0],
        )
        return [intake_queue(self.connection, m, p) for p, m in levels]

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        # New jobs first while there is room (a short job waits at most one chunk), else
        # only continuations, which the sticky queue serves round-robin.
        if self.admitting():
            self._ordered_queues = [*self.intake_by_priority(), self.sticky]
        else:
            self._ordered_queues = [self.sticky]
        return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            allowed = job.func_name == CHUNK_FUNCTION
        except Exception:  # undecodable payload
            allowed = False
        if not allowed:
            log.error("refusing RQ job %s: only %s runs here", job.id, CHUNK_FUNCTION)
            self.handle_job_failure(job, queue, exc_string=f"not allow-listed: {job.id}")
            return
        _current.worker = self
        try:
            super().execute_job(job, queue)
        finally:
            _current.worker = None

    # -- the chunk step ---------------------------------------------------------------

    def advance(self, job_id: str) -> None:
        """Run one chunk of `job_id` (the body of ``advance_prefill``)."""
        active = self.active.get(job_id) or self._start(job_id)
        if active is None:
            return
        if self.connection.exists(keys.cancel(job_id)):
            self._checkpoint(active, enqueue=False)  # records `canceled`
            return
        t0 = time.perf_counter()
        try:
            n = active.prefill.step()
        except Exception as error:  # the job's boundary: record it, keep serving
            self._chunk_failed(active, error)
            return
        dt = time.perf_counter() - t0
        p = active.prefill
        log.info(
            "job %s chunk %d: %d/%d tokens, %.0f ms, %.0f tok/s",
            job_id, p.chunks_done, p.cursor, p.n_tokens, dt * 1e3, n / dt,
        )
        if p.done:
            self._publish(active)
        else:
            self._checkpoint(active, enqueue=True)
        self._stop_canceled()

    def _stop_canceled(self) -> None:
        """Stop every other resident job with a pending cancel now, not at its next turn:
        its KV cache is released within one chunk time of the cancel."""
        waiting = list(self.active.values())
        if not waiting:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for active in waiting:
                pipe.exists(keys.cancel(active.job_id))
            flags = pipe.execute()
        for active, flagged in zip(waiting, flags, strict=True):
            if flagged:
                self._checkpoint(active, enqueue=False)  # records `canceled`, drops it

    def _start(self, job_id: str) -> ActiveJob | None:
        """First execution of a job here: tokenize, plan, check the KV budget, then take it
        (``queued -> prefilling``). Returns None when the job is not ours to run."""
        raw = self.connection.hgetall(keys.job(job_id))
        if not raw:
            log.warning("job %s has no record (expired?); skipping", job_id)
            return None
        record = JobRecord.from_hash(job_id, raw)
        loaded = self.models.get(record.model)
        if loaded is None:
            log.error("job %s wants model %s, not served here", job_id, record.model)
            return None
        prefill, error = None, None
        try:
            prefill = loaded.start_prefill(self._token_ids(loaded, record),
                                           self._chunk_tokens(record))
        except (PrefillError, TokenizerError) as e:
            error = (type(e).__name__, str(e))
        except Exception as e:
            log.exception("job %s: could not start", job_id)
            error = ("ModelError", f"{type(e).__name__}: {e}")
        if prefill is not None and not self._fits_kv_budget(prefill):
            self._wait_for_room(job_id, loaded.name, record.priority)
            return None
        outcome, attempt = self.scripts.start(
            keys=[keys.job(job_id), keys.events(job_id)],
            args=[self.name, now(), uuid.uuid4().hex],
        )
        if outcome != b"started":
            log.info("job %s is %s; not starting it", job_id, outcome.decode())
            return None
        if error is not None:
            self._fail(job_id, (self.name, int(attempt)), *error)
            return None
        self.connection.sadd(keys.worker_jobs(self.name), job_id)
        started = now()
        active = ActiveJob(
            job_id=job_id,
            attempt=int(attempt),
            max_attempts=record.max_attempts,
            model=loaded,
            prefill=prefill,
            top_k=record.top_k,
            logits_mode=record.logits_mode,
            enqueued_at=record.enqueued_at or started,
            first_started_at=record.first_started_at or started,
            started_at=started,
        )
        self.active[job_id] = active
        return active if self._checkpoint(active, enqueue=False) == "continue" else None

    def _fits_kv_budget(self, prefill: Prefill) -> bool:
        """A job alone always fits (else it could never run); others must leave it room."""
        if self.kv_budget_bytes is None or not self.active:
            return True
        return self.resident_kv_bytes + prefill.cache.nbytes <= self.kv_budget_bytes

    def _wait_for_room(self, job_id: str, model: str, priority: int) -> None:
        """Put a job that does not fit back at the head of its intake queue, untouched, and
        admit nothing until a resident job leaves."""
        queue = intake_queue(self.connection, model, priority)
        enqueue_chunk(queue, job_id, at_front=True)
        self._room_needed = True
        log.info("job %s waits for KV room (%d bytes resident)", job_id,
                 self.resident_kv_bytes)

    @staticmethod
    def _token_ids(loaded: LoadedModel, record: JobRecord) -> list[int]:
        if record.tokens is not None:
            return record.tokens
        return loaded.tokenizer.encode(record.prompt or "", parse_special=record.parse_special)

    def _chunk_tokens(self, record: JobRecord) -> int | None:
        caps = [c for c in (self.chunk_tokens, record.chunk_tokens) if c is not None]
        return min(caps) if caps else None

    def _fence_args(self, active: ActiveJob) -> list:
        return [self.name, active.attempt, now(), self.result_ttl_s]

    def _checkpoint(self, active: ActiveJob, *, enqueue: bool) -> str:
        """Record progress; with `enqueue`, queue the continuation in the same MULTI.

        Returns ``continue``, ``canceled`` or ``fenced``; on the latter two the job is
        dropped here (the stray continuation, if any, finds it gone and does nothing).
        """
        p = active.prefill
        args = [*self._fence_args(active), p.cursor, p.chunks_done, p.n_tokens,
                p.plan.recovery_position]
        with self.connection.pipeline() as pipe:
            pipe.multi()
            self.scripts.checkpoint(keys=active.keys[:3], args=args, client=pipe)
            if enqueue:
                enqueue_chunk(self.sticky, active.job_id, pipeline=pipe)
            outcome = pipe.execute()[0].decode()
        if outcome != "continue":
            log.info("job %s %s at %d/%d", active.job_id, outcome, p.cursor, p.n_tokens)
            self._drop(active)
        return outcome

    def _publish(self, active: ActiveJob) -> None:
        p, loaded = active.prefill, active.model
        logits = p.logits()
        finished = now()
        prefill_s = max(finished - active.first_started_at, 1e-9)
        result = {
            "n_tokens": p.n_tokens,
            "cached_tokens": 0,
            "chunks_done": p.chunks_done,
            "top_k": [
                {"id": t.id, "logit": t.logit, "logprob": t.logprob,
                 "piece": loaded.tokenizer.piece(t.id)}
                for t in top_k(logits, active.top_k)
            ],
            "timings": {
                "queue_wait_s": active.first_started_at - active.enqueued_at,
                "prefill_s": prefill_s,
                "compute_s": p.compute_seconds,
                "tokens_per_s": p.n_tokens / prefill_s,
            },
            "model_sha256": loaded.sha256,
        }
        full = b""
        if active.logits_mode == LogitsMode.FULL:
            full = packb(np.asarray(logits, dtype="<f4").tobytes())
        args = [*self._fence_args(active), packb(result), full, self.logits_ttl_s,
                p.cursor, p.chunks_done]
        outcome = self.scripts.publish(keys=active.keys, args=args).decode()
        log.info("job %s %s: %d tokens in %d chunks, %.2f s",
                 active.job_id, outcome, p.n_tokens, p.chunks_done, prefill_s)
        self._drop(active)

    def _fail(self, job_id: str, fence: tuple[str, int], error_type: str, message: str) -> None:
        worker, attempt = fence
        self.scripts.fail(
            keys=[keys.job(job_id), keys.cancel(job_id), keys.events(job_id)],
            args=[worker, attempt, now(), self.result_ttl_s, error_type,
                  message[:MAX_ERROR_CHARS]],
        )
        self.active.pop(job_id, None)
        self.connection.srem(keys.worker_jobs(self.name), job_id)
        log.warning("job %s failed: %s: %s", job_id, error_type, message[:200])

    def _chunk_failed(self, active: ActiveJob, error: Exception) -> None:
        """A chunk raised: the cache is poisoned. Back to intake at cursor 0, or `failed`
        with ``ModelError`` once the job's failures reach ``max_attempts``."""
        log.error("job %s: chunk failed at %d/%d", active.job_id, active.prefill.cursor,
                  active.prefill.n_tokens, exc_info=error)
        self._requeue(active, failure=("ModelError", f"{type(error).__name__}: {error}"))

    def _requeue(self, active: ActiveJob, failure: tuple[str, str] | None = None) -> None:
        """Hand `active` back to intake (its cache dies here); `failure` counts toward
        ``max_attempts`` as ``(error type, message)``, a hand-back (None) does not."""
        error_type, message = failure or ("", "")
        args = [*self._fence_args(active), "1" if failure else "0", error_type,
                message[:MAX_ERROR_CHARS]]
        with self.connection.pipeline() as pipe:
            pipe.multi()
            self.scripts.requeue(keys=active.keys[:3], args=args, client=pipe)
            requeue_to_intake(self.connection, active.job_id, pipe)
            outcome = pipe.execute()[0].decode()
        log.info("job %s handed back: %s", active.job_id, outcome)
        self._drop(active)

    def hand_back_active(self) -> None:
        """Requeue every resident job to intake (warm shutdown)."""
        for active in list(self.active.values()):
            try:
                self._requeue(active)
            except Exception:
                log.exception("could not hand back job %s", active.job_id)

    def _drop(self, active: ActiveJob) -> None:
        self.active.pop(active.job_id, None)
        self._room_needed = False
        self.connection.srem(keys.worker_jobs(self.name), active.job_id)
