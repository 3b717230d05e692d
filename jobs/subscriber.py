"""`Subscriber`: one Redis pub/sub connection shared by every waiter of an asyncio client.

So a gateway with thousands of blocking requests holds one pub/sub connection, not one per
request. Waits are hints, never the truth: a waiter re-reads what it waits on after every
wake and at least every few seconds of its own choosing (`jobs.aio` uses WATCH_RECHECK_S).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

# What a lost connection raises; the reader and the sync task retry after these.
CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
# Retries after a connection error back off from 0 (the first) by doubling, up to this (s).
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0


def next_delay(delay: float) -> float:
    """The backoff (s) after one that was `delay`: 0, 0.05, 0.1, ... up to RETRY_MAX_S."""
    return min(max(2 * delay, RETRY_FIRST_S), RETRY_MAX_S)


class Subscription:
    """One waiter's handle on a channel, from `Subscriber.subscribe`.

    It is woken when a message arrives on the channel and when the server confirms the
    channel's SUBSCRIBE (the first, and again after a reconnect): from then on no message
    published there is missed. Wakes coalesce: several messages between two waits wake it
    once.
    """

    def __init__(self, woken: bool):
        self._woken = woken
        self._waiter: asyncio.Future | None = None

    def wake(self) -> None:
        self._woken = True
        if self._waiter is not None:
            _release(self._waiter)

    async def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a wake since the last `wait`.

        Returns:
            True if woken (a message, or the subscription's confirmation), False if
            `timeout` passed first (at once when `timeout` <= 0 and nothing is pending).
        """
        if not self._woken and timeout > 0:
            # a bare future, not asyncio.wait_for: before Python 3.12 that can swallow a
            # cancellation that lands as the wait ends
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _release, self._waiter)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        woken, self._woken = self._woken, False
        return woken


def _release(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Channel:
    """A channel's waiters, and whether the server has confirmed its SUBSCRIBE."""

    def __init__(self):
        self.waiters: set[Subscription] = set()
        self.confirmed = False


class Subscriber:
    """One pub/sub connection, its reader task and the waiters of each channel.

    A background reader on the one connection wakes every waiter of a channel when a
    message arrives there. A channel is subscribed when its first waiter enters and
    unsubscribed when its last one leaves, however it leaves (return, error, cancellation):
    a leave only updates the table, and a sync task makes the connection's subscriptions
    match it. A message lost to a dropped connection only delays a waiter by one recheck.

    The tasks start on the first `subscribe` (in its event loop) and stop on `aclose`; a
    later `subscribe` starts them again. After the connection drops, redis-py reconnects
    it and re-subscribes its channels (else the reader retries with backoff); every waiter
    of a re-subscribed channel is woken, so each re-reads what it waits on at once.

    Args:
        redis: the client whose pool lends the one connection. ``decode_responses`` must be
            False, and its connections must not run health checks
            (``health_check_interval=0``, redis-py's default): the sync task sends on the
            connection while the reader is blocked on it.
    """

    def __init__(self, redis: Redis):
        self._pubsub = redis.pubsub()
        self._channels: dict[bytes, _Channel] = {}
        self._task: asyncio.Task | None = None
        self._dirty: asyncio.Event | None = None
        # channels the sync must look at (a waiter count crossed 0, a stray message), or
        # all of them after a (re)start or a reconnect: a sync costs O(changes)
        self._changed: set[bytes] = set()
        self._check_all = False
        # the tasks also stop on this: redis-py's sends (asyncio.wait_for before Python
        # 3.12) can swallow a cancellation, which would leave a loop running
        self._closing = False

    @property
    def running(self) -> bool:
        """Whether the reader task is running."""
        return self._task is not None and not self._task.done()

    @asynccontextmanager
    async def subscribe(self, channel: str) -> AsyncIterator[Subscription]:
        """Wait on `channel` for the block's duration (an async context manager).

        The yielded `Subscription` is woken once the channel's SUBSCRIBE is confirmed (at
        once when another waiter already holds it confirmed), then by each message. Read
        what you wait on after that first wake, and no change is missed. Leaving the block
        unsubscribes the channel if it was the last waiter; it never awaits, so a canceled
        waiter leaves as cleanly as one that returned.
        """
        self._start()
        name = channel.encode()
        entry = self._channels.setdefault(name, _Channel())
        waiter = Subscription(woken=entry.confirmed)
        entry.waiters.add(waiter)
        if len(entry.waiters) == 1:
            self._changed_channel(name)
        try:
            yield waiter
        finally:
            entry.waiters.discard(waiter)
            if not entry.waiters and self.running:
                self._changed_channel(name)
            elif not entry.waiters and self._channels.get(name) is entry:
                del self._channels[name]  # stopped: no connection holds it any more

    async def aclose(self) -> None:
        """Stop the tasks and give the connection back to its pool; wake every waiter
        (each re-reads at once rather than at its next recheck)."""
        task, self._task = self._task, None
        if task is not None:
            self._closing = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for entry in self._channels.values():
            for waiter in entry.waiters:
                waiter.wake()

    # -- the tasks ---------------------------------------------------------------------

    def _start(self) -> None:
        if self.running:
            return
        self._closing = False
        self._dirty = asyncio.Event()
        self._check_all_channels()  # a restart subscribes every channel that has waiters
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name="prefillq-subscriber")
        self._task.add_done_callback(_log_crash)

    async def _run(self) -> None:
        # Connecting first and only here: a send racing the reader into connect() would
        # open a second socket.
        try:
            await self._connect()
            loops = [asyncio.create_task(self._read_loop(), name="prefillq-subscriber-read"),
                     asyncio.create_task(self._sync_loop(), name="prefillq-subscriber-sync")]
            try:
                done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()  # a loop's error, re-raised for the log
            finally:
                self._closing = True
                for task in loops:
                    task.cancel()
                await asyncio.gather(*loops, return_exceptions=True)
        finally:
            for entry in self._channels.values():
                entry.confirmed = False
            if self._pubsub.connection is not None:
                self._pubsub.connection.deregister_connect_callback(self._reconnected)
            await self._pubsub.aclose()

    async def _connect(self) -> None:
        delay = 0.0
        while not self._closing:
            try:
                await self._pubsub.connect()
                # redis-py re-subscribes its channels on a reconnect; this syncs the rest
                self._pubsub.connection.register_connect_callback(self._reconnected)
                return
            except CONNECTION_ERRORS as e:
                log.warning("pub/sub connection failed (%s); retrying in %.2f s", e, delay)
            await asyncio.sleep(delay)
            delay = next_delay(delay)

    async def _read_loop(self) -> None:
        delay = 0.0
        while not self._closing:
            try:
                message = await self._pubsub.get_message(timeout=None)
            except CONNECTION_ERRORS as e:
                # redis-py reconnects (now or on the next read) and re-subscribes: each
                # channel is confirmed anew
                for entry in self._channels.values():
                    entry.confirmed = False
                log.warning("pub/sub read failed (%s); reading again in %.2f s", e, delay)
                await asyncio.sleep(delay)
                delay = next_delay(delay)
                continue
            delay = 0.0
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict) -> None:
        kind, name = message["type"], message["channel"]
        entry = self._channels.get(name)
        if entry is not None and kind in ("subscribe", "unsubscribe"):
            # replies come in the order the commands went: the last one says where it is
            entry.confirmed = kind == "subscribe"
        if entry is not None and entry.waiters:
            if kind in ("message", "subscribe"):
                for waiter in entry.waiters:
                    waiter.wake()
            elif kind == "unsubscribe":
                self._changed_channel(name)  # the sync subscribes it again if need be
        elif kind in ("message", "subscribe"):
            self._changed_channel(name)  # e.g. re-subscribed on a reconnect, now idle

    async def _sync_loop(self) -> None:
        delay = 0.0
        while not self._closing:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._sync()
                delay = 0.0
            except CONNECTION_ERRORS as e:
                log.warning("pub/sub (un)subscribe failed (%s); again in %.2f s", e, delay)
                self._check_all_channels()
                await asyncio.sleep(delay)
                delay = next_delay(delay)

    def _changed_channel(self, name: bytes) -> None:
        self._changed.add(name)
        self._dirty.set()

    def _check_all_channels(self) -> None:
        self._check_all = True
        self._dirty.set()

    def _reconnected(self, connection) -> None:  # a connect callback (kept as a weak method)
        self._check_all_channels()

    async def _sync(self) -> None:
        """SUBSCRIBE the channels with waiters and UNSUBSCRIBE those without, each a single
        command however many channels (200 waits entering at once send one). Sends nothing
        while the connection is down: the reader reconnects it, then `_reconnected` calls
        for another sync."""
        if not self._pubsub.connection.is_connected:
            return
        names, self._changed = self._changed, set()
        if self._check_all:
            names |= set(self._channels) | set(self._pubsub.channels)
            self._check_all = False
        add, drop = [], []
        for name in names:
            entry = self._channels.get(name)
            # what redis-py keeps subscribed across reconnects, less what is leaving
            live = (name in self._pubsub.channels
                    and name not in self._pubsub.pending_unsubscribe_channels)
            if entry is not None and not entry.waiters:
                # kept until now so that a waiter entering meanwhile found it confirmed
                del self._channels[name]
            if entry is not None and entry.waiters and not live:
                add.append(name)
            elif (entry is None or not entry.waiters) and live:
                drop.append(name)
        if add:
            await self._pubsub.subscribe(*add)
        if drop:  # on a failure the sync loop checks every channel again
            await self._pubsub.unsubscribe(*drop)


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("pub/sub subscriber stopped; the next wait restarts it",
                  exc_info=task.exception())
