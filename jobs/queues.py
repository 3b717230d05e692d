"""The RQ queue layout: intake queues per model and priority, and each worker's own queue.

A job enters through its model's intake queue (``keys.intake_queue``; one queue per priority
that has ever been used, listed in ``keys.priorities``), or through one worker's own queue
(``keys.sticky_queue``) when it is routed to that worker. Every RQ job here is the one
execution of `CHUNK_FUNCTION` that admits a prefillq job (its id the only argument): the
worker starts the job, runs its first chunk, and runs the rest in its own loop.
"""

from __future__ import annotations

import uuid

from redis import Redis
from rq import Queue

from . import keys
from .defaults import DEFAULT_RESULT_TTL_S
from .serializer import MsgpackSerializer

# The allow-listed job function a worker runs: one bounded chunk of one job.
CHUNK_FUNCTION = "worker.tasks.advance_prefill"


def intake_queue(redis: Redis, model: str, priority: int = 0) -> Queue:
    """The RQ intake queue of `model` at `priority` (msgpack serializer)."""
    return Queue(
        keys.intake_queue(model, priority), connection=redis, serializer=MsgpackSerializer
    )


def sticky_queue(redis: Redis, worker: str) -> Queue:
    """The RQ queue of the jobs routed to `worker`, which it admits before intake."""
    return Queue(keys.sticky_queue(worker), connection=redis, serializer=MsgpackSerializer)


def intake_priorities(redis: Redis, model: str) -> list[int]:
    """Priorities that have an intake queue for `model`, highest first (0 always)."""
    levels = {0} | {int(p) for p in redis.smembers(keys.priorities(model))}
    return sorted(levels, reverse=True)


def intake_depth(redis: Redis, model: str) -> int:
    """Jobs waiting in every intake queue of `model`."""
    return sum(len(intake_queue(redis, model, p)) for p in intake_priorities(redis, model))


def enqueue_chunk(queue: Queue, job_id: str, *, pipeline=None, at_front: bool = False) -> None:
    """Put the admitting execution of `job_id` on `queue` (an RQ job with a fresh id).

    It never times out inside RQ: it runs one chunk, bounded by its token count, and an
    exception thrown into MLX work would leave the cache half written.
    """
    queue.enqueue_call(  # the RQ job id is the prefillq job id + "-" + 12 hex (`job_id_of`)
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


def enqueue_new(redis: Redis, job_id: str, model: str, priority: int, pipeline, *,
                worker: str | None = None) -> None:
    """Enqueue a new job's first execution (inside `pipeline`): on its intake queue, or on
    `worker`'s own queue when it is routed there (a session's next job goes to the worker
    that keeps the session's slot)."""
    pipeline.sadd(keys.priorities(model), int(priority))
    queue = intake_queue(redis, model, priority) if worker is None else sticky_queue(redis, worker)
    enqueue_chunk(queue, job_id, pipeline=pipeline)


def job_id_of(rq_job_id: str) -> str:
    """The prefillq job id of an admitting execution enqueued by `enqueue_chunk`."""
    return rq_job_id.rsplit("-", 1)[0]


def move_to_intake(redis: Redis, worker: str) -> list[str]:
    """Hand every job routed to `worker` (its own queue) to its intake queue, then delete
    the queue: `worker` is stopping or dead, and routing is only a preference. Returns the
    job ids moved."""
    own = sticky_queue(redis, worker)
    moved = [job_id_of(rq_id) for rq_id in own.get_job_ids()]
    with redis.pipeline() as pipe:
        pipe.multi()
        for job_id in moved:
            requeue_to_intake(redis, job_id, pipe)
        pipe.execute()
    own.delete(delete_jobs=True)
    return moved


def requeue_to_intake(redis: Redis, job_id: str, pipeline=None, *,
                      at_front: bool = False) -> None:
    """Enqueue `job_id` on its model's intake queue at its priority (inside `pipeline` when
    given; at the queue's head with `at_front`). A stray execution of a job that is not
    queued any more is skipped by the worker's START."""
    model, priority = redis.hmget(keys.job(job_id), "model", "priority")
    if model is not None:  # an expired record needs no RQ job
        queue = intake_queue(redis, model.decode(), int(priority or 0))
        enqueue_chunk(queue, job_id, pipeline=pipeline, at_front=at_front)
