"""What a load run watches in Redis: every job's events (`EventCounter`), memory
(`MemorySampler`, `memory_now`) and the keys by pattern (`keyspace`)."""

from __future__ import annotations

import re
import threading
from collections import Counter

import redis

from jobs import stats

EVENTS = "prefillq:*:events"
TERMINAL = tuple(s.value for s in stats.TERMINAL_STATES)
# INFO memory is read this often while jobs run (for the peak).
SAMPLE_S = 0.05
MEMORY_FIELDS = ("used_memory", "used_memory_dataset", "used_memory_overhead",
                 "mem_clients_normal", "used_memory_scripts")


class EventCounter:
    """Counts every message on every job's events channel (one pattern subscription,
    ``prefillq:*:events``), per job id and message, from a thread of its own."""

    def __init__(self, conn: redis.Redis):
        self.counts: Counter = Counter()
        self._ended: list[str] = []
        self._lock = threading.Lock()
        self._pubsub = conn.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(**{EVENTS: self._on_message})
        self._thread = self._pubsub.run_in_thread(sleep_time=0.01, daemon=True)

    def _on_message(self, message: dict) -> None:
        channel, kind = message["channel"].decode(), message["data"].decode()
        job_id = channel[channel.index("{") + 1:channel.index("}")]
        with self._lock:
            self.counts[job_id, kind] += 1
            if kind in TERMINAL:
                self._ended.append(job_id)

    def take_ended(self) -> list[str]:
        """Jobs whose terminal message came since the last call (a job twice if it had
        two)."""
        with self._lock:
            out, self._ended = self._ended, []
        return out

    def stop(self) -> Counter:
        """Unsubscribe and close; messages per ``(job id, message)``."""
        self._thread.stop()
        self._thread.join(timeout=10)
        self._pubsub.close()
        return Counter(self.counts)


class MemorySampler:
    """The highest ``INFO memory`` used_memory (bytes) seen, read every `SAMPLE_S` from a
    thread and connection of its own."""

    def __init__(self, url: str):
        self.peak = 0
        self._conn = redis.Redis.from_url(url)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self.peak = max(self.peak, self._conn.info("memory")["used_memory"])

    def stop(self) -> int:
        """Stop sampling; the peak."""
        self._done.set()
        self._thread.join(timeout=10)
        self._conn.close()
        return self.peak


def memory_now(conn: redis.Redis) -> dict:
    """Redis memory now (bytes): `MEMORY_FIELDS` of ``INFO memory``; ``connections`` and
    ``connections_memory``, the clients and their summed ``tot-mem`` (CLIENT LIST: query
    and reply buffers, which Redis grows and shrinks by ~16-20 KB steps as traffic comes
    and goes) read in the same transaction, and ``apart_from_connections``, used_memory
    less that; ``commands``: the commands the server has run at least once, sorted (Redis
    7 keeps a latency histogram per command, ~25 KB, from its first call).

    INFO's own ``mem_clients_normal`` is an aggregate the server refreshes in its cron, so
    it lags used_memory; CLIENT LIST computes each client's memory as it answers."""
    with conn.pipeline(transaction=True) as pipe:
        replies = pipe.client_list().info("memory").info("commandstats").execute()
    clients, info, commandstats = replies
    out = {f: info[f] for f in MEMORY_FIELDS if f in info}
    out["connections"] = len(clients)
    out["connections_memory"] = sum(int(c["tot-mem"]) for c in clients)
    out["apart_from_connections"] = info["used_memory"] - out["connections_memory"]
    out["commands"] = sorted(name.removeprefix("cmdstat_") for name in commandstats)
    return out


# a job id (uuid4 hex) or RQ's id of one of its executions (``<id>-<12 hex>``)
_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(-[0-9a-f]{12})?(?![0-9a-f])")


def key_pattern(key: str) -> str:
    """`key` with every job id (and RQ's execution id ``<id>-<12 hex>``) as ``*``; a
    model's sha256 (64 hex) is kept."""
    return _ID.sub("*", key)


def keyspace(conn: redis.Redis) -> dict[str, dict[str, int]]:
    """Every key grouped by `key_pattern`: ``count``, ``bytes`` (MEMORY USAGE) and
    ``no_ttl`` (how many never expire); patterns sorted."""
    names = [k.decode() for k in conn.scan_iter(count=1000)]
    with conn.pipeline(transaction=False) as pipe:
        for k in names:
            pipe.memory_usage(k, samples=0).ttl(k)
        replies = pipe.execute()
    out: dict[str, dict[str, int]] = {}
    for i, k in enumerate(names):
        size, ttl = replies[2 * i], replies[2 * i + 1]
        row = out.setdefault(key_pattern(k), {"count": 0, "bytes": 0, "no_ttl": 0})
        row["count"] += 1
        row["bytes"] += size or 0  # a key that expired between SCAN and MEMORY USAGE
        row["no_ttl"] += ttl == -1
    return dict(sorted(out.items()))
