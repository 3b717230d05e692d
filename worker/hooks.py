"""`JobHooks`: how KV checkpoints and session slots follow a resident job's life."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from jobs.record import JobRecord
from jobs.schema import JobState

if TYPE_CHECKING:
    from .active import ActiveJob


class JobHooks(Protocol):
    """What a worker keeps beside a resident job's chunks, told of each turn of its life by
    `worker.step.Stepper` (in the order listed; implemented by
    `worker.checkpoints.checkpointing.Checkpointing` and `worker.sessions.SessionSlots`)."""

    def started(self, active: ActiveJob, record: JobRecord) -> None:
        """`active` was taken (``queued -> prefilling``) from `record` and is resident."""

    def settles(self, active: ActiveJob) -> bool:
        """Whether `active`'s cache must be settled (no chunk in flight) once the chunk in
        flight commits, so its next chunk is not launched ahead of it: a copy is due."""

    def chunk_done(self, active: ActiveJob) -> None:
        """A chunk of `active` committed and the job is still resident."""

    def handing_back(self, active: ActiveJob, *, last: bool) -> None:
        """`active` goes back to intake: `last` for a hand-back another worker continues
        (a warm shutdown), else after a failed chunk."""

    def leaving(self, active: ActiveJob, ended: JobState | None) -> None:
        """`active` left this worker: `ended` is its terminal state (``finished``,
        ``failed``, ``canceled``), or None when it lives on elsewhere (handed back,
        fenced, or failed by a write Redis refused and parked)."""
