"""What clients read of a job: its state and `JobStatus` (its result: `jobs.result`).

A job is one Redis hash, decoded by `jobs.record.JobRecord`; `JobRecord.status()` gives the
`JobStatus`. docs/architecture.md ("Job lifecycle") gives each field's meaning.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class JobState(str, Enum):
    """A job's state; compares equal to, and prints as, its plain string value."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.FINISHED, JobState.FAILED, JobState.CANCELED)

    def __str__(self) -> str:
        return self.value


class LogitsMode(str, Enum):
    NONE = "none"
    TOP_K = "top_k"
    FULL = "full"


def now() -> float:
    """UTC epoch seconds."""
    return time.time()


@dataclass
class JobStatus:
    """A job's status as the client sees it. Times are UTC epoch seconds, sizes tokens.

    ``cached_tokens`` were reused from the session's slot (the cursor starts there) and
    ``reuse`` says how: ``cold`` (no slot, or not a session job), ``live`` (the prompt
    extends every committed token), ``recovery-anchor`` (it extends the turn anchor's),
    ``reset`` (neither; the slot starts over), ``exact`` (the prompt equals the committed
    tokens: no forward pass), or ``grow-live``, ``grow-recovery-anchor``, ``grow-reset`` when
    the slot's cache grew first. docs/sessions.md and `model.session` have the rules.
    ``resumed_from`` is the cursor this attempt restored from a KV checkpoint (None: it
    started without one); the cursor never goes back past it (docs/checkpoints.md).
    """

    job_id: str
    state: JobState
    model: str
    n_tokens: int | None
    cursor: int
    progress: float
    recovery_position: int | None
    chunks_done: int
    cached_tokens: int
    reuse: str
    resumed_from: int | None
    attempts: int
    cancel_requested: bool
    worker: str | None
    enqueued_at: float | None
    started_at: float | None
    updated_at: float | None
    finished_at: float | None
    error: dict[str, str] | None
    tenant: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["state"] = self.state.value
        return out
