"""Admission in bulk (`PrefillWorker._admit`): a worker with room takes every waiting job it
has room for in a few round trips, not one RQ execution each, and keeps what RQ's execution
guaranteed: the allow-list, the pop recorded for the reaper until the job is held, no RQ
hash left behind."""

from __future__ import annotations

import pytest
from rq.registry import FailedJobRegistry

from jobs import JobState, keys
from jobs.queues import intake_queue
from jobs.serializer import MsgpackSerializer

from .helpers import MODEL, CountingConnection, assert_logits_match, ids


def round_trips_to_admit(worker) -> int:
    worker.connection.ping()  # a connection in the pool: its handshake is not counted
    before = CountingConnection.sent
    assert worker._admit(worker.prefill_scheduler.queues())
    return CountingConnection.sent - before


@pytest.mark.parametrize("n_jobs", [2, 8])
def test_admitting_any_number_of_jobs_costs_six_round_trips(counted, tiny, n_jobs):
    """The take script, the RQ hashes, the records, the START scripts, the held set and the
    end of the pops: six round trips for 2 jobs as for 8."""
    worker, client = counted(max_active=8)
    client.submit(tokens=ids(20, 1), model=MODEL)  # loads the scripts into the server
    worker.work(burst=True, logging_level="WARNING")
    token_ids = [ids(20 + i, 30 + i) for i in range(n_jobs)]
    jobs = [client.submit(tokens=t, model=MODEL, top_k=3) for t in token_ids]
    worker.prefill_scheduler.queues()  # the intake priorities, read once
    assert round_trips_to_admit(worker) == 6
    assert list(worker.active) == jobs  # in queue order
    assert all(client.status(j).state == JobState.PREFILLING for j in jobs)
    assert client.redis.smembers(keys.worker_taking("w1")) == set()
    assert client.redis.smembers(keys.worker_jobs("w1")) == {j.encode() for j in jobs}
    assert not client.redis.keys("rq:job:*")  # as after RQ's execution (result_ttl 0)
    worker.work(burst=True, logging_level="WARNING")
    for job, t in zip(jobs, token_ids, strict=True):
        assert_logits_match(client.result(job, timeout=0), tiny, t)


def test_no_more_jobs_are_taken_than_there_is_room_for(counted, tiny):
    worker, client = counted(max_active=3)
    jobs = [client.submit(tokens=ids(20, s), model=MODEL) for s in range(5)]
    worker._admit(worker.prefill_scheduler.queues())
    assert list(worker.active) == jobs[:3]
    assert intake_queue(client.redis, MODEL).count == 2
    worker.work(burst=True, logging_level="WARNING")
    assert all(client.status(j).state == JobState.FINISHED for j in jobs)


def test_a_foreign_rq_job_among_those_taken_is_refused_and_the_rest_admitted(counted, tiny):
    """The three are taken together (a worker looks at intake before it blocks in RQ's
    dequeue), and the foreign one goes to RQ's failed registry."""
    worker, client = counted(max_active=4)
    first = client.submit(tokens=ids(20, 1), model=MODEL, top_k=3)
    queue = intake_queue(client.redis, MODEL)
    foreign = queue.enqueue("os.system", "echo pwned")  # the allow-list refuses it
    later = client.submit(tokens=ids(24, 2), model=MODEL, top_k=3)
    assert queue.serializer is MsgpackSerializer
    worker.work(burst=True, logging_level="WARNING")
    assert foreign.id in FailedJobRegistry(queue=queue).get_job_ids()
    assert_logits_match(client.result(first, timeout=0), tiny, ids(20, 1))
    assert_logits_match(client.result(later, timeout=0), tiny, ids(24, 2))
    assert client.redis.smembers(keys.worker_taking("w1")) == set()


def test_a_full_worker_fills_the_room_a_step_frees_without_an_rq_execution(counted, tiny):
    """A step that completes a job reads the intake lengths even though the worker was
    full, so the job behind it is taken in bulk as the other leaves; an idle worker looks
    before it blocks in RQ's dequeue. No job costs an RQ execution (about 57 commands)."""
    worker, client = counted(max_active=2, max_batch_jobs=2)
    executed = []
    execute_job = worker.execute_job
    worker.execute_job = lambda job, queue: (executed.append(job.id), execute_job(job, queue))
    token_ids = [ids(16, 40 + i) for i in range(6)]  # one chunk each: steps end both jobs
    jobs = [client.submit(tokens=t, model=MODEL, top_k=3) for t in token_ids]
    worker.work(burst=True, logging_level="WARNING")
    assert executed == []
    for job, t in zip(jobs, token_ids, strict=True):
        assert_logits_match(client.result(job, timeout=0), tiny, t)


def test_the_job_that_wakes_an_idle_worker_costs_no_rq_execution(counted, tiny):
    """A worker blocked in RQ's dequeue with nothing queued: each job that wakes it is
    started as a bulk take's are, its pop forgotten and its RQ hash deleted, and the worker
    goes back to blocking (it stops after `max_idle_time` with nothing more)."""
    import threading
    import time

    worker, client = counted(max_active=2)
    executed = []
    execute_job = worker.execute_job
    worker.execute_job = lambda job, queue: (executed.append(job.id), execute_job(job, queue))
    token_ids = [ids(20, 61), ids(40, 62)]
    results = []

    def submit_one_at_a_time():  # each job waits for the one before: each wakes the worker
        time.sleep(0.5)  # the worker is blocked in the dequeue by now
        for t in token_ids:
            job = client.submit(tokens=t, model=MODEL, top_k=3)
            results.append(client.result(job, timeout=20))

    submitter = threading.Thread(target=submit_one_at_a_time)
    submitter.start()
    worker.work(burst=False, max_idle_time=3, logging_level="WARNING")  # signals: main thread
    submitter.join(30)
    assert len(results) == 2 and executed == []
    for result, t in zip(results, token_ids, strict=True):
        assert_logits_match(result, tiny, t)
    assert client.redis.smembers(keys.worker_taking("w1")) == set()
    assert not client.redis.keys("rq:job:*")


def test_rq_heartbeats_are_coalesced_unless_rq_names_a_timeout(counted):
    """RQ's dequeue beats twice for each job that wakes an idle worker (three round trips
    each); the worker writes one at most every sixth of RQ's worker TTL, except the beats RQ
    gives a timeout or a pipeline of its own."""
    worker, client = counted()
    worker.register_birth()
    worker.heartbeat()
    first = client.redis.hget(worker.key, "last_heartbeat")
    worker.heartbeat()
    assert client.redis.hget(worker.key, "last_heartbeat") == first
    assert client.redis.ttl(worker.key) > worker.worker_ttl
    worker.heartbeat(30)  # RQ's own timeout is always written
    assert client.redis.hget(worker.key, "last_heartbeat") != first
    assert client.redis.ttl(worker.key) <= 30
