"""Garbage written straight into Redis: a real in-process worker on the tiny Gemma 3, against
fakeredis and a real redis-server. Each case is written before a good job is submitted; the
worker must come through it (the good job, queued behind the junk, finishes with the right
logits), the junk job (where there is one) must end ``failed`` with a typed, documented error,
and the clients must answer status, cancel and result with typed errors, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis

from jobs import (
    AsyncPrefillClient,
    CorruptJob,
    JobFailed,
    JobNotFound,
    JobState,
    UnknownModel,
    keys,
)
from jobs.queues import enqueue_admission, intake_queue, move_to_intake, own_queue, rq_queue_key
from jobs.reaper import reap
from jobs.record import JobRecord
from jobs.serializer import MsgpackSerializer, packb

from .helpers import GOOD, MODEL, assert_good, assert_logits, submit_good, work

INTAKE = rq_queue_key(keys.intake_queue(MODEL))
OWN = rq_queue_key(keys.own_queue("w1"))
ADVANCE = "worker.tasks.advance_prefill"


def bad_job(client, fields: dict | None = None, drop: tuple[str, ...] = ()) -> str:
    """A queued job whose record then gets `fields` written over it and `drop` removed."""
    job_id = client.submit(tokens=[2, 300, 301], model=MODEL)
    if fields:
        client.redis.hset(keys.job(job_id), mapping=fields)
    if drop:
        client.redis.hdel(keys.job(job_id), *drop)
    return job_id


# record field(s) written -> the error.type the job fails with, and the fields it names
CORRUPT_RECORDS = {
    "truncated tokens msgpack": ({"tokens": packb([2, 300, 301])[:-1]}, (), "tokens"),
    "tokens not msgpack": ({"tokens": b"\xc1\xff\x00"}, (), "tokens"),
    "tokens an int": ({"tokens": packb(5)}, (), "tokens"),
    "tokens strings": ({"tokens": packb(["a"])}, (), "tokens"),
    "tokens floats": ({"tokens": packb([2.5, 300.0])}, (), "tokens"),  # never truncated
    "tokens bools": ({"tokens": packb([True, False])}, (), "tokens"),
    "tokens a map": ({"tokens": packb({"a": 1})}, (), "tokens"),
    "messages truncated": ({"messages": b"\x93\x01"}, (), "messages"),
    "top_k not a number": ({"top_k": "abc"}, (), "top_k"),
    "state unknown": ({"state": "banana"}, (), "state"),
    "state missing": ({}, ("state",), "state"),
    "logits_mode unknown": ({"logits_mode": "xx"}, (), "logits_mode"),
    "attempts not a number": ({"attempts": "x"}, (), "attempts"),
    "max_attempts not a number": ({"max_attempts": "x"}, (), "max_attempts"),
    "enqueued_at not a time": ({"enqueued_at": "yesterday"}, (), "enqueued_at"),
    "prompt not UTF-8": ({"prompt": b"\xff\xfe"}, ("tokens",), "prompt"),
    "model not UTF-8": ({"model": b"\xff"}, (), "model"),
    "chunk_plan not msgpack": ({"chunk_plan": b"\xc1"}, (), "chunk_plan"),
    "cancel flag not a number": ({"cancel_requested": "yes"}, (), "cancel_requested"),
    "model missing": ({}, ("model",), "no model"),
}

# records that decode but break `submit`'s rules (a foreign client's): the worker's checks
INVALID_RECORDS = {
    "two inputs": ({"prompt": "hello"}, (), "InvalidRequest", "give exactly one of"),
    "no input": ({}, ("tokens",), "InvalidRequest", "give exactly one of"),
    "negative top_k": ({"top_k": "-5"}, (), "InvalidRequest", "top_k must be in [0, 1000]"),
    "huge top_k": ({"top_k": "100000"}, (), "InvalidRequest", "top_k must be in"),
    "zero chunk_tokens": ({"chunk_tokens": "0"}, (), "InvalidRequest", "chunk_tokens"),
    "empty token list": ({"tokens": packb([])}, (), "InvalidRequest", "tokens is empty"),
    "id out of vocabulary": ({"tokens": packb([2, 99999])}, (), "TokenOutOfRange", "99999"),
    "negative id": ({"tokens": packb([2, -1])}, (), "TokenOutOfRange", "-1"),
    "chunk plan that does not fit": ({"chunk_plan": packb([1, 99])}, (), "InvalidChunkPlan",
                                     "do not end"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_RECORDS))
def test_a_record_that_does_not_decode_fails_with_corrupt_job(stack, tiny64, case):
    fields, drop, named = CORRUPT_RECORDS[case]
    worker, client = stack()
    job = bad_job(client, fields, drop)
    if named != "no model":
        with pytest.raises(CorruptJob, match=named) as corrupt:  # before the worker sees it
            client.status(job)
        assert named in corrupt.value.fields and isinstance(corrupt.value, ValueError)
    good = submit_good(client)
    work(worker)
    status = client.status(job)  # the undecodable fields were dropped: it reads again
    assert status.state == JobState.FAILED and status.error["type"] == "CorruptJob"
    assert named in status.error["message"]
    with pytest.raises(JobFailed) as failed:
        client.result(job, timeout=0)
    assert failed.value.error_type == "CorruptJob"
    assert client.cancel(job) is False  # it ended: nothing to cancel
    assert_good(client, good, tiny64)
    assert not worker.active and client.redis.ttl(keys.job(job)) > 0  # it expires


@pytest.mark.parametrize("case", sorted(INVALID_RECORDS))
def test_a_record_breaking_the_submit_rules_fails_typed_in_the_worker(stack, tiny64, case):
    fields, drop, error_type, message = INVALID_RECORDS[case]
    worker, client = stack()
    job = bad_job(client, fields, drop)
    good = submit_good(client)
    work(worker)
    status = client.status(job)
    assert status.state == JobState.FAILED and status.error["type"] == error_type
    assert message in status.error["message"]
    assert_good(client, good, tiny64)


def rq_hash(connection, fields: dict, queue: str = INTAKE) -> None:
    connection.hset("rq:job:junk1", mapping=fields)
    connection.rpush(queue, "junk1")


QUEUE_JUNK = {
    "an id of no RQ job in intake": lambda r: r.rpush(INTAKE, "no-such-job"),
    "a non-UTF-8 id in intake": lambda r: r.rpush(INTAKE, b"\xff\xfe\xfd"),
    "an id of no RQ job in the own queue": lambda r: r.rpush(OWN, "no-such-job"),
    "a non-UTF-8 id in the own queue": lambda r: r.rpush(OWN, b"\xff\xfe"),
    "random bytes as ids": lambda r: r.rpush(INTAKE, b"\x00", b"\x80" * 9, "x" * 5000),
    "an RQ hash whose payload is not msgpack": lambda r: rq_hash(
        r, {"data": b"\xc1\xc1", "status": "queued"}),
    "an RQ hash without a payload": lambda r: rq_hash(r, {"status": "queued"}),
    "an RQ hash with a junk date": lambda r: rq_hash(
        r, {"data": packb([ADVANCE, None, ["x"], {}]), "created_at": "notadate"}),
    "an RQ hash with a junk timeout": lambda r: rq_hash(
        r, {"data": packb([ADVANCE, None, ["x"], {}]), "timeout": "abc"}),
    "an RQ hash naming another function": lambda r: rq_hash(
        r, {"data": packb(["os.system", None, ["echo hi"], {}]), "status": "queued"}),
    "an RQ job of a job id that does not exist": lambda r: intake_queue(r, MODEL).enqueue_call(
        ADVANCE, args=("no-such-job",), timeout=-1),
    "an RQ job without its argument": lambda r: intake_queue(r, MODEL).enqueue_call(
        ADVANCE, args=(), timeout=-1),
    "an RQ job whose argument is a list": lambda r: intake_queue(r, MODEL).enqueue_call(
        ADVANCE, args=([1, 2],), timeout=-1),
    "an RQ job whose argument is an int": lambda r: intake_queue(r, MODEL).enqueue_call(
        ADVANCE, args=(5,), timeout=-1),
}


@pytest.mark.parametrize("case", sorted(QUEUE_JUNK))
def test_junk_in_the_queues_is_dropped_and_the_worker_carries_on(stack, tiny64, case, caplog):
    worker, client = stack()
    QUEUE_JUNK[case](client.redis)
    good = submit_good(client)
    with caplog.at_level(logging.INFO):
        work(worker)
    assert_good(client, good, tiny64)
    assert "unhandled exception" not in caplog.text  # RQ's "quitting" line
    for queue in (INTAKE, OWN):
        assert client.redis.llen(queue) == 0
        assert client.redis.llen(queue + ":intermediate") == 0


def test_a_stopping_worker_moves_its_own_queue_to_intake_past_junk_ids(stack, tiny64):
    worker, client = stack()
    routed = submit_good(client)
    client.redis.delete(INTAKE)  # routed to w1 instead: its RQ job on w1's own queue
    enqueue_admission(own_queue(client.redis, "w1"), routed)
    client.redis.rpush(OWN, b"\xff\xfe", "no-such-job")
    assert move_to_intake(client.redis, "w1") == [routed, "no-such"]
    assert client.redis.llen(OWN) == 0
    work(worker)
    assert_good(client, routed, tiny64)


def test_unknown_ids_give_job_not_found_from_status_cancel_and_result(stack):
    _, client = stack()
    for job_id in ("nope", "", "\ud800", 5, None, b"bytes"):
        for call in (client.status, client.cancel, lambda j: client.result(j, timeout=0)):
            with pytest.raises(JobNotFound, match="never submitted, or expired"):
                call(job_id)


def test_a_corrupt_record_nobody_dequeues_answers_with_corrupt_job(stack):
    _, client = stack()
    job = bad_job(client, {"cursor": "ten", "top_k": packb([1])})
    with pytest.raises(CorruptJob, match="cursor") as error:
        client.status(job)
    assert error.value.fields == ("cursor", "top_k")
    with pytest.raises(CorruptJob):
        client.result(job, timeout=0)
    assert client.cancel(job) is True  # the cancel script reads the state only
    with pytest.raises(CorruptJob):
        client.status(job)


def test_a_finished_job_with_a_junk_result_answers_with_corrupt_job(stack, tiny64):
    worker, client = stack()
    job = submit_good(client)
    work(worker)
    client.redis.hset(keys.job(job), "result", b"\xc1")
    with pytest.raises(CorruptJob, match="result cannot be decoded"):
        client.result(job, timeout=0)
    client.redis.hset(keys.job(job), "result", packb({"n_tokens": 3}))  # fields missing
    with pytest.raises(CorruptJob):
        client.result(job, timeout=0)
    assert client.status(job).state == JobState.FINISHED


def test_a_failed_record_without_its_error_is_still_job_failed(stack):
    _, client = stack()
    job = bad_job(client, {"state": "failed"})
    with pytest.raises(JobFailed) as failed:
        client.result(job, timeout=0)
    assert failed.value.error_type == "unknown"


def test_a_junk_model_registration_is_unknown_model(stack):
    worker, client = stack()
    for junk in (b"\xc1", packb([1, 2]), packb({"vocab_size": "many"})):
        client.redis.hset(keys.MODELS, "junk", junk)
        with pytest.raises(UnknownModel, match="registration cannot be decoded"):
            client.submit(tokens=GOOD, model="junk")
        assert set(client.models()) == {MODEL}  # the junk entry is left out


def test_the_workers_dequeue_drops_junk_ids_and_forgets_their_pops(stack):
    worker, client = stack()
    routed = submit_good(client)
    client.redis.delete(INTAKE)
    client.redis.rpush(OWN, b"\xff", "no-such-job")
    enqueue_admission(own_queue(client.redis, "w1"), routed)
    job, queue = worker.queue_class.dequeue_any([worker.own_queue], None, connection=client.redis,
                                                serializer=MsgpackSerializer)
    assert job.args == [routed] and queue.name == keys.own_queue("w1")
    # the junk pops are dropped from the taking set: nothing for the reaper to hand back
    assert client.redis.smembers(keys.worker_taking("w1")) == {job.id.encode()}
    assert worker.queue_class.dequeue_any([worker.own_queue], None,
                                          connection=client.redis) is None


def test_junk_in_a_dead_workers_jobs_does_not_stop_the_reaper(stack, tiny64, caplog):
    worker, client = stack()
    r = client.redis
    junk = {"a": {"max_attempts": "x"}, "b": {}, "c": {"failures": "junk"},
            "d": {"priority": "high"}, "e": {"model": b"\xff"}}
    for job_id, fields in junk.items():  # all held by w9, whose heartbeat is gone
        record = JobRecord(job_id, MODEL, tokens=GOOD, state=JobState.PREFILLING,
                           worker="w9", attempts=1, top_k=5)
        r.hset(keys.job(job_id), mapping={**record.to_hash(), **fields})
        r.sadd(keys.worker_jobs("w9"), job_id)
    r.sadd(keys.WORKERS, "w9")
    outcomes = {x.job_id: x.outcome for x in reap(r)}  # Lua errors ended the pass before
    assert outcomes == {"a": "failed", "b": "queued", "c": "queued", "d": "queued"}
    assert "cannot reap job e of dead worker w9" in caplog.text
    work(worker)
    state = {j: client.status(j) for j in "abcd"}
    assert state["a"].error["type"] == "WorkerLost"  # an unreadable max_attempts: 1
    assert state["d"].error["type"] == "CorruptJob" and "priority" in state["d"].error["message"]
    for job_id in "bc":  # c's failures were rewritten by the requeue: it reads again
        assert_logits(client.result(job_id, timeout=0), tiny64, GOOD)


def test_the_async_client_answers_unknown_and_corrupt_ids_alike(redis_server):
    r = redis.Redis.from_url(redis_server)
    job = "corrupt-for-async"
    r.hset(keys.job(job), mapping={**JobRecord(job, MODEL, tokens=GOOD).to_hash(),
                                   "cursor": "ten"})

    async def calls():
        async with AsyncPrefillClient.from_url(redis_server) as aclient:
            for job_id in ("nope", "", "\udcff", 7):
                for call in (aclient.status, aclient.cancel,
                             lambda j: aclient.result(j, timeout=0)):
                    with pytest.raises(JobNotFound):
                        await call(job_id)
            with pytest.raises(CorruptJob, match="cursor"):
                await aclient.status(job)
            with pytest.raises(CorruptJob, match="cursor"):
                await aclient.result(job, timeout=0)

    try:
        asyncio.run(calls())
    finally:
        r.delete(keys.job(job))
