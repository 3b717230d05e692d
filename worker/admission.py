"""Admission: whether a worker takes a new job now, and from which queues.

While fewer than ``max_active`` jobs are resident (and their KV bytes are under the budget)
the worker admits from its own queue (jobs routed to it) and then the intake queues, highest
priority first, between any two chunks, so a new job waits at most for the chunk in progress;
resident jobs advance round-robin. A job that does not fit goes back to the head of its intake
queue, and nothing is admitted until a resident job leaves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from rq import Queue

from jobs.defaults import DEFAULT_MAX_ACTIVE
from jobs.queues import enqueue_admission, intake_priorities, intake_queue

log = logging.getLogger("prefillq.worker")



class Admission:
    """The admission policy of one worker.

    Args:
        connection: Redis connection.
        models: names of the served models.
        active: the worker's resident jobs by id (values have ``.prefill.cache.nbytes``);
            read, never changed here.
        max_active: jobs resident at once (at least 1).
        kv_budget_bytes: no new job is admitted while resident KV bytes exceed this.
        refresh_s: while jobs are resident, a new priority level's intake queue is read
            within this many seconds of its first job.
    """

    def __init__(self, connection, models: list[str], active: Mapping, *,
                 max_active: int = DEFAULT_MAX_ACTIVE, kv_budget_bytes: int | None = None,
                 refresh_s: float = 1.0):
        self.connection = connection
        self.models = list(models)
        self.active = active
        self.max_active = max(1, max_active)
        self.kv_budget_bytes = kv_budget_bytes
        self.room_needed = False  # a job waits for KV room: admit nothing until one leaves
        self.refresh_s = refresh_s
        self._intake: list[Queue] | None = None
        self._intake_read_at = 0.0

    @property
    def resident_kv_bytes(self) -> int:
        return sum(a.prefill.cache.nbytes for a in self.active.values())

    def admitting(self) -> bool:
        """Whether a new job may be taken now."""
        if len(self.active) >= self.max_active or self.room_needed:
            return False
        return self.kv_budget_bytes is None or self.resident_kv_bytes < self.kv_budget_bytes

    def intake_by_priority(self) -> list[Queue]:
        """Every intake queue of every served model, highest priority first."""
        levels = sorted(
            ((p, m) for m in self.models for p in intake_priorities(self.connection, m)),
            key=lambda level: -level[0],
        )
        return [intake_queue(self.connection, m, p) for p, m in levels]

    def queues(self, own: Queue) -> list[Queue]:
        """The queues to admit from now, in order (the worker's own queue first, then intake
        by priority), or none while there is no room. The intake priorities in use are read
        from Redis at most every ``refresh_s`` seconds, and whenever `forget_priorities` was
        called."""
        if not self.admitting():
            return []
        if self._intake is None or time.monotonic() >= self._intake_read_at + self.refresh_s:
            self._intake, self._intake_read_at = self.intake_by_priority(), time.monotonic()
        return [own, *self._intake]

    def forget_priorities(self) -> None:
        """Read the priorities in use again at the next `queues` (before blocking on intake)."""
        self._intake = None

    def fits(self, kv_bytes: int) -> bool:
        """Whether a new job of `kv_bytes` fits. A job alone always fits (else it could
        never run); others must leave it room."""
        if self.kv_budget_bytes is None or not self.active:
            return True
        return self.resident_kv_bytes + kv_bytes <= self.kv_budget_bytes

    def wait_for_room(self, job_id: str, model: str, priority: int) -> None:
        """Put a job that does not fit back at the head of its intake queue, untouched, and
        admit nothing until a resident job leaves (`room_freed`)."""
        queue = intake_queue(self.connection, model, priority)
        enqueue_admission(queue, job_id, at_front=True)
        self.room_needed = True
        log.info("job %s waits for KV room (%d bytes resident)", job_id,
                 self.resident_kv_bytes)

    def room_freed(self) -> None:
        """A resident job left."""
        self.room_needed = False
