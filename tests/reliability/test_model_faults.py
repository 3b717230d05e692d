"""A chunk that raises inside the model (`worker.faults` ``raise_in_chunk``), in a worker
process on a real redis-server: the job goes back to intake with one more failure, resumes
from its latest KV checkpoint and finishes exact; a chunk that always raises ends the job
``failed`` (``ModelError``, the error's message) after ``max_attempts``; the worker serves on.
"""

from __future__ import annotations

import numpy as np
import pytest

from jobs import JobFailed, JobState, PrefillClient, keys
from tests.integration.processes import MODEL, expected_top, ids

# 40 tokens in 10 chunks of 4: its second chunk raises in attempts 1 and 2
FLAKY = 40
# 24 tokens: its first chunk raises in every attempt
BROKEN = 24
PLAN = f"raise_in_chunk:tokens={FLAKY}:chunk=2:attempts=1,2;raise_in_chunk:tokens={BROKEN}"


def assert_exact(result, tiny, token_ids) -> None:
    top, logits = expected_top(tiny, token_ids, 5)
    assert [t.id for t in result.top_k] == top
    got = np.frombuffer(result.logits, dtype=np.float32)
    assert got.shape == logits.shape
    assert np.abs(got - logits).max() <= 1e-3 * np.abs(logits).max()


def test_a_raising_chunk_is_retried_then_succeeds_or_fails_after_max_attempts(
        server, workers, events, tiny):
    client = PrefillClient.from_url(server.url)
    w1 = workers("w1", "--checkpoint-every", "1", faults=PLAN)
    flaky_ids, broken_ids, clean_ids = ids(FLAKY, 41), ids(BROKEN, 42), ids(30, 43)
    flaky = client.submit(tokens=flaky_ids, model=MODEL, top_k=5, logits="full")
    broken = client.submit(tokens=broken_ids, model=MODEL, top_k=5)
    clean = client.submit(tokens=clean_ids, model=MODEL, top_k=5, logits="full")

    assert_exact(client.result(flaky, timeout=120), tiny, flaky_ids)
    status = client.status(flaky)
    assert (status.state, status.attempts) == (JobState.FINISHED, 3)
    # attempt 1 checkpointed chunk 1 (cursor 4), attempt 2 resumed there and checkpointed
    # its first chunk (cursor 8) before its second raised: attempt 3 resumed at 8
    assert status.resumed_from == 8
    assert client.redis.hget(keys.job(flaky), "failures") == b"2"

    with pytest.raises(JobFailed) as failed:
        client.result(broken, timeout=120)
    assert failed.value.error_type == "ModelError"
    assert failed.value.message == f"InjectedFault: injected fault in chunk 1 of job {broken}"
    status = client.status(broken)
    assert (status.state, status.attempts) == (JobState.FAILED, 3)
    assert client.redis.exists(keys.logits(broken)) == 0

    assert_exact(client.result(clean, timeout=120), tiny, clean_ids)
    assert client.status(clean).attempts == 1
    events.settle()
    assert [events.count(j, "finished") for j in (flaky, broken, clean)] == [1, 0, 1]
    assert events.count(broken, "failed") == 1
    assert events.count(flaky, "queued") == 2  # handed back after each raising chunk
    log = w1.text()
    assert log.count(f"fault: job {flaky} raises in chunk 2") == 2
    assert log.count(f"fault: job {broken} raises in chunk 1") == 3
    assert w1.proc.poll() is None
