"""An in-process worker and its clients on one Redis server, for ``prefillq run`` and bench.

`prefillq run` without ``--redis`` serves one prompt on an embedded queue: an in-process
fakeredis server (the ``lua`` extra runs our scripts) and this process's own worker, so it
needs no Redis server. The benchmarks use the same wiring on a real redis-server.

Its worker publishes no tokenizers: only this process reads the queue, and building the
blob would slow every ``prefillq run`` (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from redis import Redis

from jobs import PrefillClient

from .settings import WorkerSettings
from .worker import PrefillWorker

EMBEDDED_WORKER_NAME = "embedded"


def fakeredis_connections() -> Callable[[], Redis]:
    """A factory of connections to one new in-process fakeredis server."""
    import fakeredis

    server = fakeredis.FakeServer()
    return lambda: fakeredis.FakeStrictRedis(server=server)


def url_connections(url: str) -> Callable[[], Redis]:
    """A factory of connections to the Redis at `url`."""
    return lambda: Redis.from_url(url)


@dataclass
class EmbeddedQueue:
    """A registered in-process `worker` and a `connect` factory for clients of its server."""

    worker: PrefillWorker
    connect: Callable[[], Redis]

    def client(self) -> PrefillClient:
        """A client on its own connection (one per thread)."""
        return PrefillClient(self.connect())

    def drain(self) -> None:
        """Run the worker in this thread until every queue it serves is empty."""
        self.worker.work(burst=True, logging_level="WARNING")


def embedded_queue(models: dict, connect: Callable[[], Redis] | None = None, *,
                   name: str = EMBEDDED_WORKER_NAME,
                   settings: WorkerSettings | None = None) -> EmbeddedQueue:
    """Start an embedded queue serving `models` (`model.registry.LoadedModel` by name).

    Args:
        connect: connection factory (default: a new fakeredis server).
        name: the worker's name.
        settings: the worker's settings (default: the defaults, without publishing
            tokenizers).
    """
    connect = connect or fakeredis_connections()
    settings = settings or WorkerSettings(publish_tokenizers=False)
    worker = PrefillWorker(models, connect(), settings, name=name)
    worker.register_models()
    return EmbeddedQueue(worker, connect)
