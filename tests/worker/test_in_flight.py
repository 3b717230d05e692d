"""A chunk launched and not yet stepped when its job ends never reaches a slot, a checkpoint
or a result.

A worker launches the next step's chunks on the device before the round trip of the step
that ran (`Stepper.run`). These tests end a job while its chunk is in flight,
deterministically: run a step of Y (its next chunk is launched), act on Y, then run a step
of X, whose round trip reads Y's cancel flag. The tiny Gemma 3 has a 16-token window and
runs 16-token chunks, so a launched chunk rewrites the whole ring of every sliding layer.
"""

from __future__ import annotations

import numpy as np

from jobs import JobState

from .helpers import MODEL, ids

HISTORY = ids(200, 7)
# A turn from the kept slot against a one-pass prefill measures 4e-7 to 8e-7 x max|logit|
# in float32; a slot that kept the launched chunk's ring rows measured 1.2e-2 to 1.7e-2.
CLOSE = 2e-6


def relative_diff(result, tiny, token_ids) -> float:
    expected = tiny.start_prefill(token_ids).run()
    assert [t.id for t in result.top_k] == np.argsort(-expected)[: len(result.top_k)].tolist()
    diff = max(abs(t.logit - expected[t.id]) for t in result.top_k)
    return diff / float(np.abs(expected).max())


def run_a_step(worker) -> None:
    worker.stepper.run(worker.prefill_scheduler.take_turn())


def admit_and_step(worker, job: str):
    """Admit `job` and run its first step: its next chunk is launched. Returns its prefill."""
    worker.advance(job)
    run_a_step(worker)
    prefill = worker.active[job].prefill
    assert prefill.launched and prefill.cache.in_flight == 16
    return prefill


def launch_and_cancel(worker, client, job: str) -> None:
    """Run a step of `job` (its next chunk is launched), cancel it, and run a step of another
    job, whose round trip brings the cancel back: `job` is dropped with its chunk in flight."""
    prefill = admit_and_step(worker, job)
    client.cancel(job)
    other = client.submit(tokens=ids(40, 3), model=MODEL, top_k=3)
    worker.advance(other)
    run_a_step(worker)  # the new job's first turn comes first
    assert job not in worker.active and client.status(job).state == JobState.CANCELED
    assert not prefill.launched and prefill.cache.in_flight == 0


def test_a_session_turn_canceled_with_a_chunk_in_flight_leaves_its_last_commit(setup, tiny):
    # one-job steps: the other job's step runs while the turn's chunk stays in flight
    worker, client = setup(max_active=3, max_batch_jobs=1)
    first = client.submit(tokens=HISTORY, model=MODEL, top_k=3, session="chat")
    worker.work(burst=True, logging_level="WARNING")
    second_ids = HISTORY + ids(81, 12)[1:]
    second = client.submit(tokens=second_ids, model=MODEL, top_k=3, session="chat")
    launch_and_cancel(worker, client, second)
    worker.work(burst=True, logging_level="WARNING")  # the other job; stray executions
    stopped = client.status(second)
    assert stopped.cursor == 216  # the live 200, then one committed 16-token chunk
    third_ids = second_ids + ids(21, 13)[1:]
    third = client.submit(tokens=third_ids, model=MODEL, top_k=3, session="chat")
    worker.work(burst=True, logging_level="WARNING")
    result = client.result(third, timeout=0)
    assert client.result(first, timeout=0).reuse == "cold"
    assert (result.reuse, result.cached_tokens) == ("live", 216)
    assert relative_diff(result, tiny, third_ids) <= CLOSE


def test_a_plain_job_canceled_with_a_chunk_in_flight_leaves_nothing_behind(setup, tiny):
    worker, client = setup(max_active=3)
    job = client.submit(tokens=ids(100, 5), model=MODEL, top_k=3)
    launch_and_cancel(worker, client, job)
    worker.work(burst=True, logging_level="WARNING")
    assert client.status(job).state == JobState.CANCELED
    assert worker.active == {}


def test_a_prompt_logprobs_job_canceled_with_a_chunk_in_flight(setup, tiny):
    worker, client = setup(max_active=3)
    job = client.submit(tokens=ids(100, 5), model=MODEL, top_k=3, prompt_logprobs=2)
    launch_and_cancel(worker, client, job)
    worker.work(burst=True, logging_level="WARNING")
    assert client.status(job).state == JobState.CANCELED


def test_a_session_turn_handed_back_with_a_chunk_in_flight_keeps_its_last_commit(setup, tiny):
    """SIGTERM's hand-back: the slot stays here at the last committed chunk, and the
    restarted turn's logits equal a cold prefill's."""
    worker, client = setup(max_active=3)
    client.submit(tokens=HISTORY, model=MODEL, top_k=3, session="chat")
    worker.work(burst=True, logging_level="WARNING")
    second_ids = HISTORY + ids(81, 12)[1:]
    second = client.submit(tokens=second_ids, model=MODEL, top_k=3, session="chat")
    admit_and_step(worker, second)
    slot = worker.active[second].slot
    worker.hand_back_active()
    assert slot.cache.in_flight == 0 and slot.cache.position == len(slot.committed) == 216
    worker.work(burst=True, logging_level="WARNING")  # the handed-back turn, from the slot
    result = client.result(second, timeout=0)
    assert (result.reuse, result.cached_tokens) == ("live", 216)
    assert relative_diff(result, tiny, second_ids) <= CLOSE


def test_a_checkpointed_job_handed_back_with_a_chunk_in_flight_resumes_exactly(setup, tiny):
    """The hand-back steps the launched chunk (the job lives on), checkpoints at its end,
    and the restart resumes there with the logits of a cold prefill."""
    worker, client = setup(max_active=3, checkpoint_every="1")
    token_ids = ids(100, 5)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3)
    admit_and_step(worker, job)
    worker.hand_back_active()
    assert client.status(job).state == JobState.QUEUED
    worker.work(burst=True, logging_level="WARNING")
    result = client.result(job, timeout=0)
    assert client.status(job).resumed_from == 32  # the first chunk and the launched one
    assert relative_diff(result, tiny, token_ids) <= CLOSE
