"""`jobs.queues.admission`: the writes both clients send to enqueue a job are the ones RQ's
own ``Queue.enqueue_call`` makes for the same job, key for key and field for field, on a
real redis-server."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from rq.utils import utcparse

from jobs import keys
from jobs.queues import (
    ADMIT_OPTIONS,
    admission,
    admission_description,
    intake_queue,
    new_admission,
    own_queue,
)
from tests.worker.helpers import MODEL

# fields RQ stamps with the time of the write: compared as times close to now
STAMPED = ("created_at", "enqueued_at")


def snapshot(conn, rq_job_id: str) -> dict:
    """Every key of the server with its type, TTL and value; `rq_job_id` spelled ``<rq>``."""
    out = {}
    for key in conn.keys("*"):
        kind = conn.type(key).decode()
        if kind == "hash":
            fields = conn.hgetall(key)
            for field in STAMPED:
                stamp = utcparse(fields.pop(field.encode()).decode())
                assert abs((datetime.now(UTC) - stamp).total_seconds()) < 10, (field, stamp)
            value = sorted(fields.items())
        elif kind == "list":
            value = conn.lrange(key, 0, -1)
        else:
            value = sorted(conn.smembers(key))
        name = key.decode().replace(rq_job_id, "<rq>")
        out[name] = (kind, conn.ttl(key), str(value).replace(rq_job_id, "<rq>"))
    return out


def fresh(conn, queue) -> None:
    """An empty server but for one RQ job id ahead on `queue` (so a push's end shows)."""
    conn.flushall()
    conn.rpush(queue.key, "ahead")


def by_rq(conn, queue, job_id: str, rq_job_id: str, at_front: bool = False) -> dict:
    """The server after RQ's ``enqueue_call`` of the admission of `job_id` on `queue`."""
    fresh(conn, queue)
    with conn.pipeline() as pipe:
        pipe.multi()
        queue.enqueue_call("worker.tasks.advance_prefill", args=(job_id,), job_id=rq_job_id,
                           description=admission_description(job_id), pipeline=pipe,
                           at_front=at_front, **ADMIT_OPTIONS)
        pipe.execute()
    return snapshot(conn, rq_job_id)


def by_admission(conn, queue, writes) -> dict:
    """The server after sending `writes` (an `Admission`) in one MULTI."""
    fresh(conn, queue)
    with conn.pipeline() as pipe:
        writes.send(pipe)
        pipe.execute()
    return snapshot(conn, writes.rq_job_id)


@pytest.mark.parametrize("at_front", [False, True])
def test_an_admission_writes_what_rq_enqueue_call_writes(connect, at_front):
    conn = connect()
    queue = intake_queue(conn, MODEL, 3)
    writes = admission(conn, queue.name, "job1", at_front=at_front)
    ours = by_admission(conn, queue, writes)
    assert ours == by_rq(conn, queue, "job1", writes.rq_job_id, at_front)
    assert ours["rq:job:<rq>"][0] == "hash"


def test_a_new_job_s_admission_also_records_its_priority(connect):
    conn = connect()
    queue = intake_queue(conn, MODEL, 3)
    writes = new_admission(conn, "job2", MODEL, 3)
    ours = by_admission(conn, queue, writes)
    theirs = by_rq(conn, queue, "job2", writes.rq_job_id)
    assert ours == {**theirs, keys.priorities(MODEL): ("set", -1, "[b'3']")}


def test_a_routed_job_s_admission_goes_to_its_worker_s_queue(connect):
    conn = connect()
    queue = own_queue(conn, "w1")
    writes = new_admission(conn, "job3", MODEL, 0, worker="w1")
    ours = by_admission(conn, queue, writes)
    theirs = by_rq(conn, queue, "job3", writes.rq_job_id)
    assert ours == {**theirs, keys.priorities(MODEL): ("set", -1, "[b'0']")}


def test_building_an_admission_sends_nothing_through_its_connection(connect):
    # the clients' plans hand RQ's Job their pipeline as its connection: nothing may land on it
    with connect().pipeline() as pipe:
        writes = new_admission(pipe, "job4", MODEL, 0)
        assert len(pipe.command_stack) == 0
        writes.send(pipe)
        assert [c[0][0] for c in pipe.command_stack] == ["SADD", "SADD", "HSET", "RPUSH"]
