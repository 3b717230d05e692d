"""Reliability fixtures:

- the tiny Gemma 3 served with a 64-token context, and a worker + client pair on it over
  `redis_conn` (fakeredis and the real redis-server): `tiny64`, `stack`;
- a log of every job event published on the real redis-server (AOF on) of `server`:
  `events`. `server` and `workers` (worker processes that may carry a fault plan,
  `worker.faults`) come from `tests.integration.processes`, shared through
  `tests/conftest.py`.
"""

from __future__ import annotations

import pytest

from jobs import Limits, PrefillClient
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

from .events import EventLog
from .helpers import CONTEXT, MODEL


@pytest.fixture(scope="session")
def tiny64():
    """`gemma3-tiny` with its serving context capped at `CONTEXT` tokens, so prompts at,
    one under and one over the context are short."""
    from model.registry import load_model

    return load_model(MODEL, context_length=CONTEXT)


@pytest.fixture
def stack(redis_conn, tiny64):
    """``make(worker_limits=None, client_limits=None, **worker_options) -> (worker,
    client)``: a registered in-process worker (run it with `helpers.work`) and a client,
    on separate connections to a flushed server."""

    def make(worker_limits: Limits | None = None, client_limits: Limits | None = None,
             **options):
        name = options.pop("name", "w1")
        settings = WorkerSettings(publish_tokenizers=False, limits=worker_limits or Limits(),
                                  **options)
        worker = PrefillWorker({MODEL: tiny64}, redis_conn(), settings, name=name)
        worker.register_models()
        return worker, PrefillClient(redis_conn(), limits=client_limits or Limits())

    return make


@pytest.fixture
def events(server):
    log = EventLog(server.url)
    yield log
    log.close()
