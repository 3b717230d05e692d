"""A Redis that answers slowly: worker processes and clients reach a real redis-server
through `DelayProxy`, 200 ms each way (400 ms a round trip, a fifth of the test workers'
2 s heartbeat TTL). Nothing times out wrongly: no live worker's heartbeat key lapses (a
watcher on a direct connection looks every 50 ms), every job runs its one attempt, none is
lost, and each finishes exactly once with the one-pass logits."""

from __future__ import annotations

import collections
import re
import threading
import time

import numpy as np
import pytest
import redis

from jobs import PrefillClient, keys
from tests.integration.processes import MODEL, ids

from .proxy import DelayProxy

DELAY_S = 0.2


@pytest.fixture
def proxy(server):
    p = DelayProxy("127.0.0.1", server.port, 0.0).start()
    yield p
    p.stop()


class LapseWatcher:
    """Looks at the workers' heartbeat keys every 50 ms on a direct connection; `lapses`
    lists the (worker, monotonic time) of every look that found one missing."""

    def __init__(self, url: str, names: list[str]):
        self.lapses: list[tuple[str, float]] = []
        self._conn = redis.Redis.from_url(url)
        self._names = names
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            for name in self._names:
                if not self._conn.exists(keys.worker_heartbeat(name)):
                    self.lapses.append((name, time.monotonic()))

    def stop(self) -> list[tuple[str, float]]:
        self._stop.set()
        self._thread.join(5)
        return self.lapses


@pytest.mark.parametrize("lengths", [
    pytest.param((4, 12), id="2-jobs"),
    pytest.param((4, 9, 12, 7, 5, 10), id="6-jobs", marks=pytest.mark.long),
])
def test_jobs_through_a_slow_redis_finish_once_on_their_first_attempt(
        server, proxy, workers, tiny, lengths):
    names = ["w1", "w2"]
    procs = [workers(name, "--max-active", "2", url=proxy.url) for name in names]
    client = PrefillClient.from_url(proxy.url)
    prompts = [ids(n, 200 + seed) for seed, n in enumerate(lengths)]  # 1 to 3 chunks of 4
    # the one-pass logits first: the proxy's threads share this process, so no MLX work of
    # the test may hold them up while the watcher looks
    expected = [tiny.start_prefill(token_ids).run() for token_ids in prompts]
    proxy.delay_s = DELAY_S  # slow from here on: the workers' connections are open already
    watcher = LapseWatcher(server.url, names)
    jobs = {client.submit(tokens=token_ids, model=MODEL, top_k=3, logits="full"): i
            for i, token_ids in enumerate(prompts)}
    for job, i in jobs.items():
        result = client.result(job, timeout=300)
        got = np.frombuffer(result.logits, dtype=np.float32)
        assert np.abs(got - expected[i]).max() <= 1e-3 * np.abs(expected[i]).max()
        assert client.status(job).attempts == 1, f"{job} was restarted"
    assert watcher.stop() == [], "a live worker's heartbeat lapsed"
    finished = collections.Counter()
    for p in procs:
        finished.update(re.findall(r"job (\w+) finished:", p.text()))
        assert p.proc.poll() is None
    assert finished == collections.Counter(list(jobs))  # each published once
