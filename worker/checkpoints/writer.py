"""`CheckpointWriter`: copy a job's new KV rows out between chunks, write them on a thread.

The caller's thread only copies (``cache.state(since)``: ``mx.eval`` then bytes), so the
next chunk may run at once; one background thread puts the segment, the fixed blob and the
record, then calls ``on_written``, which switches the job hash under its fence. At most one
checkpoint is in flight. A failed write is logged and kept in `last_error`; the previous
checkpoint stays in force, since nothing points at the new blobs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from jobs import keys
from model.cache_state import CacheState
from model.prefill import Prefill
from model.registry import LoadedModel

from .record import BlobRef, CheckpointRecord, pack_blobs
from .store import CheckpointStore

log = logging.getLogger("prefillq.checkpoints")

# Job ids whose max_bytes skip was logged; cleared past this many so it stays bounded.
_SKIP_LOG_LIMIT = 1024


@dataclass
class _Pending:
    job_id: str
    seq: int
    plan: list[int]
    model: str
    sha256: str
    state: CacheState
    previous: CheckpointRecord | None
    on_written: Callable[[CheckpointRecord], None]


def complete_layout(previous: dict | None, delta: dict) -> dict:
    """The meta of the complete state at ``delta``'s position: `previous` (a complete
    state's meta at ``delta["since"]``, None when that is 0) extended by `delta`'s
    append-only rows, as `model.cache_state.CacheState.extend` does for the bytes."""
    if previous is None:
        assert delta["since"] == 0, f"no previous layout for a state since {delta['since']}"
        return dict(delta)
    assert previous["position"] == delta["since"], "delta does not extend the previous layout"
    old = {e["name"]: e for e in previous["blobs"]}
    entries = []
    for entry in delta["blobs"]:
        entry = dict(entry)
        if entry["append_only"]:
            head = old[entry["name"]]["shape"][0] if entry["name"] in old else 0
            entry["shape"] = [head + entry["shape"][0], *entry["shape"][1:]]
            entry["first_row"] = 0
        entries.append(entry)
    return {**delta, "since": 0, "blobs": entries}


class CheckpointWriter:
    """Writes one job's checkpoint at a time to `store` on a background thread.

    Args:
        store: where blobs go.
        ttl_s: seconds every blob of a chain lives after its latest checkpoint (each write
            refreshes the earlier segments), so blobs expire with the job.
        max_bytes: skip (with one log line per job) jobs whose cache holds more bytes.
    Attributes:
        last_error: the latest write's exception, or None after a write that succeeded.
        written, failed, skipped: counts of checkpoints.
    """

    def __init__(self, store: CheckpointStore, *, ttl_s: int, max_bytes: int | None = None):
        if ttl_s < 1:
            raise ValueError(f"checkpoint TTL must be >= 1 s, got {ttl_s}")
        self.store, self.ttl_s, self.max_bytes = store, int(ttl_s), max_bytes
        self.last_error: BaseException | None = None
        self.written = self.failed = self.skipped = 0
        self._lock = threading.Condition()
        self._pending: _Pending | None = None
        self._closed = False
        self._skip_logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        with self._lock:
            return self._pending is not None

    def submit(self, job_id: str, seq: int, prefill: Prefill, loaded: LoadedModel,
               previous: CheckpointRecord | None,
               on_written: Callable[[CheckpointRecord], None]) -> bool:
        """Checkpoint `prefill` (between chunks) as number `seq`, after `previous`.

        Copies rows ``[previous.cursor, cursor)`` and the fixed state on this thread, then
        returns; the thread writes them and calls ``on_written(record)`` (on the thread).

        Returns:
            False (doing nothing) while a checkpoint is in flight, when nothing is new since
            `previous`, after `close`, or when the cache is over ``max_bytes``; else True.
        Raises:
            ValueError: a chunk is launched (its rows are half written), or `previous` is
                ahead of the cursor. CachePoisoned: the cache holds a failed chunk.
        """
        if prefill.launched:
            raise ValueError("cannot checkpoint while a chunk is launched")
        since = previous.cursor if previous is not None else 0
        if since > prefill.cursor:
            raise ValueError(f"previous checkpoint at {since} is ahead of the cursor "
                             f"{prefill.cursor}")
        with self._lock:
            if self._pending is not None or self._closed or since == prefill.cursor:
                return False
        if self.max_bytes is not None and prefill.cache.nbytes > self.max_bytes:
            self._skip(job_id, prefill.cache.nbytes)
            return False
        state = prefill.cache.state(since=since)  # the copy: the next chunk may run now
        pending = _Pending(job_id, seq, list(prefill.plan.boundaries), loaded.name,
                           loaded.sha256, state, previous, on_written)
        with self._lock:
            self._pending = pending
            self._lock.notify_all()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no checkpoint is in flight; False if `timeout` seconds passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending is None, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the checkpoint in flight, then stop the thread."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout)

    def _skip(self, job_id: str, nbytes: int) -> None:
        self.skipped += 1
        if job_id in self._skip_logged:
            return
        if len(self._skip_logged) >= _SKIP_LOG_LIMIT:
            self._skip_logged.clear()
        self._skip_logged.add(job_id)
        log.info("job %s: no checkpoints, its cache of %d bytes is over --checkpoint-max-bytes "
                 "%d", job_id, nbytes, self.max_bytes)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending is not None or self._closed)
                pending = self._pending
                if pending is None:
                    return
            try:
                record = self._write(pending)
                self.written += 1
                self.last_error = None
                pending.on_written(record)
                self._retire(pending.previous)
            except Exception as e:  # never into the chunk loop: logged, counted, reported
                self.failed += 1
                self.last_error = e
                log.warning("job %s: checkpoint %d failed, the previous one stays in force: "
                            "%s: %s", pending.job_id, pending.seq, type(e).__name__, e)
            finally:
                with self._lock:
                    self._pending = None
                    self._lock.notify_all()

    def _write(self, p: _Pending) -> CheckpointRecord:
        """Segment, fixed blob, fresh TTLs on the chain's earlier segments, then the record."""
        entries = {e["name"]: e for e in p.state.meta["blobs"]}
        rows = {n: b for n, b in p.state.blobs.items() if entries[n]["append_only"]}
        whole = {n: b for n, b in p.state.blobs.items() if not entries[n]["append_only"]}
        segment, fixed = pack_blobs(rows), pack_blobs(whole)
        seg_key = keys.checkpoint(p.job_id, p.seq, "segment")
        fixed_key = keys.checkpoint(p.job_id, p.seq, "fixed")
        record_key = keys.checkpoint(p.job_id, p.seq, "record")
        earlier = p.previous.segments if p.previous is not None else []
        self.store.put(seg_key, segment, self.ttl_s)
        self.store.put(fixed_key, fixed, self.ttl_s)
        self.store.touch([s.key for s in earlier], self.ttl_s)
        position = p.state.meta["position"]
        record = CheckpointRecord(
            job_id=p.job_id,
            seq=p.seq,
            cursor=position,
            chunk_plan=p.plan,
            model=p.model,
            model_sha256=p.sha256,
            layout=complete_layout(p.previous.layout if p.previous else None, p.state.meta),
            segments=[*earlier, BlobRef.of(seg_key, segment, p.state.meta["since"], position)],
            fixed=BlobRef.of(fixed_key, fixed),
            previous=(keys.checkpoint(p.job_id, p.previous.seq, "record")
                      if p.previous is not None else None),
            written_at=time.time(),
            ttl_s=self.ttl_s,
        )
        self.store.put(record_key, record.to_bytes(), self.ttl_s)
        return record

    def _retire(self, previous: CheckpointRecord | None) -> None:
        """Delete the record and fixed blob two checkpoints back: fallback goes one back."""
        if previous is None or previous.previous is None:
            return
        job_id, seq, _ = keys.parse_checkpoint(previous.previous)
        self.store.delete([keys.checkpoint(job_id, seq, "fixed"), previous.previous])
