"""The dead-worker reaper: jobs held by a worker whose heartbeat expired go back to intake.

Every live worker runs it on a timer; ``prefillq reap`` runs it once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import ResponseError

from . import keys, stats
from . import scripts as transitions
from .defaults import DEFAULT_RESULT_TTL_S
from .queues import job_id_of, move_to_intake, requeue_to_intake
from .schema import now
from .scripts import Scripts

log = logging.getLogger("prefillq.reaper")


@dataclass(frozen=True)
class Reaped:
    worker: str
    job_id: str
    outcome: str  # "queued", "failed", "canceled" or "fenced" (not ours to move)


def dead_workers(redis: Redis) -> list[str]:
    """Registered workers whose heartbeat key has expired."""
    names = sorted(n.decode() for n in redis.smembers(keys.WORKERS))
    with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.exists(keys.worker_heartbeat(name))
        alive = pipe.execute()
    return [name for name, beat in zip(names, alive, strict=True) if not beat]


def _reap_job(redis: Redis, scripts: Scripts, worker: str, job_id: str,
              result_ttl_s: int) -> str:
    """Requeue (or fail) one job of dead `worker` in one MULTI; returns REAP's outcome."""
    with redis.pipeline() as pipe:
        pipe.multi()
        scripts.run(transitions.reap(
            job_id, worker, now=now(), ttl_s=result_ttl_s,
            message=f"worker {worker} stopped heartbeating while holding the job"), client=pipe)
        requeue_to_intake(redis, job_id, pipe)  # a stray RQ job is skipped by START
        return pipe.execute()[0].decode()


def reap(redis: Redis, *, result_ttl_s: int = DEFAULT_RESULT_TTL_S) -> list[Reaped]:
    """One pass: requeue (or fail) every job of every dead worker, then forget the worker.

    A worker's KV caches die with its process, so its jobs restart at cursor 0 with
    ``attempts + 1``, or end ``failed`` with ``WorkerLost`` once failures reach
    ``max_attempts``; jobs on its own queue, and those it had dequeued and not yet started
    (its taking set, `worker.taking`), move to intake. Each job moves in one fenced script
    (it must still be ``prefilling`` on the dead worker), so two reapers racing, or a worker
    declared dead that still runs, cannot double-queue or double-publish it; the jobs it
    ends are counted (`jobs.stats`) with the deletion of the worker's keys.
    """
    scripts = Scripts(redis)
    reaped = []
    for worker in dead_workers(redis):
        ended = []
        held = {raw.decode("utf-8", "replace")
                for raw in redis.smembers(keys.worker_jobs(worker))}
        # dequeued, not started: REAP answers fenced and the job is enqueued for a new take
        taking = {job_id_of(raw.decode("utf-8", "replace"))
                  for raw in redis.smembers(keys.worker_taking(worker))}
        for job_id in sorted(held | taking):
            try:
                outcome = _reap_job(redis, scripts, worker, job_id, result_ttl_s)
            except (ResponseError, ValueError) as error:  # junk in its record: not the others'
                log.error("cannot reap job %s of dead worker %s: %s", job_id, worker, error)
                continue
            reaped.append(Reaped(worker, job_id, outcome))
            ended.append(stats.terminal(outcome))
            log.warning("reaped job %s of dead worker %s: %s", job_id, worker, outcome)
        for job_id in move_to_intake(redis, worker):  # jobs routed to it, not started yet
            log.warning("moved job %s routed to dead worker %s to intake", job_id, worker)
        with redis.pipeline(transaction=False) as pipe:
            pipe.delete(keys.worker_jobs(worker))
            pipe.delete(keys.worker_taking(worker))
            pipe.delete(keys.worker_models(worker))
            pipe.delete(keys.worker_tenants(worker))
            pipe.srem(keys.WORKERS, worker)
            for state in filter(None, ended):
                stats.record_terminal(pipe, state)
            pipe.execute(raise_on_error=False)  # a count Redis refuses is dropped
    return reaped
