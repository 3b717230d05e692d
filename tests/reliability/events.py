"""`EventLog`: every event published on any job's channel, counted per job."""

from __future__ import annotations

import collections
import threading
import time

import redis

from jobs import keys

# every job's events channel: ``prefillq:{<job id>}:events``
PATTERN = keys.events("*")
# the channel `settle` marks on (no job has this id)
FENCE_JOB = "eventlog-fence"


class EventLog:
    """A pattern subscription to every job's events channel, read on a thread.

    Args:
        url: the Redis the workers publish on. Subscribed when the constructor returns.
    """

    def __init__(self, url: str):
        self._conn = redis.Redis.from_url(url)
        self._pubsub = self._conn.pubsub(ignore_subscribe_messages=True)
        self._lock = threading.Lock()
        self._seen: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self._pubsub.psubscribe(**{PATTERN: self._on_message})
        self._thread = self._pubsub.run_in_thread(sleep_time=0.01, daemon=True)
        deadline = time.monotonic() + 10
        while self._conn.pubsub_numpat() < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the pattern subscription never registered")
            time.sleep(0.01)

    def _on_message(self, message: dict) -> None:
        channel = message["channel"].decode()
        job_id = channel.split("{", 1)[1].split("}", 1)[0]
        with self._lock:
            self._seen[job_id][message["data"].decode()] += 1

    def settle(self, timeout: float = 30) -> None:
        """Wait until every event published so far has been read: a marker published now
        arrives after them (the server delivers a pattern's messages in publish order)."""
        marker = f"settle-{time.monotonic_ns()}"
        self._conn.publish(keys.events(FENCE_JOB), marker)
        deadline = time.monotonic() + timeout
        while self.count(FENCE_JOB, marker) < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("the settle marker never arrived")
            time.sleep(0.01)

    def count(self, job_id: str, event: str) -> int:
        """How many times `event` (``finished``, ``failed``, ...) was published for `job_id`."""
        with self._lock:
            return self._seen[job_id][event]

    def close(self) -> None:
        self._thread.stop()
        self._thread.join(timeout=5)
        self._pubsub.close()
        self._conn.close()
