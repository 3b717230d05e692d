"""Writes Redis refuses (``maxmemory`` under ``noeviction``) never take the worker down.

Against a real redis-server of the test's own (its ``maxmemory`` is changed). A job whose
publish, checkpoint or hand-back is refused fails with ``RedisOutOfMemory`` once that small
write can land; meanwhile the worker waits instead of quitting, and serves the next job
once memory frees. A worker started while Redis refuses its registration waits for room,
then serves. A refused KV checkpoint costs only the checkpoint. The client's writes:
a refused submit or cancel raises redis-py's ``OutOfMemoryError`` and writes nothing (a
submit's idempotency key is free again).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import redis

from jobs import AsyncPrefillClient, JobFailed, JobState, PrefillClient, keys
from jobs.queues import intake_queue
from tests.conftest import RedisServer
from worker.connection import refused_write as refused_error
from worker.connection import worker_connection
from worker.heartbeat import Heartbeat
from worker.redis_server import calls_since, command_calls
from worker.settings import WorkerSettings
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


# parked: the job's failure; after its publish was refused, also the return to intake of
# the job taken next (the step that ended the first read the intake lengths; the next one's
# start was refused)
@pytest.mark.parametrize("refused_at_chunk,parked", [(3, 2), (1, 1)],
                         ids=["publish", "checkpoint"])
def test_a_refused_write_fails_the_job_and_the_worker_serves_on(
    server, tiny, on_chunk, refused_at_chunk, parked
):
    admin = redis.Redis.from_url(server.url)
    assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url),
                           WorkerSettings(chunk_tokens=16, heartbeat_ttl_s=1, max_active=1),
                                          name="w1")
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

    assert seen["parked"] == parked
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
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url),
                           WorkerSettings(chunk_tokens=16), name="w1")
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

    worker.own_queue.delete(delete_jobs=True)  # the continuation of the handed-back cache
    worker.work(burst=True)
    assert client.status(job).attempts == 2
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)


class FillAtLine(logging.Handler):
    """Records the worker's log lines; sets ``maxmemory`` to 1 (every growing write refused)
    when one contains `fill_at` (lower case), then lifts it 1 s after one contains
    `free_after`."""

    def __init__(self, admin: redis.Redis, fill_at: str, free_after: str, seen: dict):
        super().__init__(logging.INFO)
        self.admin, self.fill_at, self.free_after, self.seen = admin, fill_at, free_after, seen
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        if self.fill_at in line.lower():  # RQ's wording varies in case across versions
            self.admin.config_set("maxmemory", 1)
        if self.free_after in line:
            threading.Timer(1.0, self._free).start()

    def _free(self) -> None:
        self.seen["heartbeat"] = self.admin.exists(keys.worker_heartbeat("w1"))
        self.admin.config_set("maxmemory", 0)


@pytest.fixture
def worker_lines():
    """``install(handler)``: `handler` on RQ's and the worker's loggers, at INFO, for the test."""
    loggers = [logging.getLogger(n) for n in ("rq.worker", "prefillq.worker")]
    levels = [lg.level for lg in loggers]
    installed = []

    def install(handler: logging.Handler) -> None:
        for lg in loggers:
            lg.addHandler(handler)
            lg.setLevel(logging.INFO)
        installed.append(handler)

    yield install
    for lg, level in zip(loggers, levels, strict=True):
        for handler in installed:
            lg.removeHandler(handler)
        lg.setLevel(level)


def test_a_worker_started_while_redis_refuses_waits_then_serves(server, tiny, worker_lines):
    # Redis fills once RQ has registered the worker (its "subscribing" line), so RQ's STARTED
    # state and the worker's own registration are refused; a job queued before waits.
    admin = redis.Redis.from_url(server.url)
    gone = Heartbeat(admin, "gone", {MODEL: tiny}, ttl_s=1, result_ttl_s=60,
                     publish_tokenizers=False)
    gone.register_models()  # the model's last worker, gone; its models stay advertised
    gone.deregister()
    client = PrefillClient(redis.Redis.from_url(server.url))
    token_ids = ids(20, 10)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    seen: dict = {}
    lines = FillAtLine(admin, "subscribing to channel",
                       "Redis refused the registration of w1's models", seen)
    worker_lines(lines)
    worker = PrefillWorker({MODEL: tiny}, worker_connection(server.url),
                           WorkerSettings(chunk_tokens=16, heartbeat_ttl_s=1), name="w1")
    worker.work(burst=True, logging_level="INFO")

    assert seen == {"heartbeat": 0}, "it beat before it was registered"
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)
    refusals = [line for line in lines.lines if "refused" in line]
    assert len(refusals) == 2, refusals
    assert refusals[0].startswith("Redis refused RQ's STARTED state: ")
    assert refusals[1].startswith("Redis refused the registration of w1's models (")
    assert any(line.startswith("Redis accepted the registration of w1's models after ")
               for line in lines.lines)


# -- the client's writes -------------------------------------------------------------------


def job_keys(conn: redis.Redis) -> list[bytes]:
    return conn.keys("prefillq:{*}:job")


def test_a_refused_submit_raises_out_of_memory_and_writes_nothing(server, tiny):
    admin = redis.Redis.from_url(server.url)
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url),
                           WorkerSettings(chunk_tokens=16), name="w1")
    worker.register_models()
    client = PrefillClient(redis.Redis.from_url(server.url))
    before = (job_keys(admin), len(worker.own_queue), admin.hgetall(keys.STATS))
    admin.config_set("maxmemory", 1)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.submit(tokens=ids(20, 4), model=MODEL)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.submit(tokens=ids(20, 4), model=MODEL, idempotency_key="k")
    admin.config_set("maxmemory", 0)
    assert (job_keys(admin), len(worker.own_queue), admin.hgetall(keys.STATS)) == before
    assert intake_queue(admin, MODEL).count == 0
    assert admin.exists(keys.idempotency("k")) == 0

    token_ids = ids(20, 4)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3, idempotency_key="k")
    worker.work(burst=True)  # the worker served on
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)


async def submit_async(url: str, **kwargs) -> str:
    client = AsyncPrefillClient.from_url(url)
    try:
        return await client.submit(**kwargs)
    finally:
        await client.aclose()


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_submit_whose_record_is_refused_gives_its_idempotency_key_back(server, tiny, kind):
    # Under maxmemory the claim (a SET of ~100 bytes) can land just before memory runs out
    # and the record is refused; an ACL without HSET refuses the record every time.
    admin = redis.Redis.from_url(server.url)
    admin.acl_setuser("no-hset", enabled=True, nopass=True, keys=["*"], channels=["*"],
                      commands=["+@all", "-hset"])
    host_port = server.url.removeprefix("redis://")
    limited = f"redis://no-hset:@{host_port}"
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url),
                           WorkerSettings(chunk_tokens=16), name="w1")
    worker.register_models()
    token_ids = ids(20, 5)
    kwargs = dict(tokens=token_ids, model=MODEL, top_k=3, idempotency_key="retry-me")

    def submit(url: str) -> str:
        if kind == "sync":
            return PrefillClient.from_url(url).submit(**kwargs)
        return asyncio.run(submit_async(url, **kwargs))

    before = command_calls(admin)
    with pytest.raises(redis.exceptions.NoPermissionError):
        submit(limited)
    assert calls_since(admin, before).get("set") == 1, "the claim did not land"
    assert job_keys(admin) == []
    assert admin.exists(keys.idempotency("retry-me")) == 0

    job = submit(server.url)  # the caller's retry: a real job, not the refused one's id
    worker.work(burst=True)
    assert_logits_match(PrefillClient.from_url(server.url).result(job, timeout=0), tiny,
                        token_ids)


def test_a_refused_cancel_raises_and_changes_nothing(server, tiny):
    admin = redis.Redis.from_url(server.url)
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url),
                           WorkerSettings(chunk_tokens=16), name="w1")
    worker.register_models()
    client = PrefillClient(redis.Redis.from_url(server.url))
    running = client.submit(tokens=ids(100, 6), model=MODEL, top_k=3)
    worker.advance(running)  # in flight: its first chunk ran
    waiting = client.submit(tokens=ids(20, 7), model=MODEL, top_k=3)

    admin.config_set("maxmemory", 1)
    for job in (waiting, running):
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.cancel(job)
    assert client.status(waiting).state == JobState.QUEUED
    assert not client.status(running).cancel_requested
    assert admin.exists(keys.cancel(running)) == 0
    admin.config_set("maxmemory", 0)

    assert client.cancel(waiting) and client.cancel(running)
    while worker.active:
        worker.stepper.run(worker.prefill_scheduler.take_turn())
    assert client.status(waiting).state == JobState.CANCELED
    assert client.status(running).state == JobState.CANCELED


# -- KV checkpoints to a store that refuses -------------------------------------------------


def test_refused_checkpoint_writes_leave_the_job_exact_and_the_worker_serving(server, tiny,
                                                                              tmp_path):
    (tmp_path / "store").mkdir()
    with RedisServer(tmp_path / "store") as store:
        store_admin = redis.Redis.from_url(store.url)
        worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(server.url),
                               WorkerSettings(chunk_tokens=16, checkpoint_store=store.url,
                                              checkpoint_every="1"), name="w1")
        worker.register_models()
        client = PrefillClient(redis.Redis.from_url(server.url))
        store_admin.config_set("maxmemory", 1)
        refused_ids = ids(80, 8)
        refused = client.submit(tokens=refused_ids, model=MODEL, top_k=5, logits="full")
        worker.work(burst=True)
        writer = worker.checkpointing.writer
        assert writer.failed >= 1 and writer.written == 0
        assert refused_error(writer.last_error)
        assert client.redis.hget(keys.job(refused), "checkpoint") is None
        assert_logits_match(client.result(refused, timeout=0), tiny, refused_ids)

        store_admin.config_set("maxmemory", 0)
        later_ids = ids(80, 9)
        later = client.submit(tokens=later_ids, model=MODEL, top_k=5)
        worker.work(burst=True)
        assert writer.written >= 1
        assert_logits_match(client.result(later, timeout=0), tiny, later_ids)
