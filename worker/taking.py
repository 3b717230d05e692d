"""Dequeuing that a worker's death cannot lose a job to.

Every pop is recorded in the worker's taking set until the job is started or put back, and
the reaper (`jobs.reaper`) re-enqueues the jobs a dead worker was taking.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import ClassVar

from redis import Redis
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.job import Job
from rq.utils import as_text

from jobs import keys, scripts
from jobs.scripts import Scripts

from .connection import refused_write
from .intake import fetch_many_or_drop, fetch_or_drop

log = logging.getLogger("prefillq.worker")


class TakingQueue(Queue):
    """RQ's `Queue` whose `dequeue_any` records each job it pops in one worker's taking set;
    `for_worker` makes the subclass bound to a worker (RQ calls ``dequeue_any`` on the class).

    RQ pops a job's id before the worker runs it, and a prefillq job is taken (``queued ->
    prefilling``, `jobs.scripts.start`) only after it was tokenized, planned and its cache
    allocated: a worker killed in between would leave the job ``queued`` and in no queue,
    forever. So the pop stays in ``keys.worker_taking`` until the worker has started the job
    (`taken_in_bulk`, or `taken` after an RQ execution; by then the job is held, in
    ``keys.worker_jobs``, or was put back or skipped).
    """

    taking_key: ClassVar[str] = ""
    scripts: ClassVar[Scripts | None] = None

    @classmethod
    def for_worker(cls, name: str, connection: Redis) -> type[TakingQueue]:
        """The subclass that records worker `name`'s pops, taking through `connection`."""
        return type(cls.__name__, (cls,), {"taking_key": keys.worker_taking(name),
                                           "scripts": Scripts(connection)})

    @classmethod
    def dequeue_any(cls, queues: Iterable[Queue], timeout: int | None, connection: Redis,
                    job_class: type[Job] | None = None, serializer=None,
                    death_penalty_class=None) -> tuple[Job, Queue] | None:
        """RQ's `Queue.dequeue_any` (the first job of `queues`, in order; `timeout` None
        looks once, else blocks up to `timeout` seconds), each pop recorded.

        A popped id that is not UTF-8, names no RQ job or whose RQ hash does not decode is
        logged and dropped (`worker.intake.fetch_or_drop`), and the next one popped.

        Raises:
            DequeueTimeout: nothing came within `timeout` seconds.
        """
        queue_keys = [q.key for q in queues]
        job_cls = job_class or cls.job_class
        while True:
            popped = cls._pop(connection, queue_keys, timeout)
            if popped is None:
                return None
            queue_key, raw_id = as_text(popped[0]), popped[1]
            job = fetch_or_drop(connection, queue_key, raw_id, job_cls, serializer)
            if job is None:  # junk, or expired: nothing to run, nothing for the reaper
                connection.srem(cls.taking_key, raw_id)
                continue
            return job, cls.from_queue_key(queue_key, connection=connection, job_class=job_cls,
                                           serializer=serializer,
                                           death_penalty_class=death_penalty_class)

    @classmethod
    def _pop(cls, connection: Redis, queue_keys: list[str], timeout: int | None):
        """Pop and record in one step where a queue holds a job (`jobs.scripts.take`; Redis
        lets a script that has popped go on writing under ``maxmemory``), else wait in
        BLPOP and record what it brings at once: only a death in that round trip's gap can
        still lose the job (or, where ``maxmemory`` refuses the record, a death before memory
        frees: the job's refused START parks its re-enqueue)."""
        if not queue_keys:
            return None
        popped = cls.scripts.run(scripts.take(cls.taking_key, queue_keys), client=connection)
        if popped or timeout is None:
            return popped[:2] or None
        if timeout == 0:
            raise ValueError("RQ does not support indefinite timeouts")
        popped = connection.blpop(queue_keys, timeout)
        if popped is None:
            raise DequeueTimeout(timeout, queue_keys)
        try:
            connection.sadd(cls.taking_key, popped[1])
        except Exception as error:  # maxmemory: the job's START is refused too, and parked
            if not refused_write(error):
                raise
            log.warning("Redis refused recording the pop of %s: %s", as_text(popped[1]), error)
        return popped

    @classmethod
    def take(cls, queues: Iterable[Queue], count: int, connection: Redis,
             job_class: type[Job], serializer, expire_s: int,
             caps: list[int] | None = None) -> list[tuple[Job, Queue]]:
        """Up to `count` RQ jobs of `queues`, in order (at most ``caps[i]`` of the i-th;
        None: no cap but `count`), without blocking: popped and
        recorded in one script (`jobs.scripts.take`), their hashes read in one round trip,
        junk dropped (`worker.intake.fetch_many_or_drop`). What RQ's execution of each would
        have done is the caller's (`taken_in_bulk` once they are started); their hashes
        expire in `expire_s` seconds meanwhile."""
        queues = list(queues)
        by_key = {q.key: q for q in queues}
        if count < 1 or not by_key:
            return []
        flat = cls.scripts.run(scripts.take(cls.taking_key, [q.key for q in queues], count,
                                            caps), client=connection)
        popped = [(as_text(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]
        jobs = fetch_many_or_drop(connection, popped, job_class, serializer, expire_s)
        junk = [raw_id for (_, raw_id), job in zip(popped, jobs, strict=True) if job is None]
        if junk:  # nothing to run, nothing for the reaper
            connection.srem(cls.taking_key, *junk)
        return [(job, by_key[key]) for (key, _), job in zip(popped, jobs, strict=True)
                if job is not None]


def taken(connection: Redis, worker: str, rq_job_id: str) -> None:
    """The execution of `rq_job_id` on `worker` returned: forget its pop."""
    connection.srem(keys.worker_taking(worker), rq_job_id)


def taken_in_bulk(connection: Redis, worker: str, jobs: Iterable[Job], *,
                  done: Iterable[Job] = ()) -> None:
    """`jobs`, taken together by `worker` (`TakingQueue.take`), are held, put back or not
    runnable: forget their pops, and delete the RQ hashes of those `done` (as RQ does after
    an execution of an admission, whose ``result_ttl`` is 0), in one round trip."""
    ids = [job.id for job in jobs]
    if not ids:
        return
    with connection.pipeline(transaction=False) as pipe:
        pipe.srem(keys.worker_taking(worker), *ids)
        for job in done:
            pipe.delete(job.key)
        pipe.execute()
