"""A stopping worker ends RQ's pubsub thread at once (`PrefillWorker.unsubscribe`): with RQ
3.0's order of calls and redis-py 8.2, a worker told to stop waited up to 60 s for that
thread about half the time."""

from __future__ import annotations

import time

import pytest

from worker.worker import PUBSUB_STOP_S, PrefillWorker


@pytest.mark.parametrize("attempt", range(5))
def test_a_stopping_worker_ends_its_pubsub_thread_at_once(connect, tiny, attempt):
    worker = PrefillWorker({"gemma3-tiny": tiny}, connect(), name=f"w{attempt}")
    worker.subscribe()
    time.sleep(0.02 * attempt)  # the thread at another point of its read each time
    t0 = time.monotonic()
    worker.unsubscribe()
    assert time.monotonic() - t0 < PUBSUB_STOP_S
    assert not worker.pubsub_thread.is_alive()
