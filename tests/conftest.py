"""Shared fixtures: the real Gemma 3 270M model (loaded once per session) and its reference data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.redis_server import RedisServer

DATA = Path(__file__).parent / "data"

# `server` (a redis-server with AOF per test) and `workers` (worker processes on it), for
# the integration and reliability suites
pytest_plugins = ["tests.integration.processes"]


@pytest.fixture(scope="session")
def reference_cases() -> list[dict]:
    """llama.cpp's token ids and top-10 final logits for Gemma 3 270M (tests/data)."""
    return json.loads((DATA / "gemma3-270m-llamacpp.json").read_text())["cases"]


@pytest.fixture(scope="session")
def gemma():
    """The real Gemma 3 270M Q4_K_M model, float32 on CPU (a `model.registry.LoadedModel`)."""
    from model.registry import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real ``redis-server`` for this test session (persistence off); yields its URL.

    Errors (does not skip) when the binary is missing: CI installs it.
    """
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture
def connect(redis_server):
    """A connection factory to the session's real redis-server, flushed for this test."""
    import redis

    redis.Redis.from_url(redis_server).flushall()
    return lambda: redis.Redis.from_url(redis_server)


@pytest.fixture
def anyio_backend():
    """The event loop of ``pytest.mark.anyio`` tests: asyncio, as the clients use."""
    return "asyncio"


@pytest.fixture(params=["fakeredis", "redis"])
def redis_conn(request):
    """A clean connection factory: fakeredis (with Lua) or the real server, per test.

    Returns a zero-argument callable giving a new connection to the same server, so a
    test can have a worker, a client and a watcher on separate connections.
    """
    if request.param == "fakeredis":
        import fakeredis

        server = fakeredis.FakeServer()

        def connect():
            return fakeredis.FakeStrictRedis(server=server)
    else:
        import redis

        url = request.getfixturevalue("redis_server")

        def connect():
            return redis.Redis.from_url(url)

    connect().flushall()
    return connect


@pytest.fixture(autouse=True)
def _signal_handlers():
    """SIGINT and SIGTERM handled as before each test: an RQ worker run in this process
    (``work(burst=True)``) installs its own, which only ask that worker to stop, so a
    Ctrl-C or a ``timeout`` would no longer stop pytest."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="session", autouse=True)
def _model_cache_dir(tmp_path_factory):
    """Generated test models go to a per-session folder (worker subprocesses inherit it)."""
    import os

    from model.gguf.store import CACHE_DIR_ENV

    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny():
    """The tiny random-weight Gemma 3 (`gemma3-tiny`: 64 wide, 16-token window)."""
    from model.registry import load_model

    return load_model("gemma3-tiny")
