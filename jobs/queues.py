"""The RQ queue layout: intake queues per model and priority, and each worker's own queue.

Every RQ job on them is one admission, an execution of `ADMIT_FUNCTION` with a prefillq
job's id; `AdmissionJob` refuses any other (docs/operations.md, Security).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from redis import Redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.utils import now as rq_now

from . import keys
from .defaults import DEFAULT_RESULT_TTL_S
from .errors import JobRefused
from .serializer import MsgpackSerializer

# The allow-listed job function a worker runs: the admission of one job (it starts the job
# and runs its first chunk; the worker runs the rest in its own loop).
ADMIT_FUNCTION = "worker.tasks.advance_prefill"

# RQ options of every admission: it never times out inside RQ (it runs the job's first chunk,
# bounded by its token count, and an exception thrown into MLX work would leave the cache
# half written) and keeps no result (ours is in the job's record).
ADMIT_OPTIONS = {"timeout": -1, "result_ttl": 0, "failure_ttl": DEFAULT_RESULT_TTL_S}
# A refusal quotes at most this much of a foreign job's function name.
MAX_QUOTED_CHARS = 200


def refusal(job: Job) -> str | None:
    """Why RQ job `job` must not run on a prefillq worker, or None when it is prefillq's own
    execution: `ADMIT_FUNCTION` (no instance) with one job id (a str) as its only argument,
    and no RQ callback or webhook. Decoding the payload (msgpack) runs no code."""
    try:
        func_name, instance, args, kwargs = job.func_name, job.instance, job.args, job.kwargs
    except Exception as error:  # RQ's DeserializationError: not msgpack of RQ's 4-tuple
        return f"its payload cannot be decoded ({type(error).__name__})"
    if func_name != ADMIT_FUNCTION:
        name = repr(func_name)[:MAX_QUOTED_CHARS]
        return f"function {name} is not allow-listed (only {ADMIT_FUNCTION} runs here)"
    if (instance is not None or kwargs not in (None, {}) or not isinstance(args, list | tuple)
            or len(args) != 1 or not isinstance(args[0], str)):
        return f"{ADMIT_FUNCTION} takes one job id and nothing else"
    callbacks = (job._success_callback_name, job._failure_callback_name,
                 job._stopped_callback_name)
    if any(callbacks) or getattr(job, "webhooks", None):  # (webhooks: RQ >= 3)
        return "RQ callbacks and webhooks are not allowed"
    return None


class AdmissionJob(Job):
    """RQ's `Job` as prefillq's queues and workers use it: `func` is `ADMIT_FUNCTION` or
    raises, and RQ's callbacks and webhooks are never run or sent, whatever the job's hash
    names (prefillq sets none). Anyone who can write Redis can put an RQ job on these queues,
    and RQ would otherwise import and call whatever function, callback or webhook it names."""

    @property
    def func(self):
        """The job function (`ADMIT_FUNCTION`). Raises JobRefused for any other job."""
        reason = refusal(self)
        if reason is not None:
            raise JobRefused(reason)
        return super().func

    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None

    def send_webhooks(self, *args, **kwargs) -> None:
        """Never sent: a webhook URL in a job's hash would make the worker request it."""


def intake_queue(redis: Redis, model: str, priority: int = 0, tenant: str | None = None
                 ) -> Queue:
    """The RQ intake queue of `model` at `priority` (msgpack serializer) for `tenant`'s jobs
    (None: jobs submitted without a tenant). A model has one per priority ever used, listed
    in ``keys.priorities(model)``, and one per tenant and priority, listed in
    ``keys.tenant_levels(model)``."""
    return Queue(keys.intake_queue(model, priority, tenant), connection=redis,
                 serializer=MsgpackSerializer, job_class=AdmissionJob)


def own_queue(redis: Redis, worker: str) -> Queue:
    """The RQ queue of the jobs routed to `worker`, which it admits before intake."""
    return Queue(keys.own_queue(worker), connection=redis, serializer=MsgpackSerializer,
                 job_class=AdmissionJob)


def intake_levels(members: Iterable[bytes | int]) -> list[int]:
    """Decode SMEMBERS ``keys.priorities(model)``: the priorities, highest first (0 always)."""
    return sorted({0} | {int(p) for p in members}, reverse=True)


def tenant_levels(members: Iterable[bytes | str]) -> list[tuple[int, str]]:
    """Decode SMEMBERS ``keys.tenant_levels(model)``: its ``(priority, tenant)`` pairs,
    highest priority first, then by tenant (members that do not decode are skipped)."""
    levels = set()
    for member in members:
        text = member.decode("utf-8", "replace") if isinstance(member, bytes) else member
        priority, sep, tenant = text.partition(":")
        try:
            if sep and tenant:
                levels.add((int(priority), tenant))
        except ValueError:
            continue
    return sorted(levels, key=lambda level: (-level[0], level[1]))


def intake_levels_of(model: str, priority_members: Iterable[bytes | int],
                     tenant_members: Iterable[bytes | str]) -> list[tuple[int, str | None]]:
    """Every intake level of `model` as ``(priority, tenant)``, from SMEMBERS of
    ``keys.priorities(model)`` and ``keys.tenant_levels(model)``: the plain queues (tenant
    None) and the tenants', highest priority first."""
    plain = [(p, None) for p in intake_levels(priority_members)]
    return sorted(plain + tenant_levels(tenant_members), key=lambda level: -level[0])


def rq_queue_key(name: str) -> str:
    """The Redis list RQ keeps queue `name` in (its LLEN is the queue's length)."""
    return Queue.redis_queue_namespace_prefix + name


def new_queue_name(model: str, priority: int, worker: str | None,
                   tenant: str | None = None) -> str:
    """The queue a new job enters: `model`'s intake at `priority` for `tenant`, or
    `worker`'s own queue."""
    if worker is not None:
        return keys.own_queue(worker)
    return keys.intake_queue(model, priority, tenant)


def intake_depth(redis: Redis, model: str) -> int:
    """Jobs waiting in every intake queue of `model`, the tenants' included."""
    levels = intake_levels_of(model, redis.smembers(keys.priorities(model)),
                              redis.smembers(keys.tenant_levels(model)))
    return sum(len(intake_queue(redis, model, p, t)) for p, t in levels)


@dataclass(frozen=True)
class Admission:
    """One admitting execution of a job, as the Redis writes that enqueue it: the commands
    RQ's ``Queue.enqueue_call`` sends for a job without dependencies (SADD ``rq:queues``,
    HSET the RQ job's hash with ``status`` queued, RPUSH its id, or LPUSH at the front),
    built by RQ's own `Job` but sent by the caller, on a redis or a redis.asyncio pipeline
    (rq has no asyncio API). ``tests/jobs/test_queues.py`` checks them against RQ's.

    Attributes:
        rq_job_id: the RQ job's id (`admission_job_id`).
        writes: ``(command, args, kwargs)`` of each pipeline method to call, in order.
    """

    rq_job_id: str
    writes: tuple[tuple[str, tuple, dict], ...]

    def send(self, pipeline) -> None:
        """Queue `writes` on `pipeline` (no I/O here: the caller executes it)."""
        for command, args, kwargs in self.writes:
            getattr(pipeline, command)(*args, **kwargs)


def admission(connection, queue_name: str, job_id: str, *, at_front: bool = False) -> Admission:
    """The writes that put the admitting execution of `job_id` on queue `queue_name`: an RQ
    job with a fresh id (`admission_job_id`), msgpack serializer and `ADMIT_OPTIONS`, at the
    queue's tail (its head with `at_front`). `connection` (redis or redis.asyncio) is only
    held by RQ's `Job` object, which requires one; nothing is sent through it."""
    job = Job.create(
        ADMIT_FUNCTION, args=(job_id,), connection=connection, id=admission_job_id(job_id),
        description=admission_description(job_id), origin=queue_name, status=JobStatus.QUEUED,
        serializer=MsgpackSerializer, **ADMIT_OPTIONS,
    )
    job.enqueued_at = rq_now()
    queue_key = rq_queue_key(queue_name)
    return Admission(job.id, (
        ("sadd", (Queue.redis_queues_keys, queue_key), {}),
        ("hset", (job.key,), {"mapping": job.to_dict()}),
        ("lpush" if at_front else "rpush", (queue_key, job.id), {}),
    ))


def new_admission(connection, job_id: str, model: str, priority: int, *,
                  worker: str | None = None, tenant: str | None = None) -> Admission:
    """`admission` of a new job, on its intake queue at `priority` for `tenant` (recorded in
    ``keys.priorities(model)``, or ``keys.tenant_levels(model)`` for a tenant), or on
    `worker`'s own queue when it is routed there (a session's next job goes to the worker
    that keeps the session's slot)."""
    first = admission(connection, new_queue_name(model, priority, worker, tenant), job_id)
    level = (("sadd", (keys.priorities(model), int(priority)), {}) if tenant is None else
             ("sadd", (keys.tenant_levels(model), f"{int(priority)}:{tenant}"), {}))
    return Admission(first.rq_job_id, (level, *first.writes))


def enqueue_admission(queue: Queue, job_id: str, *, pipeline=None, at_front: bool = False) -> None:
    """Put the admitting execution of `job_id` on `queue` (`admission`), inside `pipeline`
    when given, else in a MULTI of its own."""
    writes = admission(queue.connection, queue.name, job_id, at_front=at_front)
    if pipeline is not None:
        writes.send(pipeline)
        return
    with queue.connection.pipeline() as pipe:
        writes.send(pipe)
        pipe.execute()


def enqueue_new(redis: Redis, job_id: str, model: str, priority: int, pipeline, *,
                worker: str | None = None, tenant: str | None = None) -> None:
    """Send `new_admission`'s writes on `pipeline` (the caller executes it)."""
    new_admission(redis, job_id, model, priority, worker=worker, tenant=tenant).send(pipeline)


def admission_job_id(job_id: str) -> str:
    """A fresh RQ job id for an admission of `job_id`: its id + "-" + 12 hex (`job_id_of`)."""
    return f"{job_id}-{uuid.uuid4().hex[:12]}"


def admission_description(job_id: str) -> str:
    return f"admit prefill {job_id}"


def job_id_of(rq_job_id: str) -> str:
    """The prefillq job id of an admitting execution enqueued by `enqueue_admission`."""
    return rq_job_id.rsplit("-", 1)[0]


def move_to_intake(redis: Redis, worker: str) -> list[str]:
    """Hand every job routed to `worker` (its own queue) to its intake queue, then delete
    the queue: `worker` is stopping or dead, and routing is only a preference. Returns the
    job ids moved."""
    own = own_queue(redis, worker)
    moved = [job_id_of(rq_id.decode()) for rq_id in redis.lrange(own.key, 0, -1)
             if _is_text(rq_id)]  # anything else is junk someone pushed: dropped below
    with redis.pipeline() as pipe:
        pipe.multi()
        for job_id in moved:
            requeue_to_intake(redis, job_id, pipe)
        pipe.execute()
    own.delete(delete_jobs=True)
    return moved


def _is_text(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def requeue_to_intake(redis: Redis, job_id: str, pipeline=None, *,
                      at_front: bool = False) -> None:
    """Enqueue `job_id` on its model's intake queue at its priority, its tenant's (inside
    `pipeline` when given; at the queue's head with `at_front`). A stray execution of a job
    that is not queued any more is skipped by the worker's START.

    Raises:
        UnicodeDecodeError: the record's model is not UTF-8 (junk: no intake queue has it).
    """
    model, priority, tenant = redis.hmget(keys.job(job_id), "model", "priority", "tenant")
    if model is not None:  # an expired record needs no RQ job
        queue = intake_queue(redis, model.decode(), _priority(priority), _tenant(tenant))
        enqueue_admission(queue, job_id, pipeline=pipeline, at_front=at_front)


def _tenant(raw: bytes | None) -> str | None:
    """The record's tenant, or None (none, or junk: a record the worker fails as corrupt
    goes to the plain queue)."""
    try:
        return raw.decode() or None if raw is not None else None
    except UnicodeDecodeError:
        return None


def _priority(raw: bytes | None) -> int:
    # junk in the field (its record is corrupt: the worker fails it) goes to priority 0
    try:
        return int(raw or 0)
    except ValueError:
        return 0
