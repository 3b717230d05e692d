"""Job transitions that Redis refused to write, kept in order and retried until they land.

A worker whose Redis is at ``maxmemory`` (policy ``noeviction``) cannot record a job's
failure or hand-back either; it keeps the write here and retries it from its heartbeat
thread and before each dequeue. The scripts are fenced on (worker, attempt), so a retry
after someone else took the job changes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .connection import refused_write

log = logging.getLogger("prefillq.worker")


class ParkedWrites:
    """Writes Redis refused, oldest first. Thread-safe."""

    def __init__(self) -> None:
        self._writes: list[tuple[str, str, Callable[[], object]]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._writes)

    def park(self, job_id: str, what: str, write: Callable[[], object],
             error: Exception) -> None:
        """Keep `write` (job `job_id`'s `what`, refused with `error`), then try it now."""
        log.warning("job %s: Redis refused a write (%s); retrying its %s", job_id, error, what)
        with self._lock:
            self._writes.append((job_id, what, write))
        self.settle()

    def settle(self) -> int:
        """Retry the writes in order, stopping at the first one that fails again. Returns
        how many are left (at once, without retrying, while another thread settles)."""
        if not self._lock.acquire(blocking=False):
            return len(self._writes)
        try:
            while self._writes:
                job_id, what, write = self._writes[0]
                try:
                    write()
                except Exception as error:  # refused again, or Redis unreachable: later
                    if not refused_write(error):
                        log.warning("job %s: retrying its %s failed", job_id, what,
                                    exc_info=True)
                    return len(self._writes)
                self._writes.pop(0)
                log.info("job %s: the %s Redis refused earlier landed", job_id, what)
            return 0
        finally:
            self._lock.release()
