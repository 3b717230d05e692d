"""Cancel, interleaving, fairness, priority and retries, on a real worker loop (burst mode)
against a real Redis server and fakeredis, with the tiny Gemma 3 so chunks take milliseconds.

Actions "between chunks" are taken deterministically by `OnChunk`, a logging handler on the
worker's per-chunk INFO line: it runs in the worker's thread right after a chunk computed,
before the worker records it.
"""

from __future__ import annotations

import numpy as np
import pytest

from jobs import JobCanceled, JobFailed, JobState, keys

from .helpers import CHUNK, MODEL, assert_logits_match, ids

# -- cancel -------------------------------------------------------------------------------


def test_cancel_queued_job_never_starts(setup, on_chunk):
    worker, client = setup()
    job = client.submit(tokens=ids(100, 0), model=MODEL)
    assert client.cancel(job) is True
    assert client.cancel(job) is False  # idempotent
    status = client.status(job)
    assert status.state == JobState.CANCELED and status.finished_at is not None
    log = on_chunk()
    worker.work(burst=True)
    assert log.order == []
    status = client.status(job)
    assert (status.state, status.attempts, status.cursor) == (JobState.CANCELED, 0, 0)
    with pytest.raises(JobCanceled):
        client.result(job, timeout=0)


def test_cancel_in_flight_stops_at_the_next_chunk_boundary_and_spares_others(
    setup, on_chunk, tiny
):
    worker, client = setup()
    a_ids, b_ids = ids(200, 1), ids(150, 2)
    a = client.submit(tokens=a_ids, model=MODEL, logits="full")
    b = client.submit(tokens=b_ids, model=MODEL, top_k=5)

    def cancel_a_after_its_third_chunk(job_id, chunk_no):
        if job_id == a and chunk_no == 3:
            assert client.cancel(a) is True
            pending = client.status(a)
            assert pending.state == JobState.PREFILLING and pending.cancel_requested

    log = on_chunk(cancel_a_after_its_third_chunk)
    worker.work(burst=True)

    assert log.order.count(a) == 3, "no chunk of A runs after the cancel"
    status = client.status(a)
    assert status.state == JobState.CANCELED
    assert (status.cursor, status.chunks_done) == (3 * CHUNK, 3)
    assert not status.cancel_requested
    assert client.redis.exists(keys.logits(a)) == 0
    assert client.redis.hget(keys.job(a), "result") is None
    assert a not in worker.active and not worker.active
    with pytest.raises(JobCanceled):
        client.result(a, timeout=0)
    assert client.cancel(a) is False

    assert client.status(b).state == JobState.FINISHED
    assert_logits_match(client.result(b, timeout=0), tiny, b_ids)


def test_cancel_releases_a_waiting_jobs_cache_within_one_chunk(setup, on_chunk):
    # one-job steps, so "the next chunk" is another job's step (a cancel inside a packed
    # step: test_packed_steps.py)
    worker, client = setup(max_active=3, max_batch_jobs=1)
    jobs = [client.submit(tokens=ids(160, s), model=MODEL) for s in range(3)]
    seen = {}

    def cancel_last_then_watch(job_id, chunk_no):
        if job_id == jobs[0] and chunk_no == 2:
            client.cancel(jobs[2])
            seen["resident_at_cancel"] = jobs[2] in worker.active
        elif "resident_at_cancel" in seen and "after_next_chunk" not in seen:
            seen["after_next_chunk"] = jobs[2] in worker.active

    on_chunk(cancel_last_then_watch)
    worker.work(burst=True)
    # canceled right after jobs[0]'s chunk 2, while jobs[2] waited its turn: the next chunk
    # (jobs[1]'s) ran with jobs[2]'s cache already dropped
    assert seen == {"resident_at_cancel": True, "after_next_chunk": False}
    assert client.status(jobs[2]).state == JobState.CANCELED


def test_cancel_finished_job_changes_nothing(setup, tiny):
    worker, client = setup()
    token_ids = ids(40, 3)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    worker.work(burst=True)
    before = client.status(job)
    assert client.cancel(job) is False
    assert client.status(job) == before
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)


# -- interleaving, fairness, priority ------------------------------------------------------


def test_three_jobs_alternate_chunk_by_chunk(setup, on_chunk):
    worker, client = setup()
    jobs = [client.submit(tokens=ids(n, s), model=MODEL) for s, n in enumerate((80, 64, 48))]
    log = on_chunk()
    worker.work(burst=True)
    a, b, c = jobs
    assert log.order == [a, b, c] * 3 + [a, b] + [a]  # 5, 4 and 3 chunks


def test_short_job_finishes_within_max_active_plus_one_chunks(setup, on_chunk):
    max_active = 2
    worker, client = setup(max_active=max_active)
    long_job = client.submit(tokens=ids(400, 4), model=MODEL)  # 25 chunks
    short = {}

    def submit_short_mid_prefill(job_id, chunk_no):
        if chunk_no == 4 and not short:
            short["job"] = client.submit(tokens=ids(CHUNK // 2, 6), model=MODEL)
            short["at"] = len(log.order)

    log = on_chunk(submit_short_mid_prefill)
    worker.work(burst=True)
    done_at = log.order.index(short["job"]) + 1
    assert done_at - short["at"] <= max_active + 1
    assert client.status(short["job"]).state == JobState.FINISHED
    assert log.order[-1] == long_job and log.order.count(long_job) == 25


def test_long_job_is_not_starved_by_a_stream_of_short_ones(setup, on_chunk):
    max_active = 2
    worker, client = setup(max_active=max_active)
    long_job = client.submit(tokens=ids(320, 7), model=MODEL)  # 20 chunks
    shorts = []

    def keep_submitting_shorts(job_id, chunk_no):
        if len(shorts) < 30:
            shorts.append(client.submit(tokens=ids(2 * CHUNK, 100 + len(shorts)), model=MODEL))

    log = on_chunk(keep_submitting_shorts)
    worker.work(burst=True)
    positions = [i for i, j in enumerate(log.order) if j == long_job]
    assert len(positions) == 20
    gaps = np.diff(positions)
    # between two of its chunks: the other resident jobs' turns and one admission
    assert gaps.max() <= max_active + 1, f"the long job waited {gaps.max()} chunks"
    assert client.status(long_job).state == JobState.FINISHED
    assert all(client.status(s).state == JobState.FINISHED for s in shorts)


def test_priority_orders_admission(setup, on_chunk):
    worker, client = setup(max_active=1)
    low = client.submit(tokens=ids(48, 8), model=MODEL, priority=0)
    urgent = client.submit(tokens=ids(48, 9), model=MODEL, priority=5)
    lowest = client.submit(tokens=ids(48, 10), model=MODEL, priority=-1)
    log = on_chunk()
    worker.work(burst=True)
    assert log.order == [urgent] * 3 + [low] * 3 + [lowest] * 3


# -- failures ------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint_every, resumed_from", [("none", None), ("1", 16)])
def test_failed_chunk_is_retried_from_its_last_checkpoint_else_zero(
        setup, on_chunk, tiny, checkpoint_every, resumed_from):
    worker, client = setup(checkpoint_every=checkpoint_every)
    token_ids = ids(100, 11)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=5)

    def poison_once(job_id, chunk_no):
        if chunk_no == 2 and client.status(job).attempts == 1:
            worker.active[job_id].prefill.cache.poison()  # the next chunk raises

    on_chunk(poison_once)
    worker.work(burst=True)
    status = client.status(job)
    assert (status.state, status.attempts, status.cursor) == (JobState.FINISHED, 2, 100)
    # the checkpoint after chunk 1 (cursor 16) was good; chunk 2's cache was poisoned
    start = resumed_from or 0
    assert status.resumed_from == resumed_from
    assert status.chunks_done == -(-(100 - start) // CHUNK)
    assert_logits_match(client.result(job, timeout=0), tiny, token_ids)


def test_failed_chunks_exhaust_max_attempts(setup, on_chunk):
    worker, client = setup()
    job = client.submit(tokens=ids(100, 12), model=MODEL, max_attempts=2)
    bystander = client.submit(tokens=ids(40, 13), model=MODEL)

    def always_poison(job_id, chunk_no):
        if job_id == job:
            worker.active[job_id].prefill.cache.poison()

    on_chunk(always_poison)
    worker.work(burst=True)
    with pytest.raises(JobFailed) as failed:
        client.result(job, timeout=0)
    assert failed.value.error_type == "ModelError"
    assert "CachePoisoned" in failed.value.message
    assert client.status(job).attempts == 2
    assert client.status(bystander).state == JobState.FINISHED


def test_token_ids_outside_the_vocab_fail_at_submit(setup):
    from jobs import TokenOutOfRange

    _, client = setup()
    with pytest.raises(TokenOutOfRange):
        client.submit(tokens=[2, 10_000], model=MODEL)


def test_kv_budget_admits_only_what_fits(setup, on_chunk, tiny):
    a_ids, b_ids = ids(100, 14), ids(100, 15)
    one_job = tiny.start_prefill(a_ids).cache.nbytes
    worker, client = setup(kv_budget_bytes=one_job + one_job // 2)
    a = client.submit(tokens=a_ids, model=MODEL)
    b = client.submit(tokens=b_ids, model=MODEL)
    log = on_chunk()
    worker.work(burst=True)
    assert log.order == [a] * 7 + [b] * 7, "b waited for a's KV cache to be released"
    assert client.status(b).attempts == 1, "waiting for room is not a restart"


def test_steps_of_several_jobs_keep_turn_order_and_exact_logits(setup, on_chunk, tiny):
    worker, client = setup(max_batch_jobs=3)
    token_ids = [ids(n, 40 + s) for s, n in enumerate((80, 64, 48))]
    a, b, c = jobs = [client.submit(tokens=t, model=MODEL, top_k=3) for t in token_ids]
    in_flight = []

    def others_launched(job_id, chunk_no):  # the first step of all three, at a's chunk
        if job_id == a and chunk_no == 2:
            in_flight.extend(worker.active[j].prefill.launched for j in (b, c))

    log = on_chunk(others_launched)
    worker.work(burst=True)
    assert in_flight == [True, True], "b's and c's chunks run in a's step"
    assert log.order == [a, b, c] * 3 + [a, b] + [a]  # the turn order of one-job steps
    for job, t in zip(jobs, token_ids, strict=True):
        assert_logits_match(client.result(job, timeout=0), tiny, t)
