"""The worker's Redis connection: ride out outages while serving, give up on shutdown.

A serving worker retries every command that fails on the connection, forever, so it
survives a Redis restart with its KV caches intact; writes Redis refuses (``maxmemory``, a
value too large) are not connection errors (`refused_write`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ConnectionError,
    OutOfMemoryError,
    ResponseError,
    TimeoutError,
)
from redis.retry import Retry

from jobs.client import redis_url

log = logging.getLogger("prefillq.worker")

T = TypeVar("T")

# Backoff between attempts while serving: 0.1 s doubling, at most 10 s.
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 10.0
# Backoff sleeps in steps of at most this, so a stop request is noticed quickly.
PAUSE_STEP_S = 0.25
# A connect that takes longer than this counts as a failed attempt.
CONNECT_TIMEOUT_S = 5.0
# Connection errors no wait cures (wrong credentials, an ACL user without the rights):
# raised at once, so a misconfigured worker exits with the reason instead of retrying.
NOT_RETRIED = (AuthenticationError, AuthorizationError)
# What an outage raises: logged once per wait (a refused write is `until_accepted`'s to log).
OUTAGE_ERRORS = (ConnectionError, TimeoutError)


class RedisUnreachable(OSError):
    """Redis stayed unreachable past the shutdown deadline; the worker exits without
    finishing its shutdown (the message says what was left undone)."""


class Deadline:
    """When retries stop: never until `set`, then at a monotonic time. Shared by every copy
    of the `ShutdownRetry` that holds it (redis-py deep-copies the retry per connection)."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.seconds: float = 0.0
        self.expired_once = False  # a command failed for good after the deadline

    def set(self, seconds: float) -> None:
        """Stop retrying `seconds` from now (the first call wins)."""
        if self.at is None:
            self.seconds = seconds
            self.at = time.monotonic() + seconds

    def left(self) -> float | None:
        """Seconds until the deadline (<= 0 once past), or None when none is set."""
        return None if self.at is None else self.at - time.monotonic()

    def __deepcopy__(self, memo) -> Deadline:
        return self


class ShutdownRetry(Retry):
    """`Retry` with capped exponential backoff that retries forever until its deadline is
    set, then until the deadline only. redis-py calls it for every command
    (https://redis.readthedocs.io/en/stable/retry.html).

    Args:
        deadline: shared with other retries (default: a new one, never set).
        errors: the errors retried (default: an outage's).
    """

    def __init__(self, deadline: Deadline | None = None,
                 errors: tuple[type[Exception], ...] = (ConnectionError, TimeoutError)):
        super().__init__(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries=-1,
                         supported_errors=errors)
        self.deadline = deadline or Deadline()

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        """Call `do` until it returns; on a supported error call `fail`, back off, retry.
        An outage is logged once, as a warning at its first failure and a line when `do`
        returns after it (a worker started against a wrong URL says so).

        Raises:
            ConnectionError, TimeoutError: the error of the last attempt, once the deadline
                has passed. `NOT_RETRIED` (wrong credentials) and any other error of `do` at
                once.
        """
        self._backoff.reset()
        failures, first_failure = 0, 0.0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if isinstance(error, NOT_RETRIED) or (is_retryable and not is_retryable(error)):
                    raise
                failures += 1
                if failures == 1 and isinstance(error, OUTAGE_ERRORS):
                    first_failure = time.monotonic()
                    log.warning("Redis is unreachable (%s); retrying until it answers", error)
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                left = self.deadline.left()
                if left is not None and left <= 0:
                    self.deadline.expired_once = True
                    raise
                self._pause(self._backoff.compute(failures))
            else:
                if first_failure:
                    log.info("Redis answered again after %.1f s (%d failed attempts)",
                             time.monotonic() - first_failure, failures)
                return result

    def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, in short steps so a deadline set meanwhile cuts it short."""
        end = time.monotonic() + seconds
        while (now := time.monotonic()) < end:
            left = self.deadline.left()
            if left is not None and left <= 0:
                return
            time.sleep(min(end - now, PAUSE_STEP_S, *(() if left is None else (left,))))


def worker_connection(url: str | None) -> Redis:
    """A Redis connection (bytes replies) that retries failed commands (`ShutdownRetry`).

    Args:
        url: Redis URL, or None for `jobs.client.redis_url`'s default.
    """
    return Redis.from_url(
        redis_url(url),
        retry=ShutdownRetry(),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=30,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
    )


def _deadline(connection) -> Deadline | None:
    get_retry = getattr(connection, "get_retry", None)
    retry = get_retry() if get_retry is not None else None
    return retry.deadline if isinstance(retry, ShutdownRetry) else None


def give_up_after(connection, seconds: float) -> None:
    """Let `connection`'s commands fail once Redis has been unreachable `seconds` from now,
    so a worker asked to stop whose Redis is gone can exit.

    A no-op for connections without a `ShutdownRetry` (they do not retry forever).
    """
    deadline = _deadline(connection)
    if deadline is not None:
        deadline.set(seconds)


def gave_up(connection) -> float | None:
    """The deadline in seconds if a command on `connection` failed past it, else None."""
    deadline = _deadline(connection)
    if deadline is None or not deadline.expired_once:
        return None
    return deadline.seconds


def refused_write(error: BaseException) -> bool:
    """Whether `error` is Redis refusing a write it received: out of memory under
    ``maxmemory`` (also inside a script or a MULTI) or a value over its size limit. Such an
    error fails or retries the one job, not the worker."""
    if isinstance(error, OutOfMemoryError):
        return True
    if not isinstance(error, ResponseError):
        return False
    text = str(error)
    return (text.startswith("OOM") or "OOM command not allowed" in text
            or "maximum allowed size" in text or "too large" in text)


def until_accepted(connection, write: Callable[[], T], what: str) -> T:
    """Call `write` until Redis accepts it: a refused write (`refused_write`) is retried as
    an outage is, with `ShutdownRetry`'s backoff, until `connection`'s shutdown deadline
    (`give_up_after`) or, on a connection without one, forever. Logs one warning at the
    first refusal and one line once the write lands, however many attempts lie between.

    Args:
        connection: the connection `write` uses.
        write: writes that are safe to repeat from the start (a registration).
        what: what `write` does, for the log (``"the registration of w1's models"``).
    Returns:
        What `write` returned.
    Raises:
        redis.exceptions.ResponseError: the refusal, once the deadline has passed.
        Exception: any other error of `write`, at once.
    """
    retry = ShutdownRetry(_deadline(connection), errors=(ResponseError,))
    refused_at: list[float] = []

    def refused(error: Exception) -> None:
        if not refused_at:
            refused_at.append(time.monotonic())
            log.warning("Redis refused %s (%s); retrying until it has room", what, error)

    result = retry.call_with_retry(write, refused, is_retryable=refused_write)
    if refused_at:
        log.info("Redis accepted %s after %.1f s", what, time.monotonic() - refused_at[0])
    return result


def unless_refused(what: str, call, *args, **kwargs) -> None:
    """Call `call`; log instead of raising when Redis refuses its write (maxmemory)."""
    try:
        call(*args, **kwargs)
    except Exception as error:
        if not refused_write(error):
            raise
        log.warning("Redis refused %s: %s", what, error)
