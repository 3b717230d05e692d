"""What a real worker and the clients record in ``keys.STATS`` (`jobs.stats`), read back as
`ClusterStats`: every chunk and computed token once, every job's end once, whichever script
ended it, every submit once; and the live shape of the cluster while a job is in flight.

Workers run in-process in burst mode on the tiny Gemma 3, against fakeredis and a real
redis-server (the `setup` fixture); `OnChunk` acts between a chunk and its round trip.
"""

from __future__ import annotations

import time

import pytest
import redis.asyncio

from jobs import AsyncPrefillClient, JobState, UnknownModel, keys
from jobs.reaper import reap
from jobs.stats import read_cluster_stats, read_cluster_stats_sync
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

from .helpers import CHUNK, MODEL, assert_logits_match, ids


def work(worker) -> None:
    worker.work(burst=True, logging_level="WARNING")


def chunks_of(n: int, size: int = CHUNK) -> int:
    return -(-n // size)


def test_tokens_and_chunks_are_counted_as_computed(setup, tiny):
    worker, client = setup()
    jobs = [client.submit(tokens=ids(20, 1), model=MODEL),
            client.submit(tokens=ids(100, 2), model=MODEL, chunk_tokens=7),
            client.submit(tokens=ids(200, 3), model=MODEL, session="chat")]
    work(worker)
    follow = ids(200, 3) + ids(41, 4)[1:]  # reuses the 200 tokens of the session's slot
    for _ in range(2):  # the second turn repeats the first exactly: no forward pass
        jobs.append(client.submit(tokens=follow, model=MODEL, session="chat"))
        work(worker)
    results = [client.result(j, timeout=0) for j in jobs]
    assert [r.cached_tokens for r in results] == [0, 0, 0, 200, 240]
    assert_logits_match(results[3], tiny, follow)
    s = read_cluster_stats_sync(client.redis)
    assert s.tokens_prefilled == sum(r.n_tokens - r.cached_tokens for r in results) == 360
    assert s.tokens_reused == sum(r.cached_tokens for r in results) == 440
    assert s.chunks.count == sum(r.chunks_done for r in results)
    assert s.chunks.count == chunks_of(20) + chunks_of(100, 7) + chunks_of(200) + 3
    assert s.chunks.cumulative[-1] == s.chunks.count
    # each chunk's wall time covers its compute and lies inside its job's prefill
    compute = sum(r.timings["compute_s"] for r in results)
    assert compute <= s.chunks.sum_seconds <= sum(r.timings["prefill_s"] for r in results)
    assert (s.submitted, s.finished, s.failed, s.canceled) == (5, 5, 0, 0)
    assert (s.queued, s.prefilling) == (0, 0)


def test_a_cancel_counts_once_queued_at_a_chunk_or_at_the_last_chunk(setup, on_chunk):
    worker, client = setup()
    queued = client.submit(tokens=ids(40, 1), model=MODEL)
    assert client.cancel(queued) and not client.cancel(queued)
    in_flight = client.submit(tokens=ids(100, 2), model=MODEL)
    at_last = client.submit(tokens=ids(32, 3), model=MODEL)  # canceled in its publish
    bystander = client.submit(tokens=ids(20, 4), model=MODEL)

    def cancel_at_chunk_2(job_id, chunk_no):
        if job_id in (in_flight, at_last) and chunk_no == 2:
            assert client.cancel(job_id)

    on_chunk(cancel_at_chunk_2)
    work(worker)  # it also pops the queued job's RQ execution, and skips it
    assert [client.status(j).state for j in (queued, in_flight, at_last, bystander)] == [
        JobState.CANCELED, JobState.CANCELED, JobState.CANCELED, JobState.FINISHED]
    assert not client.cancel(in_flight)
    s = read_cluster_stats_sync(client.redis)
    assert (s.submitted, s.finished, s.failed, s.canceled) == (4, 1, 0, 3)
    assert (s.tokens_prefilled, s.chunks.count) == (32 + 32 + 20, 6)


def test_a_failure_counts_once_from_fail_or_requeue(setup, on_chunk, tiny):
    worker, client = setup()
    too_long = client.submit(prompt="word " * (tiny.context_length + 1), model=MODEL)
    poisoned = client.submit(tokens=ids(100, 1), model=MODEL, max_attempts=1)

    def poison_at_chunk_2(job_id, chunk_no):
        if job_id == poisoned and chunk_no == 2:
            worker.active[job_id].prefill.cache.poison()  # chunk 3 raises

    on_chunk(poison_at_chunk_2)
    work(worker)
    assert client.status(too_long).error["type"] == "PromptTooLong"
    assert client.status(poisoned).error["type"] == "ModelError"
    s = read_cluster_stats_sync(client.redis)
    assert (s.submitted, s.finished, s.failed, s.canceled) == (2, 0, 2, 0)
    assert (s.tokens_prefilled, s.chunks.count) == (32, 2)
    assert s.chunks.count == client.status(poisoned).chunks_done


def test_the_reaper_counts_what_it_ends_and_the_fenced_worker_nothing(setup, on_chunk):
    worker, client = setup(max_active=3, heartbeat_ttl_s=3600)
    fails = client.submit(tokens=ids(100, 1), model=MODEL, max_attempts=1)
    requeued = client.submit(tokens=ids(100, 2), model=MODEL)
    canceled = client.submit(tokens=ids(100, 3), model=MODEL)
    reaped = []

    def die_at_chunk_2(job_id, chunk_no):
        if job_id == fails and chunk_no == 2 and not reaped:  # all three are in flight
            assert client.cancel(canceled)
            client.redis.delete(keys.worker_heartbeat("w1"))  # w1 "died"
            reaped.extend(sorted(r.outcome for r in reap(client.redis)))

    on_chunk(die_at_chunk_2)
    work(worker)  # its own writes are fenced now; `requeued` comes back and finishes
    assert reaped == ["canceled", "failed", "queued"]
    assert [client.status(j).state for j in (fails, requeued, canceled)] == [
        JobState.FAILED, JobState.FINISHED, JobState.CANCELED]
    s = read_cluster_stats_sync(client.redis)
    assert (s.submitted, s.finished, s.failed, s.canceled) == (3, 1, 1, 1)


def test_submitted_counts_new_jobs_only(setup):
    _, client = setup()
    first = client.submit(tokens=ids(20, 1), model=MODEL, idempotency_key="k")
    assert client.submit(tokens=ids(20, 1), model=MODEL, idempotency_key="k") == first
    client.submit(tokens=ids(20, 2), model=MODEL)
    with pytest.raises(UnknownModel):
        client.submit(tokens=ids(20, 3), model="nope")
    s = read_cluster_stats_sync(client.redis)
    assert (s.submitted, s.queue_depth, s.queued) == (2, {MODEL: 2}, 2)


def wait_until_gone(conn, key: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while conn.exists(key):
        assert time.monotonic() < deadline, f"{key} did not expire"
        time.sleep(0.05)


def test_live_workers_and_prefilling_while_a_job_is_in_flight(setup, on_chunk, tiny,
                                                              redis_conn):
    worker, client = setup(max_active=1, heartbeat_ttl_s=3600)
    idle = PrefillWorker({MODEL: tiny}, redis_conn(),
                         WorkerSettings(heartbeat_ttl_s=3600), name="idle")
    gone = PrefillWorker({MODEL: tiny}, redis_conn(),
                         WorkerSettings(heartbeat_ttl_s=1), name="gone")
    idle.register_models()
    gone.register_models()
    client.redis.sadd(keys.worker_jobs("gone"), "a-job-it-held")
    wait_until_gone(client.redis, keys.worker_heartbeat("gone"))  # its heartbeat expired
    running = client.submit(tokens=ids(100, 1), model=MODEL)
    client.submit(tokens=ids(20, 2), model=MODEL)  # waits: w1 has room for one
    seen = []

    def read_at_chunk_2(job_id, chunk_no):
        if job_id == running and chunk_no == 2:
            seen.append(read_cluster_stats_sync(client.redis))

    on_chunk(read_at_chunk_2)
    work(worker)
    s = seen[0]
    assert (s.prefilling, s.queue_depth, s.live_workers) == (1, {MODEL: 1}, {MODEL: 2})
    assert (s.workers_alive, s.workers_dead) == (2, 1)  # w1 and idle; gone is not reaped
    after = read_cluster_stats_sync(client.redis)  # w1 deregistered when its burst ended
    assert (after.prefilling, after.queued, after.live_workers) == (0, 0, {MODEL: 1})
    assert after.finished == 2


def test_a_flushed_script_cache_still_counts_each_chunk_once(setup, on_chunk):
    worker, client = setup()
    job = client.submit(tokens=ids(100, 1), model=MODEL)
    on_chunk(lambda job_id, chunk_no: chunk_no == 3 and client.redis.script_flush())
    work(worker)  # chunk 3's EVALSHA answers NOSCRIPT: loaded, resent without the stats
    result = client.result(job, timeout=0)
    s = read_cluster_stats_sync(client.redis)
    assert (s.tokens_prefilled, s.chunks.count) == (100, result.chunks_done)
    assert s.finished == 1


def test_stats_writes_that_fail_never_fail_the_job(setup, tiny):
    worker, client = setup()
    token_ids = ids(100, 1)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    client.redis.delete(keys.STATS)
    client.redis.set(keys.STATS, "not a hash")  # every HINCRBY now answers WRONGTYPE
    work(worker)
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)


@pytest.mark.anyio
async def test_the_async_client_counts_and_reads_as_the_sync_one(redis_server, tiny):
    import redis as sync_redis

    conn = sync_redis.Redis.from_url(redis_server)
    conn.flushall()
    worker = PrefillWorker({MODEL: tiny}, conn, WorkerSettings(chunk_tokens=CHUNK), name="w1")
    worker.register_models()
    async with AsyncPrefillClient.from_url(redis_server) as aclient:
        first = await aclient.submit(tokens=ids(20, 1), model=MODEL, idempotency_key="k")
        again = await aclient.submit(tokens=ids(20, 1), model=MODEL, idempotency_key="k")
        assert again == first
        queued = await aclient.submit(tokens=ids(20, 2), model=MODEL)
        assert await aclient.cancel(queued) and not await aclient.cancel(queued)
        work(worker)
        reader = redis.asyncio.Redis.from_url(redis_server)
        s = await read_cluster_stats(reader)
        await reader.aclose()
    assert s == read_cluster_stats_sync(conn)
    assert (s.submitted, s.finished, s.canceled, s.tokens_prefilled) == (2, 1, 1, 20)
