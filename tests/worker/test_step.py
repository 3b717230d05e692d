"""The chunk step's start: input errors found by the worker, and the chunk plan recorded on
the job at its first start, followed by every later worker whatever its ``chunk_tokens``."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from jobs import JobFailed, JobState, keys
from jobs.queues import enqueue_new
from jobs.record import JobRecord
from jobs.schema import now

from .helpers import MODEL, assert_logits_match, ids


def write_job(conn, job_id: str, **fields) -> None:
    """Queue a job by writing its record directly, past the client's checks."""
    record = JobRecord(job_id=job_id, model=MODEL, enqueued_at=now(), **fields)
    with conn.pipeline() as pipe:
        pipe.multi()
        pipe.hset(keys.job(job_id), mapping=record.to_hash())
        enqueue_new(conn, job_id, MODEL, 0, pipe)
        pipe.execute()


def test_text_prompt_over_the_context_fails_as_prompt_too_long(setup, tiny):
    worker, client = setup()
    too_long = client.submit(prompt="word " * (tiny.context_length + 1), model=MODEL)
    fine = client.submit(tokens=ids(20, 1), model=MODEL, top_k=1)
    worker.work(burst=True)
    with pytest.raises(JobFailed) as failed:
        client.result(too_long, timeout=0)
    assert failed.value.error_type == "PromptTooLong"
    assert str(tiny.context_length) in failed.value.message
    assert client.status(fine).state == JobState.FINISHED


def test_token_ids_outside_the_workers_vocab_fail_as_token_out_of_range(setup, tiny):
    worker, client = setup()
    write_job(client.redis, "outofvocab", tokens=[2, 300, tiny.vocab_size])
    fine = client.submit(tokens=ids(20, 2), model=MODEL, top_k=1)
    worker.work(burst=True)
    status = client.status("outofvocab")
    assert status.state == JobState.FAILED
    assert status.error["type"] == "TokenOutOfRange"
    assert str(tiny.vocab_size) in status.error["message"]
    assert client.status(fine).state == JobState.FINISHED


def test_the_first_start_records_the_chunk_plan(setup):
    worker, client = setup(chunk_tokens=16)
    job = client.submit(tokens=ids(40, 3), model=MODEL)
    worker.work(burst=True)
    record = JobRecord.from_hash(job, client.redis.hgetall(keys.job(job)))
    assert record.chunk_plan == [16, 32, 40]


# A checkpointed hand-back finishes the chunk launched behind the second (the third, to 48)
@pytest.mark.parametrize("checkpoint_every, resumed_from", [("none", None), ("10s", 48)])
def test_a_handed_back_job_keeps_its_chunk_boundaries_on_another_worker(
    setup, on_chunk, tiny, checkpoint_every, resumed_from
):
    """Worker A (16-token chunks) is stopped as by SIGTERM after two chunks; worker B
    (5-token chunks) continues the job at the recorded 16-token boundaries: from 0 without
    checkpoints, else from the checkpoint A wrote as it handed the job back, after the
    chunk it had launched."""
    a, client = setup(name="wa", chunk_tokens=16, checkpoint_every=checkpoint_every)
    token_ids = ids(100, 4)
    job = client.submit(tokens=token_ids, model=MODEL, logits="full", top_k=5)

    def stop_a_after_its_second_chunk(job_id, chunk_no):
        if job_id == job and chunk_no == 2 and job in a.active:
            a.request_stop(signal.SIGTERM, None)  # RQ's warm shutdown, as on SIGTERM

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    log = on_chunk(stop_a_after_its_second_chunk)
    try:
        a.work(burst=True)
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])
    assert log.cursors == [(job, 16), (job, 32)]
    status = client.status(job)
    assert (status.state, status.cursor, status.attempts) == (JobState.QUEUED, 0, 1)

    b, _ = setup(name="wb", chunk_tokens=5, checkpoint_every=checkpoint_every)
    first = len(log.cursors)
    b.work(burst=True)
    start = resumed_from or 0
    assert log.cursors[first:] == [(job, c) for c in (16, 32, 48, 64, 80, 96, 100) if c > start]
    status = client.status(job)
    assert (status.state, status.worker, status.attempts) == (JobState.FINISHED, "wb", 2)
    assert status.resumed_from == resumed_from
    result = client.result(job, timeout=0)
    assert_logits_match(result, tiny, token_ids)
    expected = tiny.start_prefill(token_ids).run()  # one pass
    got = np.frombuffer(result.logits, dtype=np.float32)
    assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max()


@pytest.mark.parametrize("plan", [[16, 8, 30], [16, 32], [0, 30], []])
def test_a_recorded_plan_that_does_not_fit_fails_the_job(setup, plan):
    worker, client = setup()
    write_job(client.redis, "badplan", tokens=ids(30, 5), chunk_plan=plan or None)
    if not plan:  # an empty list is stored as such, not as "no plan"
        client.redis.hset(keys.job("badplan"), "chunk_plan", b"\x90")
    fine = client.submit(tokens=ids(20, 6), model=MODEL, top_k=1)
    worker.work(burst=True)
    status = client.status("badplan")
    assert status.state == JobState.FAILED
    assert status.error["type"] == "InvalidChunkPlan"
    assert client.status(fine).state == JobState.FINISHED
