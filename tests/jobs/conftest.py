"""Fixtures of the client tests: a registered in-process worker on the tiny Gemma 3."""

from __future__ import annotations

import pytest

from tests.worker.helpers import CHUNK, MODEL
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker


@pytest.fixture
def worker(connect, tiny):
    """A worker serving the tiny Gemma 3 in `CHUNK`-token chunks on `connect`'s server,
    its model registered (run it in burst mode to do the work), one job a step: these tests
    compare jobs' results bitwise, and the jobs of a packed step differ in their last bits
    (their rows' places in the matmuls)."""
    w = PrefillWorker({MODEL: tiny}, connect(),
                      WorkerSettings(chunk_tokens=CHUNK, max_batch_jobs=1), name="w1")
    w.register_models()
    return w
