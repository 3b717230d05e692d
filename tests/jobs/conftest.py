"""Fixtures of the client tests: a registered in-process worker on the tiny Gemma 3."""

from __future__ import annotations

import pytest

from tests.worker.helpers import CHUNK, MODEL
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker


@pytest.fixture
def worker(connect, tiny):
    """A worker serving the tiny Gemma 3 in `CHUNK`-token chunks on `connect`'s server,
    its model registered (run it in burst mode to do the work)."""
    w = PrefillWorker({MODEL: tiny}, connect(), WorkerSettings(chunk_tokens=CHUNK), name="w1")
    w.register_models()
    return w
