"""Reliability fixtures:

- the tiny Gemma 3 served with a 64-token context, and a worker + client pair on it over
  `redis_conn` (fakeredis and the real redis-server): `tiny64`, `stack`;
- a real redis-server (AOF on) per test, worker processes on it (the tiny Gemma 3, 4-token
  chunks, 2 s heartbeat TTL: `tests.integration.processes`) that may carry a fault plan
  (`worker.faults`), and a log of every job event published: `server`, `workers`, `events`.
"""

from __future__ import annotations

import pytest

from jobs import Limits, PrefillClient
from tests.integration.processes import WorkerProcess
from worker.faults import FAULTS_ENV
from worker.redis_server import RedisServer
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
        worker = PrefillWorker({MODEL: tiny64}, redis_conn(), name=options.pop("name", "w1"),
                               publish_tokenizers=False, limits=worker_limits, **options)
        worker.register_models()
        return worker, PrefillClient(redis_conn(), limits=client_limits or Limits())

    return make


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path, appendonly=True).start()
    yield srv
    srv.stop()


@pytest.fixture
def workers(server, tmp_path):
    """``start(name, *args, faults=None, url=None)``: a worker process on `server` (or on
    `url`), with ``$PREFILLQ_FAULTS`` set to `faults` when given; all are killed at the end."""
    started = []

    def start(name: str, *extra: str, faults: str | None = None,
              url: str | None = None) -> WorkerProcess:
        env = None if faults is None else {FAULTS_ENV: faults}
        w = WorkerProcess(url or server.url, name, tmp_path, *extra, env=env)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def events(server):
    log = EventLog(server.url)
    yield log
    log.close()
