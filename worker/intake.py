"""What a worker reads from Redis to start a job, made safe against whatever is written there.

Anyone who can write Redis can push junk onto the queues or into a job's record; it is
dropped or fails that one job, never the worker (docs/architecture.md, Garbage in Redis).
"""

from __future__ import annotations

import logging

from rq.intermediate_queue import IntermediateQueue

from jobs import keys, protocol, stats
from jobs import scripts as transitions
from jobs.errors import CorruptJob, UnknownModel
from jobs.queues import requeue_to_intake
from jobs.record import JobRecord
from jobs.schema import now
from jobs.scripts import Scripts

log = logging.getLogger("prefillq.worker")


def fetch_or_drop(connection, queue_key: str, raw_id: bytes | str, job_class, serializer):
    """The RQ job `raw_id` popped from `queue_key`, or None (dropped, logged) when it is
    junk: not UTF-8, no such RQ job, or a hash that does not decode. The worker's RQ
    ``queue_class`` (`worker.taking.TakingQueue`) calls it on every popped id and pops the
    next on None: RQ's own loop would let either exception end the worker."""
    return fetch_many_or_drop(connection, [(queue_key, raw_id)], job_class, serializer)[0]


def fetch_many_or_drop(connection, popped: list[tuple[str, bytes | str]], job_class,
                       serializer, expire_s: int | None = None) -> list:
    """`fetch_or_drop` of each ``(queue key, raw id)`` of `popped`, their hashes read in one
    round trip; None in place of each junk id. With `expire_s`, each hash expires in that
    many seconds (set in the same round trip), so none outlives a worker that dies with it
    popped: the reaper re-enqueues the job under a new RQ id."""
    ids: list[str | None] = []
    for _, raw_id in popped:
        try:
            ids.append(raw_id.decode() if isinstance(raw_id, bytes) else raw_id)
        except UnicodeDecodeError:
            ids.append(None)
    with connection.pipeline(transaction=False) as pipe:
        for job_id in ids:
            if job_id is not None:
                pipe.hgetall(job_class.key_for(job_id))
                if expire_s is not None:
                    pipe.expire(job_class.key_for(job_id), expire_s)
        hashes = iter(pipe.execute()[::1 if expire_s is None else 2])
    jobs = []
    for (queue_key, raw_id), job_id in zip(popped, ids, strict=True):
        job = None
        raw = next(hashes) if job_id is not None else None
        if job_id is None:
            log.warning("dropping RQ job id %r from %s: not UTF-8", raw_id, queue_key)
        elif not raw:
            log.warning("dropping RQ job id %r from %s: no such RQ job", raw_id, queue_key)
        else:
            job = _restored(job_class(job_id, connection=connection, serializer=serializer),
                            raw, queue_key)
        if job is None:  # an LMOVE left it in RQ's intermediate list, whose cleanup trips too
            connection.lrem(IntermediateQueue.get_intermediate_queue_key(queue_key), 1,
                            raw_id)
        jobs.append(job)
    return jobs


def _restored(job, raw: dict, queue_key: str):
    try:
        job.restore(raw)
    except Exception as error:  # any bytes at all: what RQ's restore raises is not ours
        log.error("dropping RQ job id %r from %s: it does not decode (%s: %s)", job.id,
                  queue_key, type(error).__name__, error)
        return None
    return job


def read_records(connection, scripts: Scripts, job_ids: list[str], result_ttl_s: int
                 ) -> list[JobRecord]:
    """The records of `job_ids`, read in one round trip, less those that are missing
    (expired; logged) or do not decode or name no model: these are failed with
    ``CorruptJob`` (unless a worker holds one or it ended: `jobs.scripts.refuse`; an ended
    one loses its undecodable fields only) and counted.

    Args:
        scripts: the worker's scripts (`REFUSE`).
        result_ttl_s: the lifetime of a failed record.
    """
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        hashes = pipe.execute()
    records = []
    for job_id, raw in zip(job_ids, hashes, strict=True):
        if not raw:
            log.warning("job %s has no record (expired?); skipping", job_id)
            continue
        try:
            record = JobRecord.from_hash(job_id, raw)
        except CorruptJob as error:
            refuse(connection, scripts, job_id, error, result_ttl_s)
            continue
        if not record.model:
            refuse(connection, scripts, job_id,
                   CorruptJob(f"job {job_id}'s record names no model"), result_ttl_s)
            continue
        records.append(record)
    return records


def refuse(connection, scripts: Scripts, job_id: str, error: CorruptJob,
           result_ttl_s: int) -> str:
    """Fail `job_id` with `error` (``REFUSE``), dropping ``error.fields`` so that its status
    reads again; returns the script's outcome (``failed``, ``unchanged`` or ``missing``)."""
    outcome = scripts.run(transitions.refuse(
        job_id, now=now(), ttl_s=result_ttl_s, error_type=type(error).__name__,
        message=str(error), drop_fields=error.fields)).decode()
    log.error("job %s: %s (%s)", job_id, error, outcome)
    ended = stats.terminal(outcome)
    if ended:
        with connection.pipeline(transaction=False) as pipe:
            stats.record_terminal(pipe, ended)
            pipe.execute(raise_on_error=False)  # best effort: the failure has landed
    return outcome


def not_served(connection, record: JobRecord) -> UnknownModel | None:
    """For a job of a model this worker does not serve (routed by its session, or written
    straight into Redis): back to its model's intake when some worker registered that model
    (None), else the ``UnknownModel`` to fail it with."""
    registered = protocol.models_of(connection.hgetall(keys.MODELS))
    if record.model in registered:
        log.warning("job %s wants model %r, not served here; to its intake",
                    record.job_id, record.model)
        requeue_to_intake(connection, record.job_id)
        return None
    error = protocol.unknown_model(record.model, registered)
    log.error("job %s: %s", record.job_id, str(error)[:200])
    return error
