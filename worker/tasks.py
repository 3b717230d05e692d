"""The only job function a prefillq worker runs (allow-listed by name)."""

from __future__ import annotations


def advance_prefill(job_id: str) -> None:
    """Advance prefill job `job_id` by one bounded chunk on the worker running this RQ job.

    Args:
        job_id: prefillq job id (the key of its Redis record), not the RQ job id.
    Raises:
        RuntimeError: called outside a `PrefillWorker`.
    """
    from .worker import current_worker

    current_worker().advance(job_id)
