"""Checkpoint stores (a directory, fakeredis, the real redis-server), `open_store`, the key
helpers, the record codec and the fenced CHECKPOINT_SWITCH script."""

from __future__ import annotations

import os
import time

import fakeredis
import pytest
import redis

from jobs import keys, scripts
from jobs.record import JobRecord
from jobs.schema import JobState
from jobs.scripts import Fence, Scripts
from worker.checkpoints.record import BlobRef, CheckpointRecord, RecordError
from worker.checkpoints.store import STALE_TEMP_S, FileStore, RedisStore, open_store

KEY = keys.checkpoint("j/../x", 3, "segment")  # a job id with a slash stays inside the root




def test_put_get_touch_delete(store):
    assert store.get(KEY) is None
    store.put(KEY, b"\x00rows", ttl_s=60)
    assert store.get(KEY) == b"\x00rows"
    store.put(KEY, b"again", ttl_s=60)  # overwrite
    assert store.get(KEY) == b"again"
    store.touch([KEY, keys.checkpoint("j", 1, "fixed")], ttl_s=120)  # a missing key is fine
    assert store.get(KEY) == b"again"
    store.delete([KEY, keys.checkpoint("j", 1, "fixed")])
    assert store.get(KEY) is None
    with pytest.raises(ValueError, match="TTL"):
        store.put(KEY, b"x", ttl_s=0)


def test_a_blob_expires_after_its_ttl_and_touch_extends_it(store):
    kept = keys.checkpoint("j", 1, "record")
    store.put(KEY, b"short", ttl_s=1)
    store.put(kept, b"kept", ttl_s=1)
    store.touch([kept], ttl_s=60)
    time.sleep(1.2)
    assert store.get(KEY) is None
    assert store.get(kept) == b"kept"


def test_file_store_names_stay_inside_its_root_and_leave_no_temp_file(tmp_path):
    store = FileStore(tmp_path / "ckpt")
    for key in (KEY, "..", "a/b"):
        store.put(key, b"data", ttl_s=60)
    assert sorted(p.parent for p in store.root.iterdir()) == [store.root] * 3
    assert not any(p.name.startswith(".tmp-") for p in store.root.iterdir())
    assert store.keys() == sorted([KEY, "..", "a/b"])
    assert not (tmp_path / "x.ckpt").exists()
    with pytest.raises(ValueError, match="absolute"):
        FileStore("relative/dir")


def test_file_store_sweep_removes_expired_blobs_and_stale_temp_files(tmp_path):
    store = FileStore(tmp_path / "ckpt")
    store.put(keys.checkpoint("j", 1, "segment"), b"old", ttl_s=1)
    store.put(keys.checkpoint("j", 1, "fixed"), b"old", ttl_s=1)
    store.put(keys.checkpoint("j", 2, "segment"), b"new", ttl_s=600)
    stale, fresh = store.root / ".tmp-dead", store.root / ".tmp-writing"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    old = time.time() - STALE_TEMP_S - 1
    os.utime(stale, (old, old))
    (store.root / "corrupt.ckpt").write_bytes(b"no header")
    time.sleep(1.1)
    assert store.sweep() == 4  # two expired, one stale temp file, one unreadable
    assert sorted(p.name for p in store.root.iterdir()) == sorted(
        [store.path(keys.checkpoint("j", 2, "segment")).name, fresh.name])
    assert store.sweep() == 0


def test_redis_store_sweep_is_redis_own_expiry():
    assert RedisStore(fakeredis.FakeStrictRedis()).sweep() == 0


def test_open_store(tmp_path, redis_server):
    queue = fakeredis.FakeStrictRedis()
    assert open_store(None, queue).redis is queue
    assert open_store("redis", queue).redis is queue
    other = open_store(redis_server, queue)
    assert isinstance(other, RedisStore) and other.redis is not queue
    other.put(KEY, b"x", 5)
    assert redis.Redis.from_url(redis_server).get(KEY) == b"x"
    files = open_store(f"file://{tmp_path}/shared", queue)
    assert isinstance(files, FileStore) and files.root == tmp_path / "shared"
    for bad in ("s3://bucket/x", "file://host/abs", "file:relative", "/just/a/path", ""):
        with pytest.raises(ValueError, match="checkpoint store"):
            open_store(bad, queue)


def test_checkpoint_keys_share_the_job_hash_tag_and_parse_back():
    key = keys.checkpoint("abc", 12, "fixed")
    assert key == "prefillq:{abc}:ckpt:12:fixed"
    assert keys.parse_checkpoint(key) == ("abc", 12, "fixed")
    for bad in ("prefillq:{abc}:job", "prefillq:{abc}:ckpt:x:fixed", "prefillq:{abc}:ckpt:1:rows",
                "other:{abc}:ckpt:1:fixed"):
        with pytest.raises(ValueError):
            keys.parse_checkpoint(bad)
    with pytest.raises(ValueError):
        keys.checkpoint("abc", 0, "fixed")


def _record(**changes) -> CheckpointRecord:
    values = dict(job_id="j", seq=2, cursor=64, chunk_plan=[32, 64, 100], model="m",
                  model_sha256="ab" * 32, layout={"version": 1, "position": 64, "blobs": []},
                  segments=[BlobRef.of("s1", b"rows", 0, 32), BlobRef.of("s2", b"more", 32, 64)],
                  fixed=BlobRef.of("f2", b"ring"), previous="r1", written_at=1.5, ttl_s=60)
    return CheckpointRecord(**{**values, **changes})


def test_record_round_trips_and_detects_a_flipped_byte():
    record = _record()
    data = record.to_bytes()
    assert CheckpointRecord.from_bytes(data) == record
    assert record.nbytes == 12 and record.expires_at == 61.5
    for i in (len(data) // 2, len(data) - 3):
        flipped = bytearray(data)
        flipped[i] ^= 0x40
        with pytest.raises(RecordError) as caught:
            CheckpointRecord.from_bytes(bytes(flipped))
        assert caught.value.reason == "checksum"
    with pytest.raises(RecordError) as caught:
        CheckpointRecord.from_bytes(_record(version=99).to_bytes())
    assert caught.value.reason == "layout"
    assert not BlobRef.of("k", b"abc").verify(b"abd")


# --- CHECKPOINT_SWITCH ----------------------------------------------------------------


def _job(r, state="prefilling", worker="w1", attempts=2) -> str:
    r.hset(keys.job("j1"), mapping=JobRecord("j1", "m", state=JobState(state), worker=worker,
                                             attempts=attempts, cursor=64).to_hash())
    return keys.job("j1")


def switch(r, worker, attempt, record_key, cursor):
    return Scripts(r).run(scripts.checkpoint_switch(
        "j1", Fence(worker, attempt), record_key=record_key, cursor=cursor))


def test_checkpoint_switch_points_the_job_at_the_record(redis_conn):
    r = redis_conn()
    _job(r)
    assert switch(r, "w1", 2, "rec1", 32) == b"switched"
    assert switch(r, "w1", 2, "rec2", 64) == b"switched"
    record = JobRecord.from_hash("j1", r.hgetall(keys.job("j1")))
    assert (record.checkpoint, record.checkpoint_cursor) == ("rec2", 64)
    assert record.status().resumed_from is None
    r.hset(keys.job("j1"), "resumed_from", 32)
    assert JobRecord.from_hash("j1", r.hgetall(keys.job("j1"))).status().resumed_from == 32


@pytest.mark.parametrize("state,worker,attempt", [
    ("prefilling", "w1", 1),  # a stale attempt of the same worker
    ("prefilling", "w2", 2),  # another worker
    ("queued", "w1", 2),  # handed back
    ("finished", "w1", 2),
])
def test_a_stale_writer_cannot_switch(redis_conn, state, worker, attempt):
    r = redis_conn()
    _job(r, state=state)
    r.hset(keys.job("j1"), mapping={"checkpoint": "current", "checkpoint_cursor": 32})
    assert switch(r, worker, attempt, "stale", 64) == b"fenced"
    record = JobRecord.from_hash("j1", r.hgetall(keys.job("j1")))
    assert (record.checkpoint, record.checkpoint_cursor) == ("current", 32)
