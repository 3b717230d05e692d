"""Liveness: model registration, the heartbeat thread and the periodic reap.

A worker advertises its models (vocab, context) under ``keys.MODELS`` so clients can
validate submits, publishes each model's tokenizer under ``keys.tokenizer(sha256)`` once
(for clients that tokenize, `jobs.tokenizer`), records the names it serves under
``keys.worker_models(name)`` (live workers per model, `jobs.stats`), and keeps
``keys.worker_heartbeat(name)`` alive from its own thread (every ttl/6, so a long chunk
never delays it). Every beat it also runs the reaper (`jobs.reaper.reap`: two round trips
when no worker died, SMEMBERS and an EXISTS per registered worker), which requeues the jobs
of workers whose heartbeat expired and moves the jobs routed to them to intake: a job waits
on a dead worker at most one heartbeat TTL and one beat.
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
        on_beat: called after every beat from the beat thread (retries of writes that
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
        self._thread: threading.Thread | None = None

    def register_models(self) -> None:
        """Advertise the models (vocab, context) so clients can validate submits, and which
        this worker serves; publish their tokenizers where none is yet; beat."""
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
        only when the key is gone. The blob is built on the first need (~0.9 s for Gemma 3)
        and kept. A write Redis refuses (maxmemory) is logged and retried next beat: serving
        jobs does not need it.

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

    def beat(self) -> None:
        """Refresh the heartbeat key. Under ``maxmemory`` (the SET refused) its TTL is
        extended instead (EXPIRE is never refused), so a live worker is not reaped."""
        key = keys.worker_heartbeat(self.name)
        try:
            self.connection.set(key, now(), ex=self.ttl_s)
        except ResponseError as error:
            if not refused_write(error) or not self.connection.expire(key, self.ttl_s):
                raise

    def start(self) -> None:
        """Start the beat thread (a daemon)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="prefillq-heartbeat",
                                        daemon=True)
        self._thread.start()

    def stop(self, join_s: float = 1.0) -> None:
        """Stop the beat thread, waiting up to `join_s` for a beat in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=join_s)

    def deregister(self) -> None:
        """Remove the heartbeat key, the models set and the worker from ``keys.WORKERS``."""
        self.connection.delete(keys.worker_heartbeat(self.name))
        self.connection.delete(keys.worker_models(self.name))
        self.connection.srem(keys.WORKERS, self.name)

    def _loop(self) -> None:
        # The key outlives several missed beats; dead workers are looked for every beat.
        interval = self.ttl_s / 6
        while not self._stop.wait(interval):
            try:
                self.beat()  # first: at maxmemory the writes below are refused, this is not
                self.register_models()  # idempotent; restores a Redis that lost its data
                if self.on_beat is not None:
                    self.on_beat()
                reap(self.connection, result_ttl_s=self.result_ttl_s)
            except Exception as error:  # a Redis outage must not kill the beat thread
                log.warning("heartbeat or reap failed (%s); retrying", error,
                            exc_info=not refused_write(error))
