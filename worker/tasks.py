"""The only job function a prefillq worker runs (allow-listed by name)."""

from __future__ import annotations


def advance_prefill(job_id: str) -> None:
    """Admit prefill job `job_id` on the worker running this RQ job; the worker's own loop
    runs its chunks (`worker.step`).

    Args:
        job_id: prefillq job id (the key of its Redis record), not the RQ job id.
    Raises:
        RuntimeError: called outside a `PrefillWorker`.
    """
    from .worker import current_worker, log

    worker = current_worker()
    if not isinstance(job_id, str) or not job_id:  # a foreign RQ job's argument
        log.error("advance_prefill refuses job id %r: not a prefillq job id", job_id)
        return
    worker.advance(job_id)
