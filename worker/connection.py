"""The worker's Redis connection and its retry policy."""

from __future__ import annotations

from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from jobs.client import redis_url


def worker_connection(url: str | None) -> Redis:
    """A Redis connection that rides out outages: every command is retried with capped
    exponential backoff instead of raising, so the worker survives a Redis restart."""
    return Redis.from_url(
        redis_url(url),
        retry=Retry(ExponentialBackoff(cap=10.0, base=0.1), retries=-1),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=30,
    )
