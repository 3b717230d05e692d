"""`jobs.subscriber.Subscriber` and the waits of `AsyncPrefillClient` through it, against a
real redis-server: one pub/sub connection however many waits, channels subscribed and
unsubscribed with their waiters, a killed connection replaced, nothing left after aclose.

Every count of connections and subscriptions is read from the server (CLIENT LIST, PUBSUB
NUMSUB), not from the subscriber's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from redis.asyncio import Redis

from jobs import AsyncPrefillClient, JobCanceled, JobNotFound, JobTimeout, PrefillClient, keys
from jobs.protocol import WATCH_RECHECK_S
from jobs.subscriber import Subscriber
from tests.worker.helpers import MODEL, ids
from worker.redis_server import RedisServer

pytestmark = pytest.mark.anyio


@pytest.fixture
async def subscriber(redis_server):
    client = Redis.from_url(redis_server)
    subscriber = Subscriber(client)
    yield subscriber
    await subscriber.aclose()
    await client.aclose()


@pytest.fixture
async def aclient(redis_server, worker):  # the worker has registered its model
    async with AsyncPrefillClient.from_url(redis_server) as c:
        yield c


def numsub(conn, channels) -> list[int]:
    """Subscribers of each channel (PUBSUB NUMSUB), in order."""
    return [n for _, n in conn.pubsub_numsub(*channels)]


def pubsub_clients(conn) -> list[dict]:
    return conn.client_list(_type="pubsub")


def subscriber_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("prefillq-subscriber")]


async def until(predicate, what: str, timeout: float = 5.0) -> None:
    """Poll `predicate` (a sync callable) from the event loop until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_200_concurrent_results_wait_on_one_pubsub_connection(redis_server, worker, connect):
    n = 200
    conn, sync = connect(), PrefillClient(connect())
    jobs = [sync.submit(tokens=ids(3, 300 + i), model=MODEL, top_k=1) for i in range(n)]
    channels = [keys.events(job) for job in jobs]
    got: dict = {}

    async def wait_all() -> None:
        async with AsyncPrefillClient.from_url(redis_server) as c:
            got["results"] = await asyncio.gather(*(c.result(j, timeout=60) for j in jobs))
            # unsubscribed with the connection still open (closing it would unsubscribe)
            mine = connect()
            await until(lambda: numsub(mine, channels) == [0] * n, "all unsubscribed")
            # with no subscription left Redis no longer lists it as TYPE pubsub: by id
            got["open"] = {int(c["id"]) for c in mine.client_list()}

    def run() -> None:
        try:
            asyncio.run(wait_all())
        except BaseException as e:  # reported by the main thread's assert
            got["error"] = e

    waiter = threading.Thread(target=run, daemon=True)
    waiter.start()  # its loop is free while the worker runs in this thread (RQ's signals)
    wait_until(lambda: numsub(conn, channels) == [1] * n, "all 200 channels subscribed")
    [client] = pubsub_clients(conn)  # one connection holds the 200 subscriptions
    assert int(client["sub"]) == n
    subscriber_id = int(client["id"])
    worker.work(burst=True, logging_level="WARNING")
    waiter.join(timeout=30)
    assert not waiter.is_alive() and "error" not in got, got.get("error")
    assert got["results"] == [sync.result(job, timeout=0) for job in jobs]
    assert [(r.job_id, r.n_tokens) for r in got["results"]] == [(j, 3) for j in jobs]
    assert subscriber_id in got["open"]  # the same connection, still open, not a new one
    wait_until(lambda: subscriber_id not in {int(c["id"]) for c in conn.client_list()},
               "the pub/sub connection closed")


async def test_waiters_of_one_channel_share_its_subscription_and_all_wake(subscriber,
                                                                          connect):
    conn = connect()
    confirmed = 0

    async def wait_once() -> bool:
        nonlocal confirmed
        async with subscriber.subscribe("news") as events:
            assert await events.wait(1.0), "no SUBSCRIBE confirmation"
            confirmed += 1
            return await events.wait(5.0)

    waiters = [asyncio.create_task(wait_once()) for _ in range(50)]
    await until(lambda: confirmed == 50, "every waiter confirmed")
    assert numsub(conn, ["news"]) == [1] and len(pubsub_clients(conn)) == 1
    start = time.monotonic()
    conn.publish("news", "x")
    assert await asyncio.gather(*waiters) == [True] * 50  # one message woke every waiter
    assert time.monotonic() - start < 0.5  # measured ~5 ms
    await until(lambda: numsub(conn, ["news"]) == [0], "news unsubscribed")


async def test_a_channel_is_unsubscribed_when_its_last_waiter_leaves(subscriber, connect):
    conn = connect()
    async with subscriber.subscribe("a") as first:
        assert await first.wait(1.0)
        assert numsub(conn, ["a"]) == [1]  # confirmed: the server holds it already
        async with subscriber.subscribe("a") as second:
            assert await second.wait(0)  # joined a confirmed channel: no round trip
        await asyncio.sleep(0.1)  # time enough for a wrong UNSUBSCRIBE to land
        assert numsub(conn, ["a"]) == [1]
        conn.publish("a", "x")
        assert await first.wait(1.0)
    await until(lambda: numsub(conn, ["a"]) == [0], "a unsubscribed after its last waiter")

    async def hold(channel: str) -> None:
        async with subscriber.subscribe(channel) as events:
            await events.wait(1.0)
            await asyncio.sleep(3600)

    held = [asyncio.create_task(hold(c)) for c in ("b", "c", "c")]
    await until(lambda: numsub(conn, ["b", "c"]) == [1, 1], "b and c subscribed")
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    await until(lambda: numsub(conn, ["b", "c"]) == [0, 0], "canceled waiters unsubscribed")


async def test_a_channel_left_and_entered_again_at_once_is_confirmed(subscriber, connect):
    conn = connect()
    for gap_ms in range(20):  # enter again before, while and after the UNSUBSCRIBE goes
        async with subscriber.subscribe("r") as events:
            assert await events.wait(1.0), f"no confirmation {gap_ms} ms after leaving"
            assert numsub(conn, ["r"]) == [1]
        await asyncio.sleep(gap_ms / 1000)
    await until(lambda: numsub(conn, ["r"]) == [0], "r unsubscribed")


async def test_every_way_out_of_a_watch_unsubscribes(aclient, connect):
    conn = connect()
    job = await aclient.submit(tokens=ids(20, 1), model=MODEL)
    channel = [keys.events(job)]
    statuses = aclient.watch(job)
    await anext(statuses)
    assert numsub(conn, channel) == [1]  # subscribed before the first status
    await statuses.aclose()
    await until(lambda: numsub(conn, channel) == [0], "closed watch unsubscribed")
    with pytest.raises(JobTimeout):
        await aclient.result(job, timeout=0.2)
    await until(lambda: numsub(conn, channel) == [0], "timed-out wait unsubscribed")
    waiting = asyncio.create_task(aclient.result(job, timeout=30))
    await until(lambda: numsub(conn, channel) == [1], "the wait subscribed")
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await until(lambda: numsub(conn, channel) == [0], "canceled wait unsubscribed")
    with pytest.raises(JobNotFound):
        await aclient.result("nope", timeout=5)
    await until(lambda: numsub(conn, [keys.events("nope")]) == [0], "nope unsubscribed")
    waiting = asyncio.create_task(aclient.result(job, timeout=30))
    await until(lambda: numsub(conn, channel) == [1], "the wait subscribed")
    await aclient.cancel(job)
    with pytest.raises(JobCanceled):
        await waiting
    await until(lambda: numsub(conn, channel) == [0], "finished wait unsubscribed")


async def test_waits_outlive_a_killed_pubsub_connection(aclient, connect):
    conn = connect()
    jobs = [await aclient.submit(tokens=ids(20, 10 + i), model=MODEL) for i in range(6)]
    channels = [keys.events(job) for job in jobs]
    waits = [asyncio.create_task(aclient.result(job, timeout=30)) for job in jobs]
    await until(lambda: numsub(conn, channels) == [1] * 6, "all subscribed")
    [old] = pubsub_clients(conn)
    assert conn.client_kill_filter(_type="pubsub") == 1
    await aclient.cancel(jobs[0])  # its event may go while no connection listens
    start = time.monotonic()
    with pytest.raises(JobCanceled):
        await asyncio.wait_for(waits[0], 2 * WATCH_RECHECK_S + 1)
    # a recheck at worst; measured ~2 ms: the re-subscription's confirmation woke it
    assert time.monotonic() - start < WATCH_RECHECK_S + 0.5
    await until(lambda: numsub(conn, channels[1:]) == [1] * 5, "re-subscribed")
    [new] = pubsub_clients(conn)
    assert new["id"] != old["id"]
    latencies = []
    for job, waiting in zip(jobs[1:], waits[1:], strict=True):  # woken by events, not rechecks
        start = time.monotonic()
        await aclient.cancel(job)
        with pytest.raises(JobCanceled):
            await asyncio.wait_for(waiting, 2 * WATCH_RECHECK_S)
        latencies.append(time.monotonic() - start)
    assert max(latencies) < 0.1, latencies  # measured <= 1 ms; a recheck: up to 1 s
    await until(lambda: numsub(conn, channels) == [0] * 6, "all unsubscribed")


async def test_the_subscriber_comes_back_after_the_server_restarts():
    with RedisServer() as server:  # its own server: this one goes down
        client = Redis.from_url(server.url)
        subscriber = Subscriber(client)
        try:
            async with subscriber.subscribe("a") as events:
                assert await events.wait(1.0)
                server.stop()
                assert not await events.wait(0.3)  # the reader retries meanwhile
                async with subscriber.subscribe("b") as entered_while_down:
                    await asyncio.sleep(0.2)
                    server.start()  # same port, a new process: no subscriptions
                    conn = redis.Redis.from_url(server.url)
                    await until(lambda: numsub(conn, ["a", "b"]) == [1, 1], "re-subscribed")
                    # the re-subscription wakes it once the reader has its reply, which
                    # can come after the server counts the subscription (a loaded machine)
                    assert await events.wait(1.0)
                    assert await entered_while_down.wait(1.0)
                    conn.publish("a", "x")
                    assert await events.wait(0.5)
                async with subscriber.subscribe("c") as entered_after:
                    assert await entered_after.wait(1.0), "no SUBSCRIBE for a new channel"
        finally:
            await subscriber.aclose()
            await client.aclose()


async def test_the_subscriber_starts_on_the_first_wait_and_aclose_stops_it(redis_server,
                                                                           worker, connect):
    conn = connect()
    before = {client["id"] for client in conn.client_list()}
    c = AsyncPrefillClient.from_url(redis_server)
    try:
        job = await c.submit(tokens=ids(20, 2), model=MODEL)
        assert subscriber_tasks() == [] and pubsub_clients(conn) == []  # lazily, on a wait
        for _ in range(2):  # a client used again after aclose starts its subscriber again
            with pytest.raises(JobTimeout):
                await c.result(job, timeout=0.1)
            assert len(subscriber_tasks()) == 3 and c.subscriber.running  # run, read, sync
            assert len(pubsub_clients(conn)) == 1
            await c.aclose()
            assert subscriber_tasks() == [] and not c.subscriber.running
            await until(lambda: {cl["id"] for cl in conn.client_list()} <= before,
                        "every connection of the client closed")
    finally:
        await c.aclose()
