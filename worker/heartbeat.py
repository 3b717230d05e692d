"""Liveness: model registration, the heartbeat thread and the periodic reap.

A worker's heartbeat key stays alive while it serves; when it expires, any worker's reap
(`jobs.reaper`) puts the dead worker's jobs back on intake.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from redis.exceptions import ResponseError

from jobs import keys
from jobs.reaper import reap
from jobs.schema import now
from jobs.serializer import packb
from jobs.tokenizer import pack_tokenizer
from model.registry import LoadedModel

from .connection import refused_write

log = logging.getLogger("prefillq.worker")


class Heartbeat:
    """Registration and the beat thread of worker `name`.

    Args:
        connection: Redis connection.
        name: the worker's name.
        models: loaded models by registry name.
        ttl_s: the worker counts as dead this long after its last beat (>= 1).
        result_ttl_s: lifetime of the records of jobs the reaper fails.
        on_beat: called every interval from the maintenance thread (retries of writes that
            Redis refused earlier); its errors are logged, never raised.
        publish_tokenizers: publish the models' tokenizers (off for a queue no other
            process reads, where building the blob would only add to start-up).
    """

    def __init__(self, connection, name: str, models: Mapping[str, LoadedModel], *,
                 ttl_s: int, result_ttl_s: int, on_beat: Callable[[], None] | None = None,
                 publish_tokenizers: bool = True):
        self.connection, self.name, self.models = connection, name, models
        self.ttl_s = max(1, ttl_s)
        self.result_ttl_s = result_ttl_s
        self.on_beat = on_beat
        self.publish_tokenizers = publish_tokenizers
        self._tokenizer_blobs: dict[str, bytes] = {}  # by model name, built once
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def register_models(self) -> None:
        """Advertise the models (vocab, context) under ``keys.MODELS`` so clients can
        validate submits, and which this worker serves under ``keys.worker_models(name)``
        (live workers per model, `jobs.stats`); publish their tokenizers where none is yet
        (for clients that tokenize, `jobs.tokenizer`); beat."""
        for name, loaded in self.models.items():
            info = {
                "vocab_size": loaded.vocab_size,
                "context_length": loaded.context_length,
                "architecture": loaded.architecture,
                "sha256": loaded.sha256,
            }
            self.connection.hset(keys.MODELS, name, packb(info))
            if self.publish_tokenizers:
                self.publish_tokenizer(name, loaded)
        with self.connection.pipeline() as pipe:  # MULTI: replaced, never seen half written
            pipe.delete(keys.worker_models(self.name))
            pipe.sadd(keys.worker_models(self.name), *self.models)
            pipe.execute()
        self.connection.sadd(keys.WORKERS, self.name)
        self.beat()

    def publish_tokenizer(self, name: str, loaded: LoadedModel) -> bool:
        """Write `loaded`'s tokenizer blob under ``keys.tokenizer(sha256)`` unless it is there.

        EXISTS first: a re-register (every beat, after a Redis restart) sends the ~5 MB blob
        only when the key is gone. The blob is built on the first need (a slow step,
        docs/benchmarks.md) and kept. A write Redis refuses (maxmemory) is logged and
        retried next beat: serving jobs does not need it.

        Returns:
            Whether this call wrote the key.
        """
        key = keys.tokenizer(loaded.sha256)
        if self.connection.exists(key):
            return False
        blob = self._tokenizer_blobs.get(name)
        if blob is None:
            blob = self._tokenizer_blobs[name] = pack_tokenizer(loaded.tokenizer.published())
        try:
            return bool(self.connection.set(key, blob, nx=True))  # NX: another worker's wins
        except ResponseError as error:
            if not refused_write(error):
                raise
            log.warning("could not publish the tokenizer of %s (%d bytes): %s", name,
                        len(blob), error)
            return False

    def beat(self, connection=None) -> None:
        """Refresh the heartbeat key (through `connection`, default the worker's). Under
        ``maxmemory`` (the SET refused) its TTL is extended instead (EXPIRE is never
        refused), so a live worker is not reaped."""
        connection = connection or self.connection
        key = keys.worker_heartbeat(self.name)
        try:
            connection.set(key, now(), ex=self.ttl_s)
        except ResponseError as error:
            if not refused_write(error) or not connection.expire(key, self.ttl_s):
                raise

    def start(self) -> None:
        """Start the beat thread and the maintenance thread (daemons), each waking every
        ttl/6. The beat thread only SETs the heartbeat, so neither a long chunk nor a slow
        Redis's other round trips delay it. The maintenance thread registers again
        (restoring a Redis that lost its data), calls `on_beat` and reaps (two round trips
        when no worker died): a job waits on a dead worker at most one TTL and one interval.
        """
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._beat_loop, name="prefillq-heartbeat", daemon=True),
            threading.Thread(target=self._maintain_loop, name="prefillq-maintenance",
                             daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, join_s: float = 1.0) -> None:
        """Stop both threads, waiting up to `join_s` for each one's work in progress."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=join_s)

    def deregister(self) -> None:
        """Remove the heartbeat key, the models set and the worker from ``keys.WORKERS``."""
        self.connection.delete(keys.worker_heartbeat(self.name))
        self.connection.delete(keys.worker_models(self.name))
        self.connection.delete(keys.worker_tenants(self.name))
        self.connection.srem(keys.WORKERS, self.name)

    def _beat_loop(self) -> None:
        # The key outlives several missed beats; one SET each, nothing else on this thread,
        # on a connection of its own (a new one costs several round trips).
        beats = own_connection(self.connection)
        while True:  # the first beat at once: it opens the connection
            try:
                self.beat(beats)
            except Exception as error:  # a Redis outage must not kill the beat thread
                log.warning("heartbeat failed (%s); retrying", error,
                            exc_info=not refused_write(error))
            if self._stop.wait(self.ttl_s / 6):
                break
        if beats is not self.connection:
            beats.close()

    def _maintain_loop(self) -> None:
        # Dead workers are looked for as often as the worker beats.
        while not self._stop.wait(self.ttl_s / 6):
            try:
                self.register_models()  # idempotent; restores a Redis that lost its data
                if self.on_beat is not None:
                    self.on_beat()
                reap(self.connection, result_ttl_s=self.result_ttl_s)
            except Exception as error:  # a Redis outage must not kill the thread
                log.warning("registration or reap failed (%s); retrying", error,
                            exc_info=not refused_write(error))


def own_connection(connection):
    """A client of `connection`'s server on a pool of its own, with the same options (the
    retry policy included), or `connection` itself where its pool cannot be copied."""
    pool = getattr(connection, "connection_pool", None)
    try:
        copy = type(pool)(connection_class=pool.connection_class, **pool.connection_kwargs)
        return type(connection)(connection_pool=copy)
    except Exception:  # a client of another kind: share it
        return connection
