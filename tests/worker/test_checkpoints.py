"""Checkpoint restore refuses what could give wrong logits and falls back; the writer keeps
at most one checkpoint in flight, reports failures and cleans up after itself.

Stores: a directory, fakeredis and the real redis-server. Restores here run in-process (the
fresh-process resumes are in test_checkpoint_resume.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from jobs import keys
from model.planner import ChunkPlan
from worker.checkpoints.restore import CheckpointUnusable, delete_all, latest_usable, load
from worker.checkpoints.store import FileStore
from worker.checkpoints.writer import CheckpointWriter

from .checkpoint_helpers import (
    JOB,
    N_TOKENS,
    checkpointed_prefill,
    chunked,
    loaded,
    plan,
    prompt,
    record_key,
)

GEMMA = "gemma3-tiny"




def stored_keys(store) -> list[str]:
    if isinstance(store, FileStore):
        return store.keys()
    return sorted(k.decode() for k in store.redis.keys("*"))


def flip_a_byte(store, key: str) -> None:
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01
    store.put(key, bytes(data), 600)


def resumed_logits(name: str, store, key: str):
    found = latest_usable(store, key, loaded(name), prompt(name), plan())
    if found is None:
        return None, None
    record, state = found
    return record.cursor, loaded(name).resume_prefill(prompt(name), plan(), state).run()


@pytest.mark.parametrize("part", ["segment", "fixed", "record"])
def test_a_corrupted_latest_blob_falls_back_to_the_previous_checkpoint(store, part, caplog):
    records = checkpointed_prefill(GEMMA, store)
    latest = records[-1]
    flip_a_byte(store, keys.checkpoint(JOB, latest.seq, part))
    with pytest.raises(CheckpointUnusable) as caught:
        load(store, record_key(latest.seq), loaded(GEMMA), prompt(GEMMA), plan())
    assert caught.value.reason == "checksum"
    with caplog.at_level(logging.WARNING, "prefillq.checkpoints"):
        cursor, logits = resumed_logits(GEMMA, store, record_key(latest.seq))
    assert cursor == records[-2].cursor
    assert "checksum" in caplog.text and record_key(latest.seq) in caplog.text
    np.testing.assert_array_equal(logits, chunked(GEMMA))


def test_a_corrupted_first_checkpoint_or_shared_segment_leaves_cursor_0(store):
    first = checkpointed_prefill(GEMMA, store, at=(130,))
    flip_a_byte(store, first[0].segments[0].key)
    assert latest_usable(store, record_key(1), loaded(GEMMA), prompt(GEMMA), plan()) is None
    store.delete(stored_keys(store))
    records = checkpointed_prefill(GEMMA, store)
    flip_a_byte(store, records[0].segments[0].key)  # rows [0, 37): in every checkpoint
    assert latest_usable(store, record_key(5), loaded(GEMMA), prompt(GEMMA), plan()) is None


def reencode(store, key: str, **changes) -> None:
    from worker.checkpoints.record import CheckpointRecord

    record = CheckpointRecord.from_bytes(store.get(key))
    store.put(key, dataclasses.replace(record, **changes).to_bytes(), 600)


def test_a_mismatched_model_dtype_layout_or_plan_is_refused_with_the_reason(store):
    records = checkpointed_prefill(GEMMA, store, at=(37, 130))
    key, model, ids = record_key(2), loaded(GEMMA), prompt(GEMMA)

    def reason(loaded_model=model, token_ids=ids, chunk_plan=None):
        with pytest.raises(CheckpointUnusable) as caught:
            load(store, key, loaded_model, token_ids, chunk_plan or plan())
        assert caught.value.previous == record_key(1)
        return caught.value.reason

    assert reason(dataclasses.replace(model, sha256="0" * 64)) == "model"
    assert reason(dataclasses.replace(model, name="other")) == "model"
    assert reason(dataclasses.replace(model, dtype=mx.bfloat16)) == "dtype"
    other_plan = ChunkPlan.from_boundaries(N_TOKENS, [37, 130, N_TOKENS])
    assert reason(chunk_plan=other_plan) == "plan"
    layout = records[-1].layout
    reencode(store, key, layout={**layout, "version": layout["version"] + 1})
    assert reason() == "layout"
    reencode(store, key, layout={**layout, "layers": layout["layers"][:-1]})
    assert reason() == "layout"
    reencode(store, key, layout=layout, cursor=64)
    assert reason() == "layout"
    reencode(store, key, cursor=130)
    load(store, key, model, ids, plan())  # as written, it loads
    ds = loaded("deepseek4-tiny")
    assert reason(dataclasses.replace(ds, name=model.name, sha256=model.sha256)) == "layout"


def test_missing_and_expired_blobs_are_detected(store):
    records = checkpointed_prefill(GEMMA, store, at=(37, 130))
    store.delete([records[-1].fixed.key])
    with pytest.raises(CheckpointUnusable, match="missing") as caught:
        load(store, record_key(2), loaded(GEMMA), prompt(GEMMA), plan())
    assert caught.value.reason == "missing"
    store.delete([record_key(1)])
    with pytest.raises(CheckpointUnusable) as caught:
        load(store, record_key(1), loaded(GEMMA), prompt(GEMMA), plan())
    assert caught.value.reason == "missing"
    assert latest_usable(store, record_key(2), loaded(GEMMA), prompt(GEMMA), plan()) is None


def test_blobs_expire_after_their_ttl(store):
    checkpointed_prefill(GEMMA, store, at=(37, 130), ttl_s=1)
    store.touch([record_key(2)], 600)  # the record outlives its blobs
    time.sleep(1.2)
    with pytest.raises(CheckpointUnusable) as caught:
        load(store, record_key(2), loaded(GEMMA), prompt(GEMMA), plan())
    assert caught.value.reason == "expired"
    if isinstance(store, FileStore):
        files = len(stored_keys(store))
        assert store.sweep() == files - 1  # all but the touched record
        assert stored_keys(store) == [record_key(2)]
    else:
        assert stored_keys(store) == [record_key(2)]


def test_delete_all_leaves_no_key_behind(store):
    records = checkpointed_prefill(GEMMA, store)
    orphan = keys.checkpoint(JOB, records[-1].seq + 1, "segment")  # a write that failed
    store.put(orphan, b"rows", 600)
    store.put(keys.checkpoint("other", 1, "record"), b"kept", 600)
    delete_all(store, record_key(records[-1].seq))
    assert stored_keys(store) == [keys.checkpoint("other", 1, "record")]
    if isinstance(store, FileStore):
        assert [p.name for p in store.root.iterdir()] == [
            store.path(keys.checkpoint("other", 1, "record")).name]


# --- the writer ------------------------------------------------------------------------


class GatedStore(FileStore):
    """A file store whose puts wait for `gate` and that fails the puts of `fail_seq`."""

    def __init__(self, root, fail_seq=None):
        super().__init__(root)
        self.gate, self.fail_seq = threading.Event(), fail_seq
        self.gate.set()

    def put(self, key, data, ttl_s):
        assert self.gate.wait(30)
        if self.fail_seq is not None and keys.parse_checkpoint(key)[1] == self.fail_seq:
            raise OSError("disk full")
        super().put(key, data, ttl_s)


def advanced(name: str, stop: int):
    prefill = loaded(name).start_prefill(prompt(name), plan=plan())
    while prefill.cursor < stop:
        prefill.step()
    return prefill


def test_one_checkpoint_in_flight_and_on_written_after_every_blob(tmp_path):
    store = GatedStore(tmp_path / "ckpt")
    writer = CheckpointWriter(store, ttl_s=600)
    prefill, seen = advanced(GEMMA, 37), []

    def on_written(record):
        part_keys = [s.key for s in record.segments] + [record.fixed.key, record_key(record.seq)]
        seen.append((record, [store.get(k) is not None for k in part_keys]))

    store.gate.clear()
    assert writer.submit(JOB, 1, prefill, loaded(GEMMA), None, on_written)
    prefill.step()  # the next chunk runs while the checkpoint is in flight
    assert writer.in_flight and not writer.wait(0.05)
    assert not writer.submit(JOB, 2, prefill, loaded(GEMMA), None, on_written)
    store.gate.set()
    assert writer.wait(30) and not writer.in_flight
    (first, present), = seen
    assert first.cursor == 37 and all(present)
    assert writer.submit(JOB, 2, prefill, loaded(GEMMA), first, on_written)
    writer.close()
    assert [r.cursor for r, _ in seen] == [37, 64] and all(seen[1][1])
    assert not writer.submit(JOB, 3, advanced(GEMMA, 130), loaded(GEMMA), seen[1][0], on_written)
    prefill.launch()
    with pytest.raises(ValueError, match="launched"):
        writer.submit(JOB, 3, prefill, loaded(GEMMA), seen[1][0], on_written)


def test_a_failed_write_is_reported_and_leaves_the_previous_checkpoint(tmp_path, caplog):
    store = GatedStore(tmp_path / "ckpt", fail_seq=2)
    writer = CheckpointWriter(store, ttl_s=600)
    prefill, written = advanced(GEMMA, 37), []
    assert writer.submit(JOB, 1, prefill, loaded(GEMMA), None, written.append)
    writer.wait()
    while prefill.cursor < 130:
        prefill.step()
    with caplog.at_level(logging.WARNING, "prefillq.checkpoints"):
        assert writer.submit(JOB, 2, prefill, loaded(GEMMA), written[0], written.append)
        writer.wait()
    assert [r.seq for r in written] == [1]
    assert isinstance(writer.last_error, OSError) and writer.failed == 1
    assert "checkpoint 2 failed" in caplog.text and "disk full" in caplog.text
    record, _ = latest_usable(store, record_key(1), loaded(GEMMA), prompt(GEMMA), plan())
    assert record.cursor == 37
    store.fail_seq = None  # the next write succeeds and clears the error
    assert writer.submit(JOB, 2, prefill, loaded(GEMMA), written[0], written.append)
    writer.close()
    assert writer.last_error is None and [r.cursor for r in written] == [37, 130]


def test_a_raising_on_written_is_reported_not_raised(tmp_path):
    writer = CheckpointWriter(FileStore(tmp_path / "ckpt"), ttl_s=600)

    def fenced(record):
        raise RuntimeError("fenced")

    assert writer.submit(JOB, 1, advanced(GEMMA, 37), loaded(GEMMA), None, fenced)
    writer.close()
    assert str(writer.last_error) == "fenced" and writer.failed == 1


def ignore(record):
    pass


def test_max_bytes_skips_with_one_log_line_per_job(tmp_path, caplog):
    store = FileStore(tmp_path / "ckpt")
    prefill = advanced(GEMMA, 37)
    writer = CheckpointWriter(store, ttl_s=600, max_bytes=prefill.cache.nbytes - 1)
    with caplog.at_level(logging.INFO, "prefillq.checkpoints"):
        for seq in (1, 2):
            assert not writer.submit(JOB, seq, prefill, loaded(GEMMA), None, ignore)
    writer.close()
    assert writer.skipped == 2 and store.keys() == []
    lines = [r for r in caplog.records if "max-bytes" in r.getMessage()]
    assert len(lines) == 1 and JOB in lines[0].getMessage()
    roomy = CheckpointWriter(store, ttl_s=600, max_bytes=prefill.cache.nbytes)
    assert roomy.submit(JOB, 1, prefill, loaded(GEMMA), None, ignore)
    roomy.close()
    assert len(store.keys()) == 3  # segment, fixed blob, record: three puts
