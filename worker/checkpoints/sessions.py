"""Session checkpoints: a finished session turn's slot, so its next turn resumes anywhere."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from jobs import keys
from jobs.serializer import packb, unpackb
from model.registry import LoadedModel
from model.session_state import slot_from_state, slot_state

from .record import BlobRef, CheckpointRecord
from .store import CheckpointStore

log = logging.getLogger("prefillq.worker")

# `CheckpointRecord.layout` of a session slot (`model.session_state.slot_state`)
SLOT_LAYOUT = "session_slot"


class SessionCheckpoints:
    """Checkpoints of finished sessions' slots, so a session's next turn reuses its prefix
    on any worker (the holder dead, or its slot evicted). One per session, replaced by each
    finished turn, written on a background thread after a copy on the caller's; it lives
    ``ttl_s`` after the session's last turn. Its record is a `CheckpointRecord` (the
    session id as `job_id`, the committed tokens as `cursor`, the whole slot as its one
    fixed blob), checksummed as a job checkpoint's.

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
            blob_key = keys.session_checkpoint(session, "blob")
            # a job checkpoint's record: one fixed blob (the whole slot), no segments
            record = CheckpointRecord(
                job_id=session, seq=1, cursor=len(state["committed"]), chunk_plan=[],
                model=model, model_sha256=sha256, layout={"kind": SLOT_LAYOUT},
                segments=[], fixed=BlobRef.of(blob_key, blob), written_at=time.time(),
                ttl_s=self.ttl_s)
            self.store.put(blob_key, blob, self.ttl_s)
            self.store.put(keys.session_checkpoint(session, "record"), record.to_bytes(),
                           self.ttl_s)
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
            record = CheckpointRecord.from_bytes(raw)
            if record.layout.get("kind") != SLOT_LAYOUT:
                raise ValueError(f"its layout is {record.layout!r}, not a session slot's")
            if (record.model, record.model_sha256) != (loaded.name, loaded.sha256):
                raise ValueError(f"it is of {record.model} {record.model_sha256[:12]}")
            blob = self.store.get(record.fixed.key)
            if blob is None or not record.fixed.verify(blob):
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
