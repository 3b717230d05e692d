"""The lean chunk loop: what one chunk costs Redis, and admission between chunks.

Command counts come from ``INFO commandstats`` on a real redis-server (commands a script
runs count too). A job's fixed cost (its one RQ execution, start, publish, the worker's own
start and stop) is the same for the same prompt in 64 or 16 chunks, so the difference
divided by 48 is what one chunk costs.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from jobs import JobState, PrefillClient, keys, stats
from worker.redis_server import RedisServer, calls_since, command_calls
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

from .helpers import CHUNK, MODEL, assert_logits_match, ids

# A chunk's round trip: EVALSHA of the progress script, the HMGET, HSET and PUBLISH it
# runs, an LLEN of each queue the worker admits from (its own and one intake queue), and
# the chunk's stats (two HINCRBY, one HINCRBYFLOAT on keys.STATS).
MAX_COMMANDS_PER_CHUNK = 6 + stats.COMMANDS_PER_CHUNK


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


def run_job(server, tiny, token_ids, chunk_tokens: int, **worker_kwargs) -> dict[str, int]:
    """Commands a fresh worker and client cost to prefill `token_ids`, by command."""
    conn = redis.Redis.from_url(server.url)
    conn.flushall()
    # a heartbeat TTL far above the run: no beat or reap lands inside the measurement
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url),
                           WorkerSettings(chunk_tokens=chunk_tokens, heartbeat_ttl_s=3600,
                                          **worker_kwargs), name="w1")
    worker.register_models()
    client = PrefillClient(redis.Redis.from_url(server.url))
    before = command_calls(conn)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    worker.work(burst=True, logging_level="WARNING")
    spent = calls_since(conn, before)
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)
    return spent


def test_one_chunk_costs_at_most_nine_redis_commands(server, tiny):
    token_ids = ids(1024, 1)
    run_job(server, tiny, token_ids[:40], chunk_tokens=16)  # loads the scripts into Redis
    many = run_job(server, tiny, token_ids, chunk_tokens=16)  # 64 chunks
    few = run_job(server, tiny, token_ids, chunk_tokens=64)  # 16 chunks
    per_chunk = (sum(many.values()) - sum(few.values())) / (64 - 16)
    by_command = {k: (many.get(k, 0) - few.get(k, 0)) / 48 for k in many | few}
    by_command = {k: v for k, v in by_command.items() if v}
    assert per_chunk <= MAX_COMMANDS_PER_CHUNK, by_command
    # nothing of RQ's bookkeeping is paid per chunk
    assert {k for k, v in by_command.items() if v} <= {"evalsha", "hmget", "hset", "publish",
                                                        "llen", "hincrby",
                                                        "hincrbyfloat"}, by_command
    assert (by_command["hincrby"], by_command["hincrbyfloat"]) == (2, 1), by_command


def test_fifty_short_jobs_each_start_within_one_chunk_of_a_free_slot(setup, on_chunk, tiny):
    worker, client = setup(max_active=3, max_batch_jobs=1)  # waits counted in one-job steps
    longs = [client.submit(tokens=ids(640, s), model=MODEL) for s in (1, 2)]  # 40 chunks each
    shorts: list[str] = []
    short_ids, arrived = {}, []

    def burst_of_shorts(job_id, chunk_no):
        if job_id == longs[1] and chunk_no == 3 and not shorts:
            for i in range(50):
                short_ids[i] = ids(12, 100 + i)  # one chunk each
                shorts.append(client.submit(tokens=short_ids[i], model=MODEL))
            arrived.append(len(log.order))  # the position of the next chunk

    log = on_chunk(burst_of_shorts)
    worker.work(burst=True)
    first = {j: log.order.index(j) for j in shorts}
    # the first waits at most for the chunk in progress; then the slot frees after each one
    assert first[shorts[0]] - arrived[0] <= 1
    for prev, nxt in zip(shorts, shorts[1:], strict=False):
        assert first[nxt] - first[prev] <= 2, "a short job waited more than one chunk"
    assert all(log.order.count(j) == 1 for j in shorts)
    for i, j in enumerate(shorts):
        assert client.status(j).state == JobState.FINISHED
        if i % 10 == 0:
            assert_logits_match(client.result(j, timeout=0), tiny, short_ids[i])
    assert all(log.order.count(j) == 40 for j in longs)
    assert_logits_match(client.result(longs[0], timeout=0), tiny, ids(640, 1))


def test_an_idle_worker_sees_a_new_priority_within_one_wait(server, tiny):
    """A blocked worker re-reads the priorities in use every heartbeat_ttl / 6 (here 1 s)."""
    conn = redis.Redis.from_url(server.url)
    conn.flushall()
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url),
                           WorkerSettings(chunk_tokens=16, heartbeat_ttl_s=2), name="w1")
    worker.register_models()
    client = PrefillClient(redis.Redis.from_url(server.url))
    done = {}

    def submit_then_stop():
        time.sleep(1.5)  # the worker is blocked on the priority-0 queues by now
        job = client.submit(tokens=ids(40, 5), model=MODEL, priority=9)
        try:
            done["result"] = client.result(job, timeout=20)
            done["status"] = client.status(job)
        finally:
            worker._stop_requested = True  # RQ's own stop flag: the wait ends within 1 s

    thread = threading.Thread(target=submit_then_stop)
    thread.start()
    worker.work(burst=False, logging_level="WARNING")
    thread.join()
    status = done["status"]
    assert status.state == JobState.FINISHED
    assert status.started_at - status.enqueued_at < 2.5, "the new priority waited too long"
    assert_logits_match(done["result"], tiny, ids(40, 5))


def test_a_step_launches_the_next_step_before_its_round_trip(setup, tiny):
    """Steps are pipelined: once a step's chunks landed, the chunk of the job whose turn
    comes next is on the device while the step's round trip runs; turns keep their order
    and every result stays exact. One-job steps: the next turn is the other job's."""
    worker, client = setup(max_batch_jobs=1)
    first_ids, second_ids = ids(80, 3), ids(70, 4)
    first = client.submit(tokens=first_ids, model=MODEL, top_k=3)
    second = client.submit(tokens=second_ids, model=MODEL, top_k=3)
    worker.advance(first)  # the body of each job's one RQ execution: no chunk runs there
    worker.advance(second)
    assert list(worker.active) == [first, second]  # admitted in this order
    assert not any(a.prefill.launched or a.prefill.cursor for a in worker.active.values())
    worker.stepper.run(worker.prefill_scheduler.take_turn())
    assert worker.active[first].prefill.cursor == CHUNK
    assert client.status(first).cursor == CHUNK  # recorded by the step's round trip
    assert worker.active[second].prefill.launched  # second's turn is next
    assert not worker.active[first].prefill.launched
    worker.work(burst=True, logging_level="WARNING")
    assert_logits_match(client.result(first, timeout=0), tiny, first_ids)
    assert_logits_match(client.result(second, timeout=0), tiny, second_ids)


def test_a_hand_back_finishes_a_launched_chunk_and_checkpoints_it(setup, tiny):
    """SIGTERM right after a step: the chunk launched for the next turn is finished and
    checkpointed before the job goes back, so another worker resumes after it."""
    worker, client = setup(checkpoint_every="3600s")  # only the hand-back's checkpoint
    token_ids = ids(80, 5)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    worker.advance(job)
    worker.stepper.run(worker.prefill_scheduler.take_turn())
    assert worker.active[job].prefill.launched  # the first chunk is done, the second launched
    worker.hand_back_active()
    assert int(client.redis.hget(keys.job(job), "checkpoint_cursor")) == 2 * CHUNK
    other, _ = setup(name="w2")
    other.work(burst=True, logging_level="WARNING")
    assert client.status(job).resumed_from == 2 * CHUNK
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)
