"""Liveness: model registration, the heartbeat thread and the periodic reap.

A worker advertises its models (vocab, context) under ``keys.MODELS`` so clients can
validate submits, and their names under ``keys.worker_models(name)`` (live workers per
model, `jobs.stats`), and keeps ``keys.worker_heartbeat(name)`` alive from its own thread
(every ttl/6, so a long chunk never delays it). Every beat it also runs the reaper
(`jobs.reaper.reap`: two round trips when no worker died, SMEMBERS and an EXISTS per
registered worker), which requeues the jobs of workers whose heartbeat expired and moves
the jobs routed to them to intake: a job waits on a dead worker at most one heartbeat TTL
and one beat.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from jobs import keys
from jobs.reaper import reap
from jobs.schema import now
from jobs.serializer import packb
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
    """

    def __init__(self, connection, name: str, models: Mapping[str, LoadedModel], *,
                 ttl_s: int, result_ttl_s: int, on_beat: Callable[[], None] | None = None):
        self.connection, self.name, self.models = connection, name, models
        self.ttl_s = max(1, ttl_s)
        self.result_ttl_s = result_ttl_s
        self.on_beat = on_beat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register_models(self) -> None:
        """Advertise the models (vocab, context) so clients can validate submits, and which
        this worker serves; beat."""
        for name, loaded in self.models.items():
            info = {
                "vocab_size": loaded.vocab_size,
                "context_length": loaded.context_length,
                "architecture": loaded.architecture,
                "sha256": loaded.sha256,
            }
            self.connection.hset(keys.MODELS, name, packb(info))
        with self.connection.pipeline() as pipe:  # MULTI: replaced, never seen half written
            pipe.delete(keys.worker_models(self.name))
            pipe.sadd(keys.worker_models(self.name), *self.models)
            pipe.execute()
        self.connection.sadd(keys.WORKERS, self.name)
        self.beat()

    def beat(self) -> None:
        self.connection.set(keys.worker_heartbeat(self.name), now(), ex=self.ttl_s)

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
                self.register_models()  # idempotent; restores a Redis that lost its data
                if self.on_beat is not None:
                    self.on_beat()
                reap(self.connection, result_ttl_s=self.result_ttl_s)
            except Exception as error:  # a Redis outage must not kill the beat thread
                log.warning("heartbeat or reap failed (%s); retrying", error,
                            exc_info=not refused_write(error))
