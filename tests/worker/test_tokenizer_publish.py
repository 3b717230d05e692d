"""Workers publish their models' tokenizers once under ``keys.tokenizer(sha256)``; both
clients' ``tokenizer(model)`` rebuild them, once per client, with typed errors for an
unknown model, a missing blob and a malformed one. Against the suite's real redis-server
(its command counters show what was sent), on the tiny Gemma 3."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis

from jobs import (
    AsyncPrefillClient,
    PrefillClient,
    ServedTokenizer,
    TokenizerMalformed,
    TokenizerUnavailable,
    UnknownModel,
    keys,
)
from jobs.tokenizer import AsyncTokenizerCache
from tests.conftest import RedisServer
from worker.embedded import embedded_queue
from worker.redis_server import calls_since, command_calls
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

from .helpers import MODEL

TEXT = "<start_of_turn>user\nthe capital of France is<end_of_turn>  \n\n"


@pytest.fixture
def builds(tiny, monkeypatch):
    """Counts the calls of the tiny model's `Tokenizer.published` (building a blob)."""
    calls = []
    published = tiny.tokenizer.published
    monkeypatch.setattr(tiny.tokenizer, "published", lambda: calls.append(1) or published())
    return calls


def worker_on(connect, tiny, name="w1", **kwargs) -> PrefillWorker:
    return PrefillWorker({MODEL: tiny}, connect(), WorkerSettings(**kwargs), name=name)


def assert_tokenizes_like(st: ServedTokenizer, tiny) -> None:
    assert isinstance(st, ServedTokenizer)
    for parse_special in (True, False):
        assert st.encode(TEXT, parse_special=parse_special) == tiny.tokenizer.encode(
            TEXT, parse_special=parse_special)
    assert [st.piece(i) for i in range(tiny.vocab_size)] == [
        tiny.tokenizer.piece(i) for i in range(tiny.vocab_size)]


def test_register_publishes_once_and_rebuilds_never(connect, tiny, builds):
    conn, key = connect(), keys.tokenizer(tiny.sha256)
    worker = worker_on(connect, tiny)
    before = command_calls(conn)
    worker.register_models()
    first = calls_since(conn, before)
    assert first.get("set") == 2  # the tokenizer and the heartbeat
    blob = conn.get(key)
    assert len(blob) > 1000 and conn.ttl(key) == -1  # no TTL, like keys.MODELS
    before = command_calls(conn)
    worker.register_models()  # what every beat does
    again = calls_since(conn, before)
    assert again.get("set") == 1 and again.get("exists") == 1  # the heartbeat only
    worker_on(connect, tiny, name="w2").register_models()  # a second worker finds it there
    assert builds == [1] and conn.get(key) == blob

    conn.flushall()  # Redis lost its data: the next beat restores it, from the kept blob
    worker.register_models()
    assert conn.get(key) == blob and builds == [1]


def test_embedded_and_opted_out_workers_publish_nothing(connect, tiny, builds):
    worker_on(connect, tiny, publish_tokenizers=False).register_models()
    queue = embedded_queue({MODEL: tiny})
    for conn in (connect(), queue.connect()):
        assert conn.hexists(keys.MODELS, MODEL)
        assert not conn.exists(keys.tokenizer(tiny.sha256))
    assert builds == []
    with pytest.raises(TokenizerUnavailable, match="predate"):
        queue.client().tokenizer(MODEL)


def test_a_refused_publish_is_logged_and_retried(tmp_path, tiny, caplog):
    with RedisServer(tmp_path) as server:
        admin = redis.Redis.from_url(server.url)
        worker = worker_on(lambda: redis.Redis.from_url(server.url), tiny)
        admin.config_set("maxmemory", 1)  # every growing write is refused
        with caplog.at_level(logging.WARNING, logger="prefillq.worker"):
            assert worker.liveness.publish_tokenizer(MODEL, tiny) is False
        assert "could not publish the tokenizer" in caplog.text
        admin.config_set("maxmemory", 0)
        assert worker.liveness.publish_tokenizer(MODEL, tiny) is True
        assert worker.liveness.publish_tokenizer(MODEL, tiny) is False  # already there


def test_sync_client_builds_once_per_model_file(connect, tiny):
    worker_on(connect, tiny).register_models()
    conn, client = connect(), PrefillClient(connect())
    before = command_calls(conn)
    st = client.tokenizer(MODEL)
    assert calls_since(conn, before).get("get") == 1
    assert_tokenizes_like(st, tiny)
    before = command_calls(conn)
    assert client.tokenizer(MODEL) is st
    assert "get" not in calls_since(conn, before)  # cached by sha256: only the HGET
    assert PrefillClient(connect()).tokenizer(MODEL) is not st  # per client


def test_sync_client_errors(connect, tiny):
    worker_on(connect, tiny).register_models()
    conn, client, key = connect(), PrefillClient(connect()), keys.tokenizer(tiny.sha256)
    with pytest.raises(UnknownModel, match="no-such-model"):
        client.tokenizer("no-such-model")
    blob = conn.get(key)
    conn.delete(key)  # what a worker of an older prefillq leaves
    with pytest.raises(TokenizerUnavailable, match="predate") as caught:
        client.tokenizer(MODEL)
    assert type(caught.value) is TokenizerUnavailable
    conn.set(key, blob[: len(blob) // 3])
    with pytest.raises(TokenizerMalformed):
        client.tokenizer(MODEL)
    conn.set(key, blob)  # a failure is not cached
    assert_tokenizes_like(client.tokenizer(MODEL), tiny)


@pytest.mark.anyio
async def test_async_client_concurrent_first_calls_build_once(connect, redis_server, tiny):
    worker_on(connect, tiny).register_models()
    conn = connect()
    async with AsyncPrefillClient.from_url(redis_server) as client:
        before = command_calls(conn)
        got = await asyncio.gather(*(client.tokenizer(MODEL) for _ in range(8)))
        assert calls_since(conn, before).get("get") == 1
        assert all(st is got[0] for st in got)
        assert_tokenizes_like(got[0], tiny)
        before = command_calls(conn)
        assert await client.tokenizer(MODEL) is got[0]
        assert "get" not in calls_since(conn, before)


@pytest.mark.anyio
async def test_async_client_errors(connect, redis_server, tiny):
    worker_on(connect, tiny).register_models()
    conn, key = connect(), keys.tokenizer(tiny.sha256)
    blob = conn.get(key)
    async with AsyncPrefillClient.from_url(redis_server) as client:
        with pytest.raises(UnknownModel, match="no-such-model"):
            await client.tokenizer("no-such-model")
        conn.delete(key)
        with pytest.raises(TokenizerUnavailable, match="predate"):
            await client.tokenizer(MODEL)
        conn.set(key, b"\x81\xa6format\x01")  # msgpack {"format": 1} and nothing else
        with pytest.raises(TokenizerMalformed, match="is missing"):
            await client.tokenizer(MODEL)
        conn.set(key, blob)  # a failure is not cached
        assert_tokenizes_like(await client.tokenizer(MODEL), tiny)


@pytest.mark.anyio
async def test_a_canceled_waiter_leaves_the_shared_build_to_the_others():
    cache, gate, starts, built = AsyncTokenizerCache(), asyncio.Event(), [], object()

    async def build():
        starts.append(1)
        await gate.wait()
        return built

    first = asyncio.ensure_future(cache.get("sha", build))
    while not starts:  # the build is under way
        await asyncio.sleep(0)
    first.cancel()  # its caller went away (a client disconnect)
    second = asyncio.ensure_future(cache.get("sha", build))
    await asyncio.sleep(0)
    gate.set()
    assert await second is built
    assert first.cancelled() and starts == [1]
    assert await cache.get("sha", build) is built and starts == [1]


@pytest.mark.anyio
async def test_a_failed_shared_build_fails_its_waiters_and_is_retried():
    cache, gate, starts = AsyncTokenizerCache(), asyncio.Event(), []

    async def build():
        starts.append(1)
        await gate.wait()
        raise TokenizerUnavailable("not yet")

    waiters = [asyncio.ensure_future(cache.get("sha", build)) for _ in range(3)]
    while not starts:
        await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert [type(r) for r in results] == [TokenizerUnavailable] * 3 and starts == [1]
    with pytest.raises(TokenizerUnavailable):
        await cache.get("sha", build)
    assert starts == [1, 1]
