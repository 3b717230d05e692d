"""A client waiting on a job rides out a Redis restart (`jobs.protocol.Outage`): sync and
asyncio `result` reconnect, subscribe again and see the job end, instead of raising the
outage's ConnectionError; a longer outage than ``WATCH_OUTAGE_S`` or the caller's timeout
still raises it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from jobs import AsyncPrefillClient, JobCanceled, PrefillClient, keys, protocol
from jobs.serializer import packb
from tests.worker.helpers import MODEL, ids
from worker.redis_server import RedisServer


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(protocol.time, "monotonic", fake)
    return fake


def test_an_outage_backs_off_then_gives_up_at_its_limit(clock):
    outage = protocol.Outage()
    delays = [outage.retry_in(None) for _ in range(7)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    clock.t += protocol.WATCH_OUTAGE_S - 0.25
    assert outage.retry_in(None) == pytest.approx(0.25)  # never past the limit
    clock.t += 0.25
    assert outage.retry_in(None) is None
    outage.ended()  # a read succeeded: the next outage starts afresh
    assert outage.retry_in(None) == 0.05


def test_an_outage_never_outlasts_the_deadline(clock):
    outage = protocol.Outage()
    deadline = clock.t + 0.12
    assert outage.retry_in(deadline) == 0.05
    assert outage.retry_in(deadline) == 0.1
    clock.t += 0.1
    assert outage.retry_in(deadline) == pytest.approx(0.02)
    clock.t += 0.02
    assert outage.retry_in(deadline) is None


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path, appendonly=True).start()
    yield srv
    srv.stop()


def sync_result(url: str, job: str) -> None:
    PrefillClient.from_url(url).result(job, timeout=60)


def async_result(url: str, job: str) -> None:
    async def wait() -> None:
        client = AsyncPrefillClient.from_url(url)
        try:
            await client.result(job, timeout=60)
        finally:
            await client.aclose()

    asyncio.run(wait())


@pytest.mark.parametrize("wait", [sync_result, async_result], ids=["sync", "asyncio"])
def test_result_rides_out_a_redis_restart(server, wait):
    conn = redis.Redis.from_url(server.url)
    info = {"vocab_size": 365, "context_length": 4096, "architecture": "gemma3", "sha256": ""}
    conn.hset(keys.MODELS, MODEL, packb(info))
    client = PrefillClient(conn)
    job = client.submit(tokens=ids(20, 1), model=MODEL)
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            wait(server.url, job)
            ended.append(None)
        except BaseException as error:
            ended.append(error)

    waiter = threading.Thread(target=run, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 30
    while conn.pubsub_numsub(keys.events(job))[0][1] < 1:  # the waiter is subscribed
        assert time.monotonic() < deadline, "the waiter never subscribed"
        time.sleep(0.02)
    server.stop()
    time.sleep(1.0)  # longer than a reconnect: the waiter's reads fail meanwhile
    server.start()  # AOF on: the job is still queued
    assert client.cancel(job)  # it ends now, after the restart
    waiter.join(30)
    assert len(ended) == 1 and isinstance(ended[0], JobCanceled), ended
