"""`AsyncPrefillClient` against a real redis-server and a real worker on the tiny Gemma 3:
the same jobs, statuses, results and errors as `PrefillClient`, and RQ jobs a sync worker
runs.

The worker runs in burst mode in the main thread (RQ installs signal handlers), which is
also the event loop's thread here: while it works the loop waits, and what was published
meanwhile is read afterwards. The one test that needs a waiter blocked during the work runs
its loop in a thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib

import pytest

from jobs import (
    AsyncPrefillClient,
    InvalidRequest,
    JobCanceled,
    JobFailed,
    JobNotFound,
    JobState,
    JobTimeout,
    PrefillClient,
    PromptTooLong,
    QueueFull,
    TokenOutOfRange,
    UnknownModel,
    keys,
)
from jobs.queues import intake_queue, job_id_of, own_queue
from jobs.serializer import unpackb
from tests.worker.helpers import MODEL, assert_logits_match, ids
from worker.redis_server import calls_since, command_calls

pytestmark = pytest.mark.anyio


@pytest.fixture
def client(connect, worker):  # the worker has registered its model
    return PrefillClient(connect())


@pytest.fixture
async def aclient(redis_server, worker):
    async with AsyncPrefillClient.from_url(redis_server) as c:
        yield c


def work(worker) -> None:
    worker.work(burst=True, logging_level="WARNING")


def queued(conn, queue) -> list[str]:
    return [job_id_of(rq_id) for rq_id in queue.get_job_ids()]


def rq_fields(conn, rq_id: str) -> dict:
    """The RQ job hash of `rq_id`, its creation times dropped and its job id replaced by
    ``JOB`` (in the call's data and the description), so two clients' jobs compare."""
    job_id = job_id_of(rq_id)
    raw = conn.hgetall(f"rq:job:{rq_id}")
    fields = {k.decode(): v for k, v in raw.items() if k not in (b"created_at", b"enqueued_at")}
    func, instance, args, kwargs = unpackb(zlib.decompress(fields.pop("data")))
    fields["call"] = (func, instance, ["JOB" if a == job_id else a for a in args], kwargs)
    fields["description"] = fields["description"].replace(job_id.encode(), b"JOB")
    return fields


async def test_an_async_submit_writes_the_rq_job_a_sync_submit_writes(client, aclient, connect):
    conn = connect()
    sync_job = client.submit(tokens=ids(20, 1), model=MODEL, top_k=3)
    async_job = await aclient.submit(tokens=ids(20, 1), model=MODEL, top_k=3)
    intake = intake_queue(conn, MODEL)
    assert queued(conn, intake) == [sync_job, async_job]
    sync_rq, async_rq = intake.get_job_ids()
    assert rq_fields(conn, async_rq) == rq_fields(conn, sync_rq)
    assert conn.smembers("rq:queues") == {intake.key.encode()}
    # the records differ only in the id and the submit time
    sync_raw = conn.hgetall(keys.job(sync_job))
    async_raw = conn.hgetall(keys.job(async_job))
    differ = (b"job_id", b"enqueued_at")
    assert {k: v for k, v in async_raw.items() if k not in differ} == {
        k: v for k, v in sync_raw.items() if k not in differ}
    assert sync_raw.keys() == async_raw.keys()


async def test_status_watch_and_result_equal_the_sync_clients(client, aclient, worker, tiny):
    token_ids = ids(60, 2)
    sync_job = client.submit(tokens=token_ids, model=MODEL, top_k=5, logits="full")
    async_job = await aclient.submit(tokens=token_ids, model=MODEL, top_k=5, logits="full")
    assert await aclient.status(sync_job) == client.status(sync_job)
    assert (await aclient.status(async_job)).state == JobState.QUEUED
    statuses = aclient.watch(async_job, timeout=60)
    first = await anext(statuses)  # subscribed before the worker runs
    work(worker)
    rest = [s async for s in statuses]
    assert first.state == JobState.QUEUED and rest[-1].state == JobState.FINISHED
    assert rest[-1] == client.status(async_job)
    for job in (sync_job, async_job):
        assert [s async for s in aclient.watch(job)] == list(client.watch(job))
        assert await aclient.result(job, timeout=0) == client.result(job, timeout=0)
    ours, theirs = await aclient.result(async_job), client.result(sync_job)
    assert (ours.top_k, list(ours.logits)) == (theirs.top_k, list(theirs.logits))
    assert ours.chunks_done == theirs.chunks_done == 4  # 60 tokens in 16-token chunks
    assert_logits_match(ours, tiny, token_ids)
    assert (await aclient.models()) == client.models()


def test_result_waits_on_the_jobs_channel_while_a_worker_runs_it(redis_server, worker, connect):
    conn = connect()
    job = PrefillClient(connect()).submit(tokens=ids(40, 3), model=MODEL, top_k=2)
    channel = keys.events(job).encode()
    got = {}

    async def wait() -> None:
        async with AsyncPrefillClient.from_url(redis_server) as c:
            got["result"] = await c.result(job, timeout=60)

    waiter = threading.Thread(target=asyncio.run, args=(wait(),), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while dict(conn.pubsub_numsub(channel)).get(channel, 0) == 0:
        assert time.monotonic() < deadline, "the waiter never subscribed"
        time.sleep(0.01)
    work(worker)  # the waiter is blocked on the channel meanwhile, in its own loop
    waiter.join(timeout=10)
    assert got["result"].n_tokens == 40
    assert dict(conn.pubsub_numsub(channel)).get(channel, 0) == 0  # it unsubscribed


async def test_waiting_sends_no_busy_reads(aclient, client, connect):
    conn = connect()
    job = await aclient.submit(tokens=ids(20, 4), model=MODEL)
    before, start = command_calls(conn), time.monotonic()
    with pytest.raises(JobTimeout):
        await aclient.result(job, timeout=1.5)
    assert time.monotonic() - start >= 1.5
    # reads: on subscribing, on the subscribe confirmation, then one per WATCH_RECHECK_S
    # (1 s) without an event; measured 4 (a busy poll would make thousands)
    assert calls_since(conn, before).get("hgetall", 0) <= 4


async def same_error(sync_call, async_call) -> Exception:
    """Both calls raise the same error type with the same message; returns the async one."""
    with pytest.raises(Exception) as theirs:
        sync_call()
    with pytest.raises(Exception) as ours:
        await async_call()
    assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))
    return ours.value


@pytest.mark.parametrize(("submit", "error"), [
    ({}, InvalidRequest),
    ({"prompt": "a", "tokens": [2, 300]}, InvalidRequest),
    ({"prompt": "   "}, InvalidRequest),
    ({"tokens": [2, 300], "top_k": -1}, InvalidRequest),
    ({"messages": [{"role": "user"}]}, InvalidRequest),
    ({"tokens": [2, 300], "model": "nope"}, UnknownModel),
    ({"tokens": [2, 10**6]}, TokenOutOfRange),
    ({"tokens": [2] * 100_000}, PromptTooLong),
    ({"tokens": [2, 300], "prompt_logprobs": -1}, InvalidRequest),
    ({"tokens": [2, 300], "prompt_logprobs": 1001}, InvalidRequest),
    ({"tokens": [2, 300], "prompt_logprobs": 2.0}, InvalidRequest),
    ({"tokens": [2, 300], "prompt_logprobs": True}, InvalidRequest),
    ({"tokens": [2, 300], "prompt_logprobs": 3, "session": "s1"}, InvalidRequest),
])
async def test_bad_submits_raise_the_sync_clients_errors(client, aclient, submit, error):
    submit = {"model": MODEL, **submit}
    raised = await same_error(lambda: client.submit(**submit),
                              lambda: aclient.submit(**submit))
    assert type(raised) is error


async def test_job_errors_equal_the_sync_clients(client, aclient, worker, redis_server):
    await same_error(lambda: client.status("nope"), lambda: aclient.status("nope"))
    assert isinstance(await same_error(lambda: client.cancel("nope"),
                                       lambda: aclient.cancel("nope")), JobNotFound)
    await same_error(lambda: client.result("nope", 0), lambda: aclient.result("nope", 0))
    queued_job = await aclient.submit(tokens=ids(20, 5), model=MODEL)
    assert isinstance(await same_error(lambda: client.result(queued_job, 0),
                                       lambda: aclient.result(queued_job, 0)), JobTimeout)
    full = AsyncPrefillClient.from_url(redis_server, max_queue_depth=1)
    sync_full = PrefillClient(client.redis, max_queue_depth=1)
    assert isinstance(await same_error(lambda: sync_full.submit(tokens=[2, 300], model=MODEL),
                                       lambda: full.submit(tokens=[2, 300], model=MODEL)),
                      QueueFull)
    await full.aclose()
    assert (await aclient.cancel(queued_job), await aclient.cancel(queued_job)) == (True, False)
    assert isinstance(await same_error(lambda: client.result(queued_job, 0),
                                       lambda: aclient.result(queued_job, 0)), JobCanceled)
    too_long = await aclient.submit(prompt="word " * 5000, model=MODEL)
    work(worker)
    failed = await same_error(lambda: client.result(too_long, 0),
                              lambda: aclient.result(too_long, 0))
    assert isinstance(failed, JobFailed) and failed.error_type == "PromptTooLong"


async def test_an_idempotent_resubmit_returns_the_first_job(aclient, connect):
    first = await aclient.submit(tokens=ids(20, 6), model=MODEL, idempotency_key="k")
    again = await aclient.submit(tokens=ids(20, 6), model=MODEL, idempotency_key="k")
    assert first == again
    assert queued(connect(), intake_queue(connect(), MODEL)) == [first]


async def test_an_idempotency_claim_lives_the_clients_result_ttl(redis_server, worker, connect):
    # a claim outliving the record it names would answer a retry with an expired job (and
    # kept a key per job for 24 h whatever the TTLs: found by tests/reliability/test_load.py)
    conn = connect()
    first = PrefillClient(conn, result_ttl_s=30).submit(
        tokens=ids(20, 6), model=MODEL, idempotency_key="sync")
    async with AsyncPrefillClient.from_url(redis_server, result_ttl_s=30) as aclient:
        second = await aclient.submit(tokens=ids(20, 7), model=MODEL, idempotency_key="async")
    for key, job in (("sync", first), ("async", second)):
        assert conn.get(keys.idempotency(key)).decode() == job
        assert 0 < conn.ttl(keys.idempotency(key)) <= 30


async def test_a_session_job_is_routed_to_its_holder_like_the_sync_ones(
    client, aclient, worker, connect, tiny
):
    history = ids(200, 7)
    client.submit(tokens=history, model=MODEL, top_k=3, session="chat")
    work(worker)
    worker.register_models()  # alive again (a burst run ends by deregistering)
    assert await aclient.session_holder("chat") == client.session_holder("chat") == "w1"
    assert await aclient.session_holder("other") is None
    follow = history + ids(41, 8)[1:]
    routed = await aclient.submit(tokens=follow, model=MODEL, top_k=3, session="chat")
    cold = await aclient.submit(tokens=ids(30, 9), model=MODEL, top_k=3, session="other")
    conn = connect()
    assert queued(conn, own_queue(conn, "w1")) == [routed]
    assert queued(conn, intake_queue(conn, MODEL)) == [cold]
    work(worker)
    result = await aclient.result(routed, timeout=0)
    assert (result.cached_tokens, result.reuse) == (200, "live")  # the slot was reused
    assert_logits_match(result, tiny, follow)
    assert (await aclient.result(cold, timeout=0)).reuse == "cold"


async def test_200_concurrent_submits_from_one_loop_land_and_finish(aclient, worker, connect):
    n = 200  # over the client's 64 command connections and redis.asyncio's default 100
    prompts = [ids(3, 100 + i) for i in range(n)]
    jobs = await asyncio.gather(*(aclient.submit(tokens=p, model=MODEL, top_k=1)
                                  for p in prompts))
    conn = connect()
    assert len(set(jobs)) == n
    assert sorted(queued(conn, intake_queue(conn, MODEL))) == sorted(jobs)
    states = await asyncio.gather(*(aclient.status(j) for j in jobs))
    assert {s.state for s in states} == {JobState.QUEUED}
    work(worker)
    results = await asyncio.gather(*(aclient.result(j, timeout=0) for j in jobs))
    assert [r.n_tokens for r in results] == [3] * n
    assert len(intake_queue(conn, MODEL)) == 0


async def test_prompt_logprobs_through_the_async_client(client, aclient, worker):
    token_ids = ids(40, 3)
    ours = await aclient.submit(tokens=token_ids, model=MODEL, top_k=3, prompt_logprobs=3)
    theirs = client.submit(tokens=token_ids, model=MODEL, top_k=3, prompt_logprobs=3)
    work(worker)
    a, b = await aclient.result(ours, timeout=10), client.result(theirs, timeout=10)
    assert a.prompt_logprobs == b.prompt_logprobs and len(a.prompt_logprobs) == 41
    assert a.prompt_logprobs[0]["logprob"] is None
    assert [t["id"] for t in a.prompt_logprobs[-1]["top"]] == [t.id for t in a.top_k]
