"""Sessions through the worker: a session's next job reuses the slot its last job left on
this worker, and every result equals a cold prefill of the same prompt.

The tiny Gemma 3 (16-token window, 16-token chunks) keeps these fast; the real model's
three-turn chat is in tests/integration/test_sessions.py. Prompts keep the reused prefix at
128 tokens or more so the seeds' rule (a suffix over 32 with a prefix under 128 runs cold)
never turns a reuse into a reset here.
"""

from __future__ import annotations

from jobs import JobState, keys
from jobs.queues import job_id_of, own_queue

from .helpers import MODEL, assert_logits_match, ids

HISTORY = ids(200, 7)


def turn(client, worker, token_ids, session="chat", **submit):
    job = client.submit(tokens=token_ids, model=MODEL, top_k=3, session=session, **submit)
    worker.work(burst=True, logging_level="WARNING")
    return job, client.result(job, timeout=0)


def test_a_follow_up_prefills_only_what_it_adds(setup, tiny):
    worker, client = setup()
    first, result = turn(client, worker, HISTORY)
    assert (result.cached_tokens, result.reuse) == (0, "cold")
    follow_ids = HISTORY + ids(41, 8)[1:]
    job, result = turn(client, worker, follow_ids)
    assert (result.cached_tokens, result.reuse) == (200, "live")
    # 40 new tokens in 16-token chunks from the cursor: 216, 232 (the recovery position), 240
    assert result.chunks_done == 3
    assert_logits_match(result, tiny, follow_ids)
    status = client.status(job)
    assert (status.cached_tokens, status.reuse, status.cursor) == (200, "live", 240)


def test_an_exact_repeat_runs_no_forward_pass(setup, tiny):
    worker, client = setup()
    turn(client, worker, HISTORY)
    _, result = turn(client, worker, HISTORY)
    assert (result.reuse, result.cached_tokens, result.chunks_done) == ("exact", 200, 0)
    assert_logits_match(result, tiny, HISTORY)


def test_a_rewritten_tail_restores_the_turn_anchor(setup, tiny):
    worker, client = setup()
    turn(client, worker, HISTORY)
    rewritten = HISTORY[:-3] + [300, 301, 302, 303, 304]  # the last 3 tokens differ
    _, result = turn(client, worker, rewritten)
    assert (result.reuse, result.cached_tokens) == ("recovery-anchor", 192)
    assert_logits_match(result, tiny, rewritten)


def test_two_sessions_on_one_worker_never_see_each_others_tokens(setup, tiny):
    worker, client = setup(max_active=2)
    other_history = ids(180, 9)
    turn(client, worker, HISTORY, session="a")
    turn(client, worker, other_history, session="b")
    a_ids, b_ids = HISTORY + ids(50, 10)[1:], other_history + ids(60, 11)[1:]
    a = client.submit(tokens=a_ids, model=MODEL, top_k=3, session="a")
    b = client.submit(tokens=b_ids, model=MODEL, top_k=3, session="b")
    worker.work(burst=True, logging_level="WARNING")  # their chunks interleave
    for job, token_ids, cached in ((a, a_ids, 200), (b, b_ids, 180)):
        result = client.result(job, timeout=0)
        assert (result.reuse, result.cached_tokens) == ("live", cached)
        assert_logits_match(result, tiny, token_ids)


def test_a_canceled_turn_leaves_its_slot_consistent(setup, tiny, on_chunk):
    worker, client = setup()
    turn(client, worker, HISTORY)
    second_ids = HISTORY + ids(81, 12)[1:]
    job = client.submit(tokens=second_ids, model=MODEL, top_k=3, session="chat")
    on_chunk(lambda job_id, n: job_id == job and n == 2 and client.cancel(job_id))
    worker.work(burst=True, logging_level="WARNING")
    stopped = client.status(job)
    assert stopped.state == JobState.CANCELED and 200 < stopped.cursor < 280
    third_ids = second_ids + ids(21, 13)[1:]
    _, result = turn(client, worker, third_ids)
    # the slot kept what the canceled turn committed: its live prefix
    assert (result.reuse, result.cached_tokens) == ("live", stopped.cursor)
    assert_logits_match(result, tiny, third_ids)


def test_the_least_recently_used_session_is_evicted(setup, tiny):
    worker, client = setup(session_slots=1, checkpoint_every="none")  # no slot checkpoints
    turn(client, worker, HISTORY, session="a")
    turn(client, worker, ids(150, 14), session="b")  # evicts a
    assert client.redis.get(keys.session_holder("a")) is None
    a_ids = HISTORY + ids(20, 15)[1:]
    _, result = turn(client, worker, a_ids, session="a")
    assert (result.reuse, result.cached_tokens) == ("cold", 0)
    assert_logits_match(result, tiny, a_ids)


def test_a_byte_bound_below_one_slot_keeps_nothing(setup, tiny):
    worker, client = setup(session_bytes=1024, checkpoint_every="none")
    turn(client, worker, HISTORY)
    assert len(worker.sessions) == 0
    _, result = turn(client, worker, HISTORY + [300])
    assert result.reuse == "cold"
    assert_logits_match(result, tiny, HISTORY + [300])


def test_the_next_turn_goes_to_the_worker_that_keeps_the_slot(setup, tiny):
    holder, client = setup(name="w1")
    other, _ = setup(name="w2")
    turn(client, holder, HISTORY)
    holder.register_models()  # alive again (a burst run ends by deregistering)
    assert client.session_holder("chat") == "w1"
    follow_ids = HISTORY + ids(30, 16)[1:]
    job = client.submit(tokens=follow_ids, model=MODEL, top_k=3, session="chat")
    assert [job_id_of(j) for j in own_queue(client.redis, "w1").get_job_ids()] == [job]
    other.work(burst=True, logging_level="WARNING")  # an idle worker leaves it alone
    assert client.status(job).state == JobState.QUEUED
    holder.work(burst=True, logging_level="WARNING")
    result = client.result(job, timeout=0)
    assert (result.reuse, result.cached_tokens) == ("live", 200)


def test_a_stopping_holder_hands_routed_jobs_to_any_worker(setup, tiny):
    holder, client = setup(name="w1", checkpoint_every="none")
    other, _ = setup(name="w2", checkpoint_every="none")
    turn(client, holder, HISTORY)
    holder.register_models()
    follow_ids = HISTORY + ids(30, 17)[1:]
    job = client.submit(tokens=follow_ids, model=MODEL, top_k=3, session="chat")
    assert client.session_holder("chat") == "w1"
    holder.teardown()  # a warm shutdown: its own queue moves to intake, its heartbeat ends
    assert client.session_holder("chat") is None
    other.work(burst=True, logging_level="WARNING")
    result = client.result(job, timeout=0)
    assert (result.reuse, client.status(job).worker) == ("cold", "w2")  # w2 has no slot
    assert_logits_match(result, tiny, follow_ids)


def test_a_worker_keeping_no_sessions_runs_session_jobs_cold(setup, tiny):
    worker, client = setup(session_slots=0)
    turn(client, worker, HISTORY)
    _, result = turn(client, worker, HISTORY + [300, 301])
    assert (result.reuse, result.cached_tokens) == ("cold", 0)
    assert client.redis.get(keys.session_holder("chat")) is None


def test_an_evicted_or_elsewhere_session_resumes_from_its_slot_checkpoint(setup, tiny):
    """A finished turn's slot is checkpointed: a worker without the slot (another worker,
    or this one after evicting it) continues the session from it instead of running cold."""
    first, client = setup(name="w1")
    turn(client, first, HISTORY)
    first.checkpointing.sessions.flush()
    assert client.redis.exists(keys.session_checkpoint("chat", "record"))
    other, _ = setup(name="w2")  # the holder w1 is not alive: intake, then w2
    follow_ids = HISTORY + ids(41, 18)[1:]
    job, result = turn(client, other, follow_ids)
    assert client.status(job).worker == "w2"
    assert (result.reuse, result.cached_tokens) == ("live", 200)
    assert_logits_match(result, tiny, follow_ids)
    other.checkpointing.sessions.flush()
    rewritten = follow_ids[:-3] + [300, 301, 302, 303]
    third, _ = setup(name="w3")
    _, result = turn(client, third, rewritten)  # the anchor of w2's turn, restored on w3
    assert (result.reuse, result.cached_tokens) == ("recovery-anchor", len(follow_ids) - 8)
    assert_logits_match(result, tiny, rewritten)


def test_a_corrupt_slot_checkpoint_runs_cold(setup, tiny):
    first, client = setup(name="w1")
    turn(client, first, HISTORY)
    first.checkpointing.sessions.flush()
    blob_key = keys.session_checkpoint("chat", "blob")
    blob = bytearray(client.redis.get(blob_key))
    blob[len(blob) // 2] ^= 0xFF
    client.redis.set(blob_key, bytes(blob))
    other, _ = setup(name="w2")
    follow_ids = HISTORY + ids(41, 19)[1:]
    _, result = turn(client, other, follow_ids)
    assert (result.reuse, result.cached_tokens) == ("cold", 0)
    assert_logits_match(result, tiny, follow_ids)
