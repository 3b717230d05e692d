"""Worker fixtures: the chunk-line hook and a worker + client pair on the tiny Gemma 3.

Actions "between chunks" are taken deterministically by `OnChunk`, a logging handler on the
worker's per-chunk INFO line: it runs in the worker's thread right after a chunk computed,
before the worker records it.
"""

from __future__ import annotations

import logging

import fakeredis
import pytest
import redis

from jobs import PrefillClient
from jobs.queues import own_queue
from worker.checkpoints.store import FileStore, RedisStore
from worker.scheduler import Scheduler
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

from .helpers import CHUNK, MODEL, CountingConnection, OnChunk


@pytest.fixture
def on_chunk():
    logger = logging.getLogger("prefillq.worker")
    handlers = []

    def install(action=None) -> OnChunk:
        handler = OnChunk(action)
        logger.addHandler(handler)
        handlers.append(handler)
        return handler

    previous = logger.level
    logger.setLevel(logging.INFO)
    yield install
    for handler in handlers:
        logger.removeHandler(handler)
    logger.setLevel(previous)


@pytest.fixture
def setup(redis_conn, tiny):
    def make(**kwargs) -> tuple[PrefillWorker, PrefillClient]:
        name = kwargs.pop("name", "w1")
        worker = PrefillWorker({MODEL: tiny}, redis_conn(),
                               WorkerSettings(chunk_tokens=kwargs.pop("chunk_tokens", CHUNK),
                                              **kwargs), name=name)
        worker.register_models()
        return worker, PrefillClient(redis_conn())

    return make


@pytest.fixture(params=["file", "fakeredis", "redis"])
def store(request, tmp_path):
    """A checkpoint store: a directory, fakeredis, or the real redis-server (flushed)."""
    if request.param == "file":
        return FileStore(tmp_path / "ckpt")
    if request.param == "fakeredis":
        return RedisStore(fakeredis.FakeStrictRedis(server=fakeredis.FakeServer()))
    connection = redis.Redis.from_url(request.getfixturevalue("redis_server"))
    connection.flushall()
    return RedisStore(connection)


@pytest.fixture
def counted(redis_server, tiny):
    """``make(**settings) -> (worker, client)`` on a flushed real redis-server, the worker's
    requests counted (`helpers.CountingConnection`); a heartbeat TTL far above any test, so
    no intake priorities are re-read inside what a test counts."""

    def make(**settings) -> tuple[PrefillWorker, PrefillClient]:
        redis.Redis.from_url(redis_server).flushall()
        worker = PrefillWorker(
            {MODEL: tiny},
            redis.Redis.from_url(redis_server, connection_class=CountingConnection),
            WorkerSettings(chunk_tokens=16, heartbeat_ttl_s=3600, **settings), name="w1")
        worker.register_models()
        return worker, PrefillClient(redis.Redis.from_url(redis_server))

    return make


@pytest.fixture
def make(tiny):
    """``make(**options)``: a `worker.scheduler.Scheduler` of the tiny model on fakeredis,
    with worker ``w1``'s own queue."""
    def make_scheduler(**options) -> Scheduler:
        conn = fakeredis.FakeStrictRedis()
        return Scheduler(conn, [MODEL], own_queue(conn, "w1"), **options)

    return make_scheduler
