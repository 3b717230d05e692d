"""Read a job's checkpoint back, refuse any that could give wrong logits, fall back one back.

`load` verifies every blob's checksum and the record against the model, the cache layout,
the dtype and the job's chunk plan, then assembles the complete `CacheState` (segments in
order, then the fixed blob); `latest_usable` walks the chain from the latest record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from jobs import keys
from model.cache import CacheStateError, check_layout
from model.cache_state import CacheState, dtype_name
from model.planner import ChunkPlan
from model.registry import LoadedModel

from .record import BlobRef, CheckpointRecord, RecordError, unpack_blobs
from .store import CheckpointStore

log = logging.getLogger("prefillq.checkpoints")

REASONS = ("missing", "expired", "checksum", "model", "layout", "dtype", "plan")


class CheckpointUnusable(Exception):
    """A checkpoint that must not be restored.

    Attributes:
        reason: one of ``REASONS``.
        previous: the record key to try next, or None.
    """

    def __init__(self, reason: str, message: str, previous: str | None = None):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason, self.previous = reason, previous


def load(store: CheckpointStore, record_key: str, loaded: LoadedModel,
         token_ids: Sequence[int], plan: ChunkPlan) -> tuple[CheckpointRecord, CacheState]:
    """The checkpoint at `record_key` as a complete cache state for `loaded`.

    Args:
        token_ids: the job's prompt; the cursor must lie inside it.
        plan: the job's chunk plan; the record's must equal it and hold the cursor as a
            chunk end before the last.
    Raises:
        CheckpointUnusable: missing or expired record or blob, a checksum mismatch, another
            model name or sha256, cache layout or version, dtype, or plan.
    """
    record = _read_record(store, record_key)
    prev = record.previous
    try:
        _check_record(record, loaded, token_ids, plan)
        blobs: dict[str, bytes] = {}
        for ref in _checked_segments(record):
            for name, rows in _read_blobs(store, ref, record).items():
                blobs[name] = blobs.get(name, b"") + rows
        blobs.update(_read_blobs(store, record.fixed, record))
    except CheckpointUnusable as e:
        raise CheckpointUnusable(e.reason, f"{record_key}: {e}", prev) from e
    names = {e["name"] for e in record.layout["blobs"]}
    if set(blobs) != names:
        raise CheckpointUnusable("layout", f"{record_key}: blobs {sorted(set(blobs) ^ names)} "
                                           "do not match the layout", prev)
    return record, CacheState(record.layout, blobs)


def latest_usable(store: CheckpointStore, record_key: str | None, loaded: LoadedModel,
                  token_ids: Sequence[int],
                  plan: ChunkPlan) -> tuple[CheckpointRecord, CacheState] | None:
    """`load` of `record_key`, else of its previous, and so on; None when none is usable
    (the job starts at cursor 0). Logs why each unusable checkpoint was skipped."""
    seen: set[str] = set()
    key = record_key
    while key is not None and key not in seen:
        seen.add(key)
        try:
            return load(store, key, loaded, token_ids, plan)
        except CheckpointUnusable as e:
            log.warning("checkpoint skipped: %s", e)
            key = e.previous
    return None


def delete_all(store: CheckpointStore, record_key: str) -> None:
    """Delete every blob and record of the chain ending at `record_key` (the job ended).

    Covers checkpoints 1 to ``seq + 1`` of the job by key (a write that failed after the
    latest leaves its blobs at the next seq) and every key the records still list. Call it
    after the writer's `wait`, so no write lands afterwards.
    """
    job_id, seq, _ = keys.parse_checkpoint(record_key)
    doomed = {keys.checkpoint(job_id, s, part)
              for s in range(1, seq + 2) for part in keys.CHECKPOINT_PARTS}
    key: str | None = record_key
    while key is not None and key in doomed:  # listed keys, in case a seq was skipped
        data = store.get(key)
        try:
            record = CheckpointRecord.from_bytes(data) if data is not None else None
        except RecordError:
            record = None
        if record is None:
            break
        doomed.update(s.key for s in record.segments)
        doomed.add(record.fixed.key)
        key = record.previous
    store.delete(sorted(doomed))


def _read_record(store: CheckpointStore, record_key: str) -> CheckpointRecord:
    data = store.get(record_key)
    if data is None:
        raise CheckpointUnusable("missing", f"record {record_key} is missing or expired")
    try:
        return CheckpointRecord.from_bytes(data)
    except RecordError as e:
        raise CheckpointUnusable(e.reason, f"record {record_key}: {e}",
                                 _seq_before(record_key)) from e


def _seq_before(record_key: str) -> str | None:
    """The record key of the checkpoint before, when a corrupt record cannot say."""
    try:
        job_id, seq, _ = keys.parse_checkpoint(record_key)
    except ValueError:
        return None
    return keys.checkpoint(job_id, seq - 1, "record") if seq > 1 else None


def _check_record(record: CheckpointRecord, loaded: LoadedModel, token_ids: Sequence[int],
                  plan: ChunkPlan) -> None:
    if (record.model, record.model_sha256) != (loaded.name, loaded.sha256):
        raise CheckpointUnusable("model", f"written by {record.model} sha256 "
                                          f"{record.model_sha256[:12]}, this worker runs "
                                          f"{loaded.name} sha256 {loaded.sha256[:12]}")
    want = dtype_name(loaded.dtype)
    if record.layout.get("kv_dtype") != want:
        raise CheckpointUnusable("dtype", f"cache dtype {record.layout.get('kv_dtype')!r}, "
                                          f"this worker runs {want}")
    expected = loaded.model.make_cache(loaded.dtype, capacity=0, context_length=1).layout()
    try:
        check_layout(record.layout, expected)
    except CacheStateError as e:
        raise CheckpointUnusable("layout", str(e)) from e
    if record.layout.get("position") != record.cursor or record.layout.get("since") != 0:
        raise CheckpointUnusable("layout", f"layout at {record.layout.get('position')!r} for a "
                                           f"cursor of {record.cursor}")
    if list(record.chunk_plan) != list(plan.boundaries):
        raise CheckpointUnusable("plan", "the record's chunk plan is not the job's")
    if record.cursor not in plan.boundaries[:-1] or record.cursor > len(token_ids):
        raise CheckpointUnusable("plan", f"cursor {record.cursor} is not a chunk end inside "
                                         f"the {len(token_ids)}-token prompt")


def _checked_segments(record: CheckpointRecord) -> list[BlobRef]:
    position = 0
    for ref in record.segments:
        if ref.first != position or ref.last <= ref.first:
            raise CheckpointUnusable("layout", f"segment {ref.key} covers [{ref.first}, "
                                               f"{ref.last}), expected a start at {position}")
        position = ref.last
    if position != record.cursor:
        raise CheckpointUnusable("layout", f"segments end at {position}, the cursor is "
                                           f"{record.cursor}")
    return record.segments


def _read_blobs(store: CheckpointStore, ref: BlobRef, record: CheckpointRecord) -> dict:
    data = store.get(ref.key)
    if data is None:
        reason = "expired" if time.time() >= record.expires_at else "missing"
        raise CheckpointUnusable(reason, f"blob {ref.key} is {reason}")
    if not ref.verify(data):
        raise CheckpointUnusable("checksum", f"blob {ref.key} has another checksum or size")
    try:
        return unpack_blobs(data)
    except ValueError as e:
        raise CheckpointUnusable("layout", f"blob {ref.key}: {e}") from e
