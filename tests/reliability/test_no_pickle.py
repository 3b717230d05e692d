"""No pickle anywhere in the job path: jobs of every kind run through a real worker on the
tiny Gemma 3 against a real redis-server, and every value Redis holds, mid-run and at the
end, is checked for pickle streams (`tests.reliability.pickles`, which never unpickles)."""

from __future__ import annotations

import base64
import logging
import pickle
import zlib

import pytest
import redis

from jobs import JobFailed, JobState, PrefillClient
from jobs.queues import ADMIT_FUNCTION, intake_queue
from jobs.serializer import unpackb
from tests.worker.helpers import CHUNK, MODEL, OnChunk, ids
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

from .pickles import all_values, is_pickle, pickled, unwrapped


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_the_detector_finds_pickles_of_every_protocol_and_wrapping(protocol):
    # what RQ's default serializer would store: (func_name, instance, args, kwargs)
    payload = pickle.dumps(("os.system", None, ("touch /tmp/x",), {}), protocol=protocol)
    stored = [payload, zlib.compress(payload), base64.b64encode(zlib.compress(payload))]
    if protocol >= 2:  # loads ignores what follows STOP
        stored.append(payload + b"trailing junk")
    for value in stored:
        assert any(is_pickle(v) for v in unwrapped(value)), (protocol, value[:20])
    assert is_pickle(pickle.dumps({"a": [1.5, "x"]}, protocol=protocol))


def test_the_detector_passes_what_prefillq_stores():
    from jobs.serializer import packb

    for value in (packb({"top_k": [{"id": 3, "logit": 1.5}]}), b"queued", b"0.5",
                  b"1764600000.25", packb(b"\x80\x04" + bytes(64)), b"", b"\x80"):
        assert not any(is_pickle(v) for v in unwrapped(value)), value


@pytest.fixture
def conn(redis_server):
    connection = redis.Redis.from_url(redis_server)
    connection.flushall()
    return connection


def test_the_scan_reads_every_kind_of_key(conn):
    bad = pickle.dumps({"x": 1}, protocol=4)
    conn.set("s", bad)
    conn.hset("h", mapping={"ok": b"1", "f": bad})
    conn.hset("h2", bad, b"1")  # a field name
    conn.rpush("l", b"ok", bad)
    conn.sadd("set", bad)
    conn.zadd("z", {bad: 1.0})
    conn.xadd("st", {"v": base64.b64encode(zlib.compress(bad))})
    conn.set("clean", b"queued")
    assert sorted(key for key, _ in pickled(all_values(conn))) == [
        "h", "h2", "l", "s", "set", "st", "z"]


def test_no_value_in_redis_is_a_pickle_after_jobs_of_every_kind(conn, redis_server, tiny):
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(redis_server),
                           WorkerSettings(chunk_tokens=CHUNK, checkpoint_every="1",
                                          result_ttl_s=600), name="np1")
    worker.register_models()
    client = PrefillClient(redis.Redis.from_url(redis_server))
    submitted = {
        "plain": client.submit(tokens=ids(40, 1), model=MODEL, top_k=5, priority=2),
        "full": client.submit(tokens=ids(30, 2), model=MODEL, logits="full"),
        "logprobs": client.submit(tokens=ids(30, 3), model=MODEL, prompt_logprobs=3),
        "text": client.submit(prompt="The capital of France is", model=MODEL,
                              idempotency_key="idem-1"),
        "checkpointed": client.submit(tokens=ids(200, 4), model=MODEL),
        "canceled_in_flight": client.submit(tokens=ids(200, 5), model=MODEL),
        "canceled_queued": client.submit(tokens=ids(20, 6), model=MODEL),
        "failed": client.submit(prompt="word " * 5000, model=MODEL),  # over the context
        "turn1": client.submit(tokens=ids(40, 7), model=MODEL, session="chat-1"),
    }
    client.cancel(submitted["canceled_queued"])
    # RQ's own failure and result bookkeeping: a refused foreign job, a finished foreign one
    intake_queue(conn, MODEL).enqueue("os.system", "true")
    intake_queue(conn, MODEL).enqueue_call(ADMIT_FUNCTION, args=("no-such-job",))
    rq_payloads = [unpackb(zlib.decompress(conn.hget(k, "data")))
                   for k in conn.scan_iter("rq:job:*")]
    assert len(rq_payloads) == len(submitted) + 2

    mid_run = {}

    def midway(job_id: str, chunk: int) -> None:
        if job_id == submitted["canceled_in_flight"] and chunk == 3:
            client.cancel(job_id)
        if job_id == submitted["checkpointed"] and chunk == 6 and not mid_run:
            worker.checkpointing.flush(timeout=30)
            mid_run.update(all_values(conn))

    handler = OnChunk(midway)
    logger = logging.getLogger("prefillq.worker")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        worker.work(burst=True)
        turn1 = client.result(submitted["turn1"], timeout=0)
        submitted["turn2"] = client.submit(tokens=[*ids(40, 7), *ids(12, 8)[1:]],
                                           model=MODEL, session="chat-1")
        worker.work(burst=True)
        worker.checkpointing.flush(timeout=30)
        worker.checkpointing.sessions.flush()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)

    states = {kind: client.status(job).state for kind, job in submitted.items()}
    assert states == {**{k: JobState.FINISHED for k in submitted},
                      "canceled_in_flight": JobState.CANCELED,
                      "canceled_queued": JobState.CANCELED, "failed": JobState.FAILED}
    with pytest.raises(JobFailed, match="PromptTooLong"):
        client.result(submitted["failed"], timeout=0)
    assert 0 < client.result(submitted["turn2"], timeout=0).cached_tokens <= turn1.n_tokens
    assert client.result(submitted["logprobs"], timeout=0).prompt_logprobs

    at_end = all_values(conn)
    scanned = set(mid_run) | set(at_end)
    # the scans saw every kind of record the job path writes
    for pattern in (":job", ":logits", ":prompt-logprobs", ":ckpt:", "session:chat-1:ckpt",
                    "prefillq:idem:", "prefillq:tokenizer:", "prefillq:stats", "rq:job:",
                    "rq:results:", "rq:failed:", "rq:worker:", "prefillq:workers"):
        assert any(pattern in key for key in scanned), f"no {pattern!r} key was scanned"
    assert sum(len(v) for v in at_end.values()) > 100
    assert pickled(mid_run) == [] and pickled(at_end) == []
    assert all(p[0] in (ADMIT_FUNCTION, "os.system") for p in rq_payloads)
