"""KV checkpoints across worker processes on a real redis-server: a SIGKILLed or SIGTERMed
worker's job resumes mid-prompt on another worker, from Redis or from a directory both
share; a corrupt checkpoint falls back; a Redis restart with AOF mid-job; no blob outlives
its job.

Workers run the tiny Gemma 3 with 4-token chunks and a checkpoint after every chunk (the
writer skips a chunk while the previous checkpoint is still being written).
"""

from __future__ import annotations

import signal
import time

import numpy as np

from jobs import JobState, PrefillClient, keys

from .processes import MODEL, expected_top, ids, wait_for

EVERY_CHUNK = ("--checkpoint-every", "1")


def checkpoint_keys(client: PrefillClient, job: str) -> list[bytes]:
    return client.redis.keys(f"prefillq:{{{job}}}:ckpt:*")


def assert_exact(result, tiny, token_ids):
    top, logits = expected_top(tiny, token_ids, 5)
    assert [t.id for t in result.top_k] == top
    got = np.frombuffer(result.logits, dtype=np.float32)
    assert np.abs(got - logits).max() <= 1e-3 * np.abs(logits).max()


def started_and_killed(client, worker, token_ids, fraction: float, **submit) -> tuple[str, int]:
    """Submit, wait until `worker` has `fraction` of the prompt and a checkpoint past 0,
    SIGKILL it; the job id and the checkpointed cursor then."""
    job = client.submit(tokens=token_ids, model=MODEL, top_k=5, logits="full", **submit)
    target = int(fraction * len(token_ids))

    def far_enough() -> bool:
        status = client.redis.hmget(keys.job(job), "cursor", "checkpoint_cursor")
        return int(status[0] or 0) >= target and int(status[1] or 0) > 0

    wait_for(far_enough, 90, f"{worker.name} never reached {target}", worker)
    worker.signal(signal.SIGKILL)
    worker.wait()
    return job, int(client.redis.hget(keys.job(job), "checkpoint_cursor"))


def test_a_sigkilled_workers_job_resumes_mid_prompt_on_another(server, workers, tiny):
    client = PrefillClient.from_url(server.url)
    token_ids = ids(2000, 31)
    job, saved = started_and_killed(client, workers("w1", *EVERY_CHUNK), token_ids, 0.6)
    assert saved >= 1000  # within a few chunks of where it was killed
    workers("w2", *EVERY_CHUNK)
    result = client.result(job, timeout=120)
    status = client.status(job)
    assert (status.state, status.worker, status.attempts) == (JobState.FINISHED, "w2", 2)
    assert status.resumed_from == saved
    assert_exact(result, tiny, token_ids)
    assert checkpoint_keys(client, job) == []  # deleted when the job finished


def test_a_sigterm_hand_back_resumes_where_it_stopped(server, workers, tiny):
    client = PrefillClient.from_url(server.url)
    token_ids = ids(2000, 32)
    w1 = workers("w1", "--checkpoint-every", "3600s")  # only the hand-back's checkpoint
    job = client.submit(tokens=token_ids, model=MODEL, top_k=5, logits="full")
    wait_for(lambda: client.status(job).cursor >= 400, 60, "w1 never advanced", w1)
    w1.signal(signal.SIGTERM)
    assert w1.wait() == 0
    stopped = int(client.redis.hget(keys.job(job), "checkpoint_cursor"))
    assert stopped >= 400
    workers("w2")
    result = client.result(job, timeout=120)
    assert client.status(job).resumed_from == stopped
    assert_exact(result, tiny, token_ids)


def test_a_corrupt_latest_checkpoint_falls_back_one_and_stays_exact(server, workers, tiny):
    client = PrefillClient.from_url(server.url)
    token_ids = ids(2000, 33)
    w1 = workers("w1", *EVERY_CHUNK)
    job, saved = started_and_killed(client, w1, token_ids, 0.3)
    latest = client.redis.hget(keys.job(job), "checkpoint").decode()
    job_id, seq, _ = keys.parse_checkpoint(latest)
    segment = keys.checkpoint(job_id, seq, "segment")
    blob = bytearray(client.redis.get(segment))
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte in the newest rows
    client.redis.set(segment, bytes(blob))
    w2 = workers("w2", *EVERY_CHUNK)
    result = client.result(job, timeout=120)
    resumed = client.status(job).resumed_from
    assert resumed is not None and 0 < resumed < saved
    assert "checkpoint skipped: checksum" in w2.text()
    assert_exact(result, tiny, token_ids)


def test_checkpoints_in_a_shared_directory(server, workers, tiny, tmp_path):
    client = PrefillClient.from_url(server.url)
    store = ("--checkpoint-store", f"file://{tmp_path / 'ckpt'}")
    token_ids = ids(2000, 34)
    job, saved = started_and_killed(client, workers("w1", *EVERY_CHUNK, *store), token_ids,
                                    0.5)
    assert list((tmp_path / "ckpt").iterdir())
    assert checkpoint_keys(client, job) == []  # nothing of it in Redis
    workers("w2", *EVERY_CHUNK, *store)
    result = client.result(job, timeout=120)
    assert client.status(job).resumed_from == saved
    assert_exact(result, tiny, token_ids)
    assert [p for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".")] == []


def test_a_redis_restart_mid_job_keeps_its_checkpoints(server, workers, tiny):
    client = PrefillClient.from_url(server.url)
    token_ids = ids(2000, 35)
    w1 = workers("w1", *EVERY_CHUNK)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=5, logits="full")
    wait_for(lambda: int(client.redis.hget(keys.job(job), "checkpoint_cursor") or 0) >= 200,
             60, "no checkpoint", w1)
    server.stop()
    time.sleep(1.0)
    server.start()  # AOF on: the record, its checkpoint pointer and blobs survive
    wait_for(lambda: client.status(job).cursor >= 1000, 60, "w1 did not carry on", w1)
    w1.signal(signal.SIGKILL)
    w1.wait()
    saved = int(client.redis.hget(keys.job(job), "checkpoint_cursor"))
    workers("w2", *EVERY_CHUNK)
    result = client.result(job, timeout=120)
    assert client.status(job).resumed_from == saved
    assert_exact(result, tiny, token_ids)


def test_blobs_of_a_job_that_never_finishes_expire_with_it(server, workers):
    client = PrefillClient.from_url(server.url)
    token_ids = ids(2000, 36)
    w1 = workers("w1", *EVERY_CHUNK, "--result-ttl", "3")
    job, _ = started_and_killed(client, w1, token_ids, 0.1, max_attempts=1)
    assert checkpoint_keys(client, job)
    # the reaper (run by w2) fails it: WorkerLost after max_attempts; its record and its
    # checkpoint blobs then live out the result TTL
    workers("w2", "--result-ttl", "3")
    wait_for(lambda: client.status(job).state == JobState.FAILED, 30, "not reaped")
    wait_for(lambda: not checkpoint_keys(client, job), 10, "checkpoint blobs outlived the job")
