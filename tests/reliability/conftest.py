"""Reliability fixtures: a real redis-server (AOF on) per test, worker processes on it (the
tiny Gemma 3, 4-token chunks, 2 s heartbeat TTL: `tests.integration.processes`) that may
carry a fault plan (`worker.faults`), and a log of every job event published."""

from __future__ import annotations

import pytest

from tests.integration.processes import WorkerProcess
from worker.faults import FAULTS_ENV
from worker.redis_server import RedisServer

from .events import EventLog


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
