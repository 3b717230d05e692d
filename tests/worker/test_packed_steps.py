"""Steps of several jobs through a real worker (`Stepper.run` with ``max_batch_jobs`` > 1):
one Redis round trip per step, jobs of mixed lengths, a cancel inside a step, a session turn
and a prompt-logprobs job sharing steps with others; every job gets the logits it gets alone.
"""

from __future__ import annotations

import numpy as np

from jobs import JobState, keys

from .helpers import MODEL, CountingConnection, assert_logits_match, ids


def launched_beside(worker, on_chunk, job: str, others: list[str]) -> list[bool]:
    """Once `job`'s first chunk landed, whether each of `others` has a chunk in flight: in
    `job`'s forward pass, not landed yet (filled in as the worker runs)."""
    beside: list[bool] = []

    def at_first_chunk(job_id, chunk_no):
        if job_id == job and chunk_no == 1:
            beside.extend(worker.active[j].prefill.launched for j in others)

    on_chunk(at_first_chunk)
    return beside


def round_trips_of_a_step(worker) -> tuple[int, tuple[str, ...]]:
    """Run the step whose turn it is; returns the requests it sent and its jobs."""
    step = worker.prefill_scheduler.take_turn()
    before = CountingConnection.sent
    worker.stepper.run(step)
    return CountingConnection.sent - before, tuple(a.job_id for a in step.jobs)


def test_a_step_of_several_jobs_costs_one_round_trip_also_when_jobs_end(counted, tiny):
    """The jobs a step's scripts end leave the worker's held jobs, and are counted, in the
    next round trip (`Departures`): every step costs one; the last ones' when it idles."""
    worker, client = counted(max_batch_jobs=4, max_active=4)
    client.submit(tokens=ids(40, 59), model=MODEL)  # loads the scripts into the server
    worker.work(burst=True, logging_level="WARNING")
    lengths = (40, 33, 64, 20)  # 3, 3, 4 and 2 chunks of 16
    token_ids = [ids(n, 60 + i) for i, n in enumerate(lengths)]
    jobs = [client.submit(tokens=t, model=MODEL, top_k=3) for t in token_ids]
    for job in jobs:
        worker.advance(job)
    assert round_trips_of_a_step(worker) == (1, tuple(jobs))  # every job's first chunk
    held = keys.worker_jobs(worker.name)
    finished = int(worker.connection.hget(keys.STATS, "finished") or 0)
    # second chunks: the 20-token job ends in its publish
    assert round_trips_of_a_step(worker) == (1, tuple(jobs))
    assert client.status(jobs[3]).state == JobState.FINISHED
    assert [client.status(j).cursor for j in jobs[:3]] == [32, 32, 32]
    assert worker.connection.sismember(held, jobs[3])  # forgotten by the next round trip
    assert round_trips_of_a_step(worker) == (1, tuple(jobs[:3]))  # 40 and 33 end
    assert not worker.connection.sismember(held, jobs[3])
    assert int(worker.connection.hget(keys.STATS, "finished")) == finished + 1
    assert round_trips_of_a_step(worker) == (1, (jobs[2],))
    assert worker.active == {}
    assert worker.connection.smembers(held) == {jobs[2].encode()}  # the last step's
    worker.stepper.forget_departed()  # what an idle worker does before it waits
    assert worker.connection.smembers(held) == set()
    assert int(worker.connection.hget(keys.STATS, "finished")) == finished + 4
    for job, t in zip(jobs, token_ids, strict=True):
        assert_logits_match(client.result(job, timeout=0), tiny, t)


def test_jobs_of_mixed_lengths_share_steps_and_keep_the_wait_bound(setup, on_chunk, tiny):
    """Short jobs arriving behind long ones run in the next step, beside them."""
    worker, client = setup(max_batch_jobs=4, max_active=6)
    longs = [client.submit(tokens=ids(160, s), model=MODEL, top_k=3) for s in (1, 2)]
    shorts: list[str] = []
    short_ids = [ids(n, 10 + n) for n in (7, 16, 30, 12)]
    arrived = []

    def shorts_arrive(job_id, chunk_no):
        if job_id == longs[1] and chunk_no == 2 and not shorts:
            shorts.extend(client.submit(tokens=t, model=MODEL, top_k=3) for t in short_ids)
            arrived.append(len(log.order))

    log = on_chunk(shorts_arrive)
    worker.work(burst=True)
    # the step in progress when they arrived, then one step of all four new jobs
    first = min(log.order.index(j) for j in shorts)
    assert first - arrived[0] <= 2  # the rest of the step in progress: longs[1]'s chunk
    assert log.order[first:first + 4] == shorts
    for job, t in zip(shorts, short_ids, strict=True):
        assert_logits_match(client.result(job, timeout=0), tiny, t)
    for job, seed in zip(longs, (1, 2), strict=True):
        assert_logits_match(client.result(job, timeout=0), tiny, ids(160, seed))


def test_a_job_canceled_inside_a_step_runs_no_further_chunk(setup, on_chunk, tiny):
    """b is canceled while its chunk is in the step's forward pass: the step's round trip
    records that chunk and ends b, its next chunk (launched before the round trip) is
    abandoned, and the other jobs of the step finish with their logits alone."""
    worker, client = setup(max_batch_jobs=3)
    token_ids = [ids(n, 70 + n) for n in (64, 64, 48)]
    a, b, c = [client.submit(tokens=t, model=MODEL, top_k=3) for t in token_ids]
    prefills = {}

    def cancel_b_in_the_first_step(job_id, chunk_no):
        if job_id == a and chunk_no == 1:
            prefills["b"] = worker.active[b].prefill
            assert prefills["b"].launched  # in a's forward pass, not landed yet
            client.cancel(b)

    log = on_chunk(cancel_b_in_the_first_step)
    worker.work(burst=True)
    assert log.order.count(b) == 1  # the chunk it was in; no step after
    status = client.status(b)
    assert (status.state, status.cursor, status.chunks_done) == (JobState.CANCELED, 16, 1)
    assert not prefills["b"].launched and prefills["b"].cache.in_flight == 0
    for job, t in ((a, token_ids[0]), (c, token_ids[2])):
        assert_logits_match(client.result(job, timeout=0), tiny, t)


def test_a_session_turn_shares_steps_and_reuses_its_slot_exactly(setup, on_chunk, tiny):
    worker, client = setup(max_batch_jobs=3, max_active=3)
    history = ids(200, 5)  # a prefix long enough to be reused (not run cold again)
    first = client.submit(tokens=history, model=MODEL, top_k=3, session="chat")
    others = [client.submit(tokens=ids(50, s), model=MODEL, top_k=3) for s in (6, 7)]
    worker.work(burst=True, logging_level="WARNING")
    turn_ids = history + ids(41, 8)[1:]
    turn = client.submit(tokens=turn_ids, model=MODEL, top_k=3, session="chat")
    more = [client.submit(tokens=ids(45, s), model=MODEL, top_k=3) for s in (9, 10)]
    beside = launched_beside(worker, on_chunk, turn, more)
    worker.work(burst=True)
    assert beside == [True, True]
    result = client.result(turn, timeout=0)
    assert (result.reuse, result.cached_tokens) == ("live", 200)
    assert_logits_match(result, tiny, turn_ids)
    assert_logits_match(client.result(first, timeout=0), tiny, history)
    for job, seed in zip(others + more, (6, 7, 9, 10), strict=True):
        assert_logits_match(client.result(job, timeout=0), tiny,
                            ids(50 if seed < 9 else 45, seed))


def test_a_prompt_logprobs_job_in_a_step_gets_the_logprobs_it_gets_alone(setup, on_chunk,
                                                                          tiny):
    worker, client = setup(max_batch_jobs=3)
    token_ids = ids(50, 11)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3, prompt_logprobs=2)
    others = [client.submit(tokens=ids(40, s), model=MODEL, top_k=3) for s in (12, 13)]
    beside = launched_beside(worker, on_chunk, job, others)
    worker.work(burst=True)
    assert beside == [True, True]
    result = client.result(job, timeout=0)
    alone = tiny.start_prefill(token_ids, prompt_logprobs=2)
    logits = alone.run()
    assert_logits_match(result, tiny, token_ids)
    entries, n, lp = result.prompt_logprobs, len(token_ids), alone.logprobs
    scale = float(np.abs(logits).max())
    got = np.array([e["logprob"] for e in entries[1:n]])
    # measured 1.0e-6 (three float32 ulps of a logprob near -6: the packed matmuls round
    # differently; tests/model/test_packed.py bounds the packed pass at 3e-6)
    assert float(np.abs(got - lp.token_logprob[1:n]).max()) <= 3e-6 * scale
    assert [[t["id"] for t in e["top"]] for e in entries[1:]] == lp.top_ids[1:].tolist()
    for other, seed in zip(others, (12, 13), strict=True):
        assert_logits_match(client.result(other, timeout=0), tiny, ids(40, seed))


def test_an_error_building_a_packed_step_hands_back_every_job_of_it(setup, tiny, monkeypatch):
    """An error building a step's packed pass poisons every cache of the step (rows may be
    half written), so each of its jobs is handed back with a ``ModelError`` failure counted,
    runs again from cursor 0, and finishes once with the logits it gets alone."""
    import model.prefill

    built = model.prefill.launch_packed
    packed: list[int] = []

    def fails_first(model_, caches, *args, **kwargs):
        packed.append(len(caches))
        if len(packed) == 1:
            raise RuntimeError("injected: the packed pass did not build")
        return built(model_, caches, *args, **kwargs)

    monkeypatch.setattr(model.prefill, "launch_packed", fails_first)
    worker, client = setup(max_batch_jobs=3)
    token_ids = [ids(n, 80 + n) for n in (40, 33, 20)]
    jobs = [client.submit(tokens=t, model=MODEL, top_k=3) for t in token_ids]
    worker.work(burst=True)
    assert packed[0] == 3 and len(packed) > 1  # the three jobs' step, then their retries
    for job, t in zip(jobs, token_ids, strict=True):
        status = client.status(job)
        assert (status.state, status.attempts) == (JobState.FINISHED, 2)
        assert_logits_match(client.result(job, timeout=0), tiny, t)
    assert int(worker.connection.hget(keys.STATS, "finished")) == 3
    assert worker.active == {} and not worker.connection.smembers(keys.worker_jobs("w1"))
