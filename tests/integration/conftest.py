"""Integration fixtures: a real redis-server with AOF per test, and worker processes on it."""

from __future__ import annotations

import pytest

from tests.conftest import RedisServer

from .processes import WorkerProcess


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path, appendonly=True).start()
    yield srv
    srv.stop()


@pytest.fixture
def workers(server, tmp_path):
    started = []

    def start(name: str, *extra: str) -> WorkerProcess:
        w = WorkerProcess(server.url, name, tmp_path, *extra)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()
