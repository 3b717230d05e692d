"""`Checkpointing`: when a worker checkpoints its resident jobs, the fenced switch, resume
and clean-up (docs/checkpoints.md says how and what a checkpoint costs)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from redis import Redis

from jobs import keys, scripts
from jobs.defaults import DEFAULT_SESSION_TTL_S
from jobs.record import JobRecord
from jobs.schema import JobState
from jobs.scripts import Fence, Scripts
from model.planner import ChunkPlan
from model.prefill import Prefill
from model.registry import LoadedModel

from .policy import CheckpointPolicy
from .record import CheckpointRecord
from .restore import delete_all, latest_usable
from .sessions import SessionCheckpoints
from .store import CheckpointStore
from .writer import CheckpointWriter

log = logging.getLogger("prefillq.worker")


@dataclass
class JobCheckpoints:
    """One resident job's checkpoint state on this worker."""

    latest: CheckpointRecord | None = None  # in force (restored, or written by this attempt)
    key: str | None = None  # the job hash's record key: `latest`'s, or a newer unusable one
    chunks_since: int = 0
    since: float = 0.0  # monotonic time of the last checkpoint (or of the start)

    @property
    def next_seq(self) -> int:
        if self.latest is not None:
            return self.latest.seq + 1
        return keys.parse_checkpoint(self.key)[1] + 1 if self.key else 1


class Checkpointing:
    """A worker's KV checkpoints of its resident jobs, following each job's life
    (`worker.hooks.JobHooks`).

    After a chunk, a job whose last checkpoint is at least ``--checkpoint-every`` old (in
    chunks or seconds) gets a new one: `CheckpointWriter` copies the rows since the last one
    out on the chunk loop's thread and writes them on its own, at most one in flight, so the
    next chunk computes meanwhile. Once every blob is in the store the job hash points at the
    new record (`jobs.scripts.checkpoint_switch`, under the job's fence). A job that restarts
    resumes on any worker from its latest usable checkpoint (`resume`), on the same chunk
    boundaries; a job that ends has its blobs deleted. A fenced writer (its worker declared
    dead while it still ran) can overwrite blobs the job's new holder wrote; the record's
    checksums then fail and the restore falls back, so a race costs recomputation, never
    exactness.

    Not checkpointed mid-prefill: session jobs (their plan depends on the slot they start
    from) and prompt_logprobs jobs (a resume would lack the earlier positions' logprobs).

    Args:
        connection: the queue's Redis (the job hash's switch).
        worker: this worker's name (the fence).
        store: where blobs go (`worker.checkpoints.store.open_store`).
        policy: when to write.
        ttl_s: how long a job's blobs live after its latest checkpoint.
        max_bytes: jobs whose cache is larger are not checkpointed (one log line each).
    """

    def __init__(self, connection: Redis, worker: str, store: CheckpointStore,
                 policy: CheckpointPolicy, *, ttl_s: int, max_bytes: int | None = None):
        self.connection, self.worker, self.store, self.policy = connection, worker, store, policy
        self.writer = CheckpointWriter(store, ttl_s=ttl_s, max_bytes=max_bytes)
        self.scripts = Scripts(connection)
        self.sessions = SessionCheckpoints(store, ttl_s=DEFAULT_SESSION_TTL_S)

    # -- resume ------------------------------------------------------------------------

    def resume(self, loaded: LoadedModel, record: JobRecord, token_ids: list[int],
               plan: ChunkPlan) -> tuple[Prefill, JobCheckpoints] | None:
        """The job's prefill restored from its latest usable checkpoint (``resumed_from``
        its cursor), or None (start at 0). Never raises for a bad checkpoint: it is
        logged and skipped."""
        if record.checkpoint is None:
            return None
        found = latest_usable(self.store, record.checkpoint, loaded, token_ids, plan)
        if found is None:
            log.warning("job %s: no usable checkpoint; starting at 0", record.job_id)
            return None
        ckpt, state = found
        try:
            prefill = loaded.resume_prefill(token_ids, plan, state)
        except ValueError as e:
            log.warning("job %s: checkpoint %s refused (%s); starting at 0", record.job_id,
                        ckpt.seq, e)
            return None
        log.info("job %s resumes from checkpoint %d at %d/%d", record.job_id, ckpt.seq,
                 ckpt.cursor, len(token_ids))
        return prefill, JobCheckpoints(latest=ckpt, key=record.checkpoint,
                                       since=time.monotonic())

    # -- a job's life (`worker.hooks.JobHooks`) -----------------------------------------

    def started(self, active, record: JobRecord) -> None:
        """Checkpoint `active` from now on, unless it resumed (its state came with it), is a
        session's or asked for prompt logprobs."""
        if active.checkpoints is None and active.slot is None and record.prompt_logprobs is None:
            active.checkpoints = JobCheckpoints(key=record.checkpoint, since=time.monotonic())

    def settles(self, active) -> bool:
        """Whether `active`'s checkpoint falls due when the chunk in flight commits (so
        `chunk_done` finds its cache settled)."""
        state = active.checkpoints
        return state is not None and self.policy.due(state.chunks_since + 1,
                                                     time.monotonic() - state.since)

    def chunk_done(self, active) -> bool:
        """After a chunk of `active` (a `worker.active.ActiveJob`): start its checkpoint if
        one is due and the writer is free. Returns whether one started."""
        state = active.checkpoints
        if state is None:
            return False
        state.chunks_since += 1
        if not self.policy.due(state.chunks_since, time.monotonic() - state.since):
            return False
        return self._submit(active)

    def handing_back(self, active, *, last: bool) -> None:
        """Before `active` goes back to intake: for the `last` hand-back (another worker
        continues) a checkpoint now, else the one in flight landed (the restart sees it)."""
        if active.checkpoints is None:
            return
        if last:
            self.last(active)
        else:
            self.flush()

    def leaving(self, active, ended: JobState | None) -> None:
        """`active` left this worker; if it `ended`, its checkpoint blobs are deleted."""
        if ended and active.checkpoints is not None:
            self.ended(active.job_id, active.checkpoints)

    # -- write -------------------------------------------------------------------------

    def last(self, active) -> None:
        """Checkpoint `active` now and wait for it (a hand-back: another worker resumes
        here). The chunks launched for it are finished first (their rows are in the cache
        already); one that fails, or a write that fails, leaves the previous checkpoint in
        force."""
        self.flush()
        while active.prefill.launched:
            try:
                active.prefill.step()
            except Exception as e:
                log.warning("job %s: its launched chunk failed at hand-back (%s: %s)",
                            active.job_id, type(e).__name__, e)
                return
        if self._submit(active):
            self.flush()

    def _submit(self, active) -> bool:
        state, p = active.checkpoints, active.prefill
        if p.done or p.launched or p.cache.is_poisoned:
            return False
        job_id, attempt = active.job_id, active.attempt
        started = self.writer.submit(
            job_id, state.next_seq, p, active.model, state.latest,
            on_written=lambda record: self._switch(job_id, attempt, state, record))
        if started:
            state.chunks_since, state.since = 0, time.monotonic()
        elif self.writer.in_flight:
            log.info("job %s: checkpoint due at %d, the previous write is still in flight",
                     job_id, p.cursor)
        return started

    def _switch(self, job_id: str, attempt: int, state: JobCheckpoints,
                record: CheckpointRecord) -> None:
        # runs on the writer's thread once every blob is in the store
        key = keys.checkpoint(job_id, record.seq, "record")
        outcome = self.scripts.run(scripts.checkpoint_switch(
            job_id, Fence(self.worker, attempt), record_key=key, cursor=record.cursor))
        if outcome == b"switched":
            state.latest, state.key = record, key
            log.info("job %s checkpoint %d at %d in force, written in %.2f s (%d bytes with "
                     "the rows before it)", job_id, record.seq, record.cursor,
                     time.monotonic() - state.since, record.nbytes)
        else:
            log.info("job %s: checkpoint %d at %d not switched (%s)", job_id, record.seq,
                     record.cursor, outcome.decode())

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the checkpoint in flight (before a hand-back or a clean-up)."""
        self.writer.wait(timeout)

    # -- clean-up ----------------------------------------------------------------------

    def ended(self, job_id: str, state: JobCheckpoints | None) -> None:
        """The job finished, failed or was canceled: delete its checkpoint blobs."""
        if state is None:
            return
        self.flush()
        if state.key is not None:  # the job hash's pointer: the newest record of the chain
            try:
                delete_all(self.store, state.key)
            except Exception:  # blobs expire anyway
                log.warning("job %s: could not delete its checkpoints", job_id, exc_info=True)
