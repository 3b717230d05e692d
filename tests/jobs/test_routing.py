"""Routing a session's job to the worker that keeps its slot, and back to intake when that
worker stops or dies."""

from __future__ import annotations

from jobs import PrefillClient, keys
from jobs.queues import intake_queue, job_id_of, move_to_intake, own_queue
from jobs.reaper import reap
from jobs.serializer import packb

MODEL = "m"


def client_with_model(conn) -> PrefillClient:
    conn.hset(keys.MODELS, MODEL, packb({"vocab_size": 100, "context_length": 1000,
                                         "architecture": "gemma3", "sha256": "-"}))
    return PrefillClient(conn)


def queued(conn, queue) -> list[str]:
    return [job_id_of(rq_id) for rq_id in queue.get_job_ids()]


def alive(conn, worker: str) -> None:
    conn.sadd(keys.WORKERS, worker)
    conn.set(keys.worker_heartbeat(worker), 1, ex=60)


def test_a_session_job_goes_to_its_live_holders_own_queue(redis_conn):
    conn = redis_conn()
    client = client_with_model(conn)
    alive(conn, "w1")
    conn.set(keys.session_holder("chat"), "w1")
    routed = client.submit(tokens=[1, 2, 3], model=MODEL, session="chat")
    other = client.submit(tokens=[1, 2, 3], model=MODEL, session="another")
    plain = client.submit(tokens=[1, 2, 3], model=MODEL)
    assert queued(conn, own_queue(conn, "w1")) == [routed]
    assert queued(conn, intake_queue(conn, MODEL)) == [other, plain]


def test_a_dead_holder_gets_no_new_jobs(redis_conn):
    conn = redis_conn()
    client = client_with_model(conn)
    conn.set(keys.session_holder("chat"), "gone")  # its heartbeat key expired
    job = client.submit(tokens=[1, 2, 3], model=MODEL, session="chat")
    assert client.session_holder("chat") is None
    assert queued(conn, intake_queue(conn, MODEL)) == [job]


def test_jobs_routed_to_a_worker_move_to_intake_when_it_stops_or_dies(redis_conn):
    conn = redis_conn()
    client = client_with_model(conn)
    for worker in ("w1", "w2"):
        alive(conn, worker)
        conn.set(keys.session_holder(f"chat-{worker}"), worker)
    stopping = client.submit(tokens=[1, 2], model=MODEL, session="chat-w1")
    dying = client.submit(tokens=[1, 2], model=MODEL, session="chat-w2")
    assert move_to_intake(conn, "w1") == [stopping]  # w1's warm shutdown
    conn.delete(keys.worker_heartbeat("w2"))  # w2 is SIGKILLed: its heartbeat expires
    conn.delete(keys.worker_heartbeat("w1"))
    reap(conn)
    assert queued(conn, intake_queue(conn, MODEL)) == [stopping, dying]
    assert not conn.exists(own_queue(conn, "w2").key)
    assert client.status(dying).state.value == "queued"
