"""A worker's KV checkpoints: when to write them, the job-hash switch, resume and clean-up.

Between chunks, a resident job whose last checkpoint is at least ``--checkpoint-every``
old (in chunks or seconds) gets a new one: `CheckpointWriter` copies the rows since the last
one out on the chunk loop's thread and writes them on its own, with at most one checkpoint in
flight, so the next chunk computes meanwhile. Once every blob is in the store the job hash
points at the new record (`jobs.scripts.checkpoint_switch`, under the job's fence). A job
that restarts (lost worker, SIGTERM hand-back, failed chunk) resumes on any worker from its
latest usable checkpoint (`worker.checkpoints.latest_usable`: a corrupt, expired or
mismatched one falls back one checkpoint, else to cursor 0), on the same chunk boundaries.
A job that ends (finished, failed, canceled) has its blobs deleted.

A writer that was fenced (its worker declared dead while it still ran) can overwrite blobs
of the same checkpoint number that the job's new holder writes; the record's checksums then
fail to match and the restore falls back, so a race costs recomputation, never exactness.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from redis import Redis

from jobs import keys, scripts
from jobs.defaults import DEFAULT_SESSION_TTL_S
from jobs.record import JobRecord
from jobs.scripts import Fence, Scripts
from jobs.serializer import packb, unpackb
from model.planner import ChunkPlan
from model.prefill import Prefill
from model.registry import LoadedModel
from model.session_state import slot_from_state, slot_state

from .checkpoint_policy import CheckpointPolicy
from .checkpoints import (
    CheckpointRecord,
    CheckpointStore,
    CheckpointWriter,
    checksum,
    delete_all,
    latest_usable,
)

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
    """A worker's checkpoints of its resident jobs.

    Args:
        connection: the queue's Redis (the job hash's switch).
        worker: this worker's name (the fence).
        store: where blobs go (`worker.checkpoints.open_store`).
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

    # -- write -------------------------------------------------------------------------

    def after_chunk(self, active) -> bool:
        """After a chunk of the resident job `active` (a `worker.step.ActiveJob`): start its
        checkpoint if one is due and the writer is free. Returns whether one started."""
        state = active.checkpoints
        state.chunks_since += 1
        if not self.policy.due(state.chunks_since, time.monotonic() - state.since):
            return False
        return self._submit(active)

    def last(self, active) -> None:
        """Checkpoint `active` now and wait for it (a hand-back: another worker resumes
        here). A chunk launched for it is finished first (its rows are in the cache already);
        one that fails, or a write that fails, leaves the previous checkpoint in force."""
        self.flush()
        if active.prefill.launched:
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


class SessionCheckpoints:
    """Checkpoints of finished sessions' slots, so a session's next turn reuses its prefix
    on any worker (the holder dead, or its slot evicted). One per session, replaced by each
    finished turn, written on a background thread after a copy on the caller's; it lives
    ``ttl_s`` after the session's last turn.

    Args:
        store: where they go (the job checkpoints' store).
        ttl_s: lifetime of a session's checkpoint.
        max_pending: slots copied and waiting to be written; past it a save is skipped.
    """

    def __init__(self, store: CheckpointStore, *, ttl_s: int, max_pending: int = 2):
        self.store, self.ttl_s, self.max_pending = store, ttl_s, max_pending
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-ckpt")
        self._pending = 0
        self._lock = threading.Lock()

    def save(self, session: str, loaded: LoadedModel, slot) -> bool:
        """Copy `slot` now and write it in the background; False when skipped (a poisoned
        cache, or too many saves pending)."""
        with self._lock:
            if self._pending >= self.max_pending:
                log.info("session %s: checkpoint skipped, %d pending", session, self._pending)
                return False
            self._pending += 1
        try:
            state = slot_state(slot)  # the copy; packing and writing happen on the thread
        except Exception as e:
            with self._lock:
                self._pending -= 1
            log.info("session %s: no checkpoint (%s: %s)", session, type(e).__name__, e)
            return False
        self._writer.submit(self._write, session, loaded.name, loaded.sha256, state)
        return True

    def _write(self, session: str, model: str, sha256: str, state: dict) -> None:
        try:  # the blob first: the record is what makes it visible
            blob = packb(state)
            record = packb({"model": model, "model_sha256": sha256, "checksum": checksum(blob),
                            "nbytes": len(blob), "committed": len(state["committed"]),
                            "written_at": time.time()})
            self.store.put(keys.session_checkpoint(session, "blob"), blob, self.ttl_s)
            self.store.put(keys.session_checkpoint(session, "record"), record, self.ttl_s)
            log.info("session %s: slot checkpointed (%d bytes)", session, len(blob))
        except Exception as e:
            log.warning("session %s: slot checkpoint failed: %s: %s", session,
                        type(e).__name__, e)
        finally:
            with self._lock:
                self._pending -= 1

    def load(self, session: str, loaded: LoadedModel):
        """The session's checkpointed slot for `loaded`, or None (none, expired, another
        model, a checksum mismatch or a state that does not fit: logged)."""
        raw = self.store.get(keys.session_checkpoint(session, "record"))
        if raw is None:
            return None
        try:
            record = unpackb(raw)
            if (record["model"], record["model_sha256"]) != (loaded.name, loaded.sha256):
                raise ValueError(f"it is of {record['model']} {record['model_sha256'][:12]}")
            blob = self.store.get(keys.session_checkpoint(session, "blob"))
            if blob is None or checksum(blob) != record["checksum"]:
                raise ValueError("its blob is missing or fails its checksum")
            slot = slot_from_state(loaded.model, unpackb(blob))
        except Exception as e:
            log.warning("session %s: checkpoint not used: %s", session, e)
            return None
        log.info("session %s: slot restored from its checkpoint (%d tokens)", session,
                 len(slot.committed))
        return slot

    def flush(self) -> None:
        """Wait for the saves pending (tests, shutdown)."""
        self._writer.submit(lambda: None).result()
