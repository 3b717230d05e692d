"""Writes Redis refuses (``maxmemory`` under ``noeviction``) never take the worker down.

Against a real redis-server of the test's own (its ``maxmemory`` is changed). A job whose
publish, checkpoint or hand-back is refused fails with ``RedisOutOfMemory`` once that small
write can land; meanwhile the worker waits instead of quitting, and serves the next job
once memory frees.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from jobs import JobFailed, JobState, PrefillClient, keys
from tests.conftest import RedisServer
from worker.worker import PrefillWorker

from .helpers import MODEL, assert_logits_match, ids


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path).start()
    yield srv
    srv.stop()


def free_memory_once_parked(admin: redis.Redis, worker: PrefillWorker, seen: dict) -> None:
    """From another thread: once the worker holds a refused write, note what it looked like
    then, and lift ``maxmemory``."""
    deadline = time.monotonic() + 60
    while not len(worker.stepper.parked) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # the worker keeps waiting, it does not quit
    seen["parked"] = len(worker.stepper.parked)
    seen["states"] = {j: admin.hget(keys.job(j), "state") for j in seen["jobs"]}
    admin.config_set("maxmemory", 0)


@pytest.mark.parametrize("refused_at_chunk", [3, 1], ids=["publish", "checkpoint"])
def test_a_refused_write_fails_the_job_and_the_worker_serves_on(
    server, tiny, on_chunk, refused_at_chunk
):
    admin = redis.Redis.from_url(server.url)
    assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url), name="w1",
                           chunk_tokens=16, heartbeat_ttl_s=1, max_active=1)
    worker.register_models()
    client = PrefillClient(redis.Redis.from_url(server.url))
    job = client.submit(tokens=ids(40, 1), model=MODEL, logits="full")  # 3 chunks
    next_ids = ids(20, 2)
    after = client.submit(tokens=next_ids, model=MODEL, top_k=3)
    seen = {"jobs": [job, after]}
    freer = threading.Thread(target=free_memory_once_parked, args=(admin, worker, seen))

    def fill_memory(job_id, chunk_no):
        if job_id == job and chunk_no == refused_at_chunk:
            admin.config_set("maxmemory", 1)  # below use: every growing write is refused
            freer.start()

    on_chunk(fill_memory)
    worker.work(burst=True)  # returns only once both jobs are settled
    freer.join()

    assert seen["parked"] == 1
    assert seen["states"] == {job: b"prefilling", after: b"queued"}
    with pytest.raises(JobFailed) as failed:
        client.result(job, timeout=0)
    assert failed.value.error_type == "RedisOutOfMemory"
    assert "maxmemory" in failed.value.message
    assert client.redis.exists(keys.logits(job)) == 0
    assert client.status(after).state == JobState.FINISHED
    assert_logits_match(client.result(after, timeout=0), tiny, next_ids)
    assert not worker.active and not len(worker.stepper.parked)
    assert not client.redis.sismember(keys.worker_jobs("w1"), job)


def test_a_refused_hand_back_is_retried_until_it_lands(server, tiny):
    admin = redis.Redis.from_url(server.url)
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url), name="w1",
                           chunk_tokens=16)
    worker.register_models()
    client = PrefillClient(redis.Redis.from_url(server.url))
    token_ids = ids(100, 3)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    worker.advance(job)  # start and one chunk, outside RQ's loop
    assert job in worker.active

    admin.config_set("maxmemory", 1)
    worker.hand_back_active()  # refused: kept for a retry, the cache is released
    assert not worker.active and len(worker.stepper.parked) == 1
    assert worker.stepper.settle() == 1, "still refused"
    assert client.status(job).state == JobState.PREFILLING
    admin.config_set("maxmemory", 0)
    assert worker.stepper.settle() == 0
    status = client.status(job)
    assert (status.state, status.cursor, status.attempts) == (JobState.QUEUED, 0, 1)

    worker.sticky.delete(delete_jobs=True)  # the continuation of the handed-back cache
    worker.work(burst=True)
    assert client.status(job).attempts == 2
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)
