"""Redis at ``maxmemory`` under ``noeviction`` with worker processes, for every write the
service makes: a submit and a cancel raise redis-py's ``OutOfMemoryError`` to the caller and
write nothing; a job's publish (held at the point by a `worker.faults` pause) and its
checkpoints are refused, and the job ends ``failed`` with ``RedisOutOfMemory`` once that
write can land; no worker is taken for dead meanwhile (its heartbeat's TTL is extended);
both serve exact jobs again once memory frees. A worker started while Redis refuses writes
waits for room, unregistered, then serves the job queued before it. (`tests/worker/
test_redis_refused.py` has the same in process, write by write.)
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis
from rq.worker import Worker

from jobs import JobFailed, JobState, PrefillClient, keys
from tests.integration.processes import MODEL, expected_top, ids, wait_for
from worker.heartbeat import Heartbeat

# the heartbeat TTL of the test workers (`tests.integration.processes`), in seconds
HEARTBEAT_TTL_S = 2
PAUSED = 40  # tokens of the job held before its publish


def test_a_full_redis_refuses_each_write_and_the_workers_serve_on(server, workers, events,
                                                                  tiny, tmp_path):
    go = tmp_path / "go"
    plan = f"pause_before_publish:tokens={PAUSED}:until={go}:seconds=300"
    w1 = workers("w1", "--checkpoint-every", "1", faults=plan)
    w2 = workers("w2", "--checkpoint-every", "1")
    client = PrefillClient.from_url(server.url)
    admin = redis.Redis.from_url(server.url)
    job = client.submit(tokens=ids(PAUSED, 1), model=MODEL, top_k=5, logits="full")
    wait_for(lambda: f"fault: job {job} paused before_publish" in w1.text(), 60,
             "w1 never reached the publish", w1)

    admin.config_set("maxmemory", 1)  # below use: every write that grows memory is refused
    before = admin.dbsize()
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.submit(tokens=ids(20, 2), model=MODEL)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.cancel(job)
    assert admin.dbsize() == before
    status = client.status(job)  # reads still work
    assert status.state == JobState.PREFILLING and not status.cancel_requested

    go.touch()  # the publish now, refused: the job's failure is parked until memory frees
    wait_for(lambda: f"job {job}: Redis refused a write" in w1.text(), 60,
             "w1 never tried its publish", w1)
    # longer than a heartbeat TTL at maxmemory: both workers stay registered and alive
    until = time.monotonic() + 2 * HEARTBEAT_TTL_S + 0.5
    while time.monotonic() < until:
        assert admin.exists(keys.worker_heartbeat("w1"), keys.worker_heartbeat("w2")) == 2
        time.sleep(0.1)
    assert client.status(job).state == JobState.PREFILLING
    admin.config_set("maxmemory", 0)

    with pytest.raises(JobFailed) as failed:
        client.result(job, timeout=60)
    assert failed.value.error_type == "RedisOutOfMemory"
    assert client.status(job).attempts == 1, "the job was not reaped from a live worker"
    assert admin.exists(keys.logits(job)) == 0
    events.settle()
    assert events.count(job, "finished") == 0 and events.count(job, "failed") == 1

    for seed in (3, 4):  # both serve again
        token_ids = ids(30 + seed, seed)
        result = client.result(client.submit(tokens=token_ids, model=MODEL, top_k=5,
                                             logits="full"), timeout=60)
        top, logits = expected_top(tiny, token_ids, 5)
        assert [t.id for t in result.top_k] == top
        got = np.frombuffer(result.logits, dtype=np.float32)
        assert np.abs(got - logits).max() <= 1e-3 * np.abs(logits).max()
    assert w1.proc.poll() is None and w2.proc.poll() is None


def test_a_worker_started_at_maxmemory_waits_for_room_then_serves(server, workers, tiny):
    # The model's last worker is gone (its models stay advertised): a job waits in intake.
    admin = redis.Redis.from_url(server.url)
    gone = Heartbeat(admin, "gone", {MODEL: tiny}, ttl_s=HEARTBEAT_TTL_S, result_ttl_s=60,
                     publish_tokenizers=False)
    gone.register_models()
    gone.deregister()
    client = PrefillClient.from_url(server.url)
    token_ids = ids(30, 5)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=5)

    admin.config_set("maxmemory", 1)  # below use: every write that grows memory is refused
    w3 = workers("w3", registered=False)
    wait_for(lambda: "Redis refused" in w3.text(), 60, "w3 never tried to register", w3)
    # over several retries it waits, with nothing of it in Redis: under noeviction no key
    # can be created, so it has no heartbeat to keep alive (and holds no job) until it has room
    rq_worker_key = Worker.redis_worker_namespace_prefix + "w3"
    until = time.monotonic() + HEARTBEAT_TTL_S + 1
    while time.monotonic() < until:
        assert w3.proc.poll() is None, w3.text()
        assert admin.exists(keys.worker_heartbeat("w3"), rq_worker_key) == 0
        time.sleep(0.1)
    assert admin.info("errorstats")["errorstat_EXECABORT"]["count"] >= 3, "not retried"
    assert client.status(job).state == JobState.QUEUED
    admin.config_set("maxmemory", 0)

    top, _ = expected_top(tiny, token_ids, 5)
    assert [t.id for t in client.result(job, timeout=60).top_k] == top
    assert admin.exists(keys.worker_heartbeat("w3")) == 1
    assert admin.sismember(keys.WORKERS, "w3")
    log = w3.text()
    assert log.count("Redis refused") == 1 and "Traceback" not in log
    assert "Redis accepted the registration of w3 with RQ" in log
