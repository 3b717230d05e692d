"""`worker.taking`: every RQ job a worker pops is recorded in its taking set until its
execution returns, and the reaper gives the jobs a dead worker was taking back to intake
(real redis-server and fakeredis, the tiny Gemma 3 in process)."""

from __future__ import annotations

from types import SimpleNamespace

from jobs import JobState, keys
from jobs.queues import job_id_of
from jobs.reaper import reap

from .helpers import MODEL, assert_logits_match, ids


def test_a_pop_is_recorded_until_its_execution_returns(setup, tiny):
    worker, client = setup()
    token_ids = ids(20, 1)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    job_, queue = worker.queue_class.dequeue_any(worker.prefill_scheduler.queues(), None,
                                                 connection=worker.connection,
                                                 serializer=worker.serializer)
    assert job_id_of(job_.id) == job
    assert client.redis.smembers(keys.worker_taking("w1")) == {job_.id.encode()}
    assert len(queue) == 0, "popped"
    worker.execute_job(job_, queue)
    assert client.redis.exists(keys.worker_taking("w1")) == 0
    assert client.status(job).state == JobState.PREFILLING  # held now: the loop finishes it
    while worker.active:
        worker.stepper.run(worker.prefill_scheduler.take_turn())
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)


def test_a_blocking_pop_is_recorded_too(setup, monkeypatch):
    worker, client = setup()
    job = client.submit(tokens=ids(20, 2), model=MODEL)
    # the job arrives while the worker waits: its first look (TAKE) found nothing
    monkeypatch.setattr(worker.queue_class, "scripts",
                        SimpleNamespace(run=lambda call, client=None: None))
    job_, _ = worker.queue_class.dequeue_any(worker.prefill_scheduler.queues(), 1,
                                             connection=worker.connection,
                                             serializer=worker.serializer)
    assert job_id_of(job_.id) == job
    assert client.redis.smembers(keys.worker_taking("w1")) == {job_.id.encode()}


def test_the_reaper_requeues_a_job_its_dead_worker_dequeued_but_never_started(setup, tiny):
    worker, client = setup()
    token_ids = ids(20, 3)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    worker.queue_class.dequeue_any(worker.prefill_scheduler.queues(), None,
                                   connection=worker.connection, serializer=worker.serializer)
    # the worker dies here: its heartbeat expires, the job is queued and in no RQ queue
    client.redis.delete(keys.worker_heartbeat("w1"))
    assert client.status(job).state == JobState.QUEUED
    assert [r.job_id for r in reap(client.redis)] == [job]
    assert client.redis.exists(keys.worker_taking("w1")) == 0

    other, _ = setup(name="w2")
    other.work(burst=True)
    status = client.status(job)
    assert (status.state, status.attempts, status.worker) == (JobState.FINISHED, 1, "w2")
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)
