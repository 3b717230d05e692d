"""Redis restarts under load (jobs finished, in flight and queued; two worker processes),
with AOF persistence on and off. Workers ride out the outage and serve on; with AOF every
job finishes exactly once with the one-pass logits and the finished ones keep their results;
without it every record is gone (`JobNotFound`, never a crash) and new jobs work.
"""

from __future__ import annotations

import collections
import re
import threading
import time

import numpy as np
import pytest

from jobs import JobNotFound, JobState, PrefillClient, keys
from tests.integration.processes import MODEL, ids, wait_for
from worker.redis_server import RedisServer

WORKER_ARGS = ("--max-active", "2", "--checkpoint-every", "3")


@pytest.fixture(params=[True, False], ids=["aof", "no-persistence"])
def redis(request, tmp_path):
    srv = RedisServer(tmp_path / "redis", appendonly=request.param)
    srv.workdir.mkdir()
    yield srv.start()
    srv.stop()


def assert_exact(result, tiny, token_ids) -> None:
    expected = tiny.start_prefill(token_ids).run()
    got = np.frombuffer(result.logits, dtype=np.float32)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max()


def publishes(procs) -> collections.Counter:
    """Successful publishes per job, from the workers' logs."""
    counts = collections.Counter()
    for p in procs:
        counts.update(m.group(1) for m in re.finditer(r"job (\w+) finished:", p.text()))
    return counts


def test_a_redis_restart_under_load(redis, workers, tiny):
    client = PrefillClient.from_url(redis.url)
    procs = [workers(f"w{i}", *WORKER_ARGS, url=redis.url) for i in (1, 2)]
    done = {client.submit(tokens=t, model=MODEL, top_k=1, logits="full"): t
            for t in (ids(30, 1), ids(34, 2))}
    for job in done:
        client.result(job, timeout=60)
    load = {}
    for seed in range(6):
        token_ids = ids(400 + 50 * seed, 10 + seed)
        load[client.submit(tokens=token_ids, model=MODEL, top_k=1, logits="full")] = token_ids

    def in_flight() -> bool:
        states = [client.redis.hmget(keys.job(j), "state", "cursor") for j in load]
        running = [s for s in states if s[0] == b"prefilling" and int(s[1] or 0) > 0]
        return len(running) >= 2 and any(s[0] == b"queued" for s in states)

    wait_for(in_flight, 60, "the load never got under way")
    waiter = Waiter(client, next(iter(load)))
    redis.stop()
    time.sleep(1.0)  # an outage the workers notice, not just a reconnect
    redis.start()

    if redis.appendonly:
        for job, token_ids in {**done, **load}.items():
            assert_exact(client.result(job, timeout=180), tiny, token_ids)
            assert client.status(job).state == JobState.FINISHED
        assert set(publishes(procs).values()) == {1}
        assert set(publishes(procs)) == set(done) | set(load)
        assert waiter.outcome(timeout=60) == "finished"
    else:
        for job in {**done, **load}:
            with pytest.raises(JobNotFound):
                client.status(job)
            with pytest.raises(JobNotFound):
                client.result(job, timeout=1)
        assert waiter.outcome(timeout=60) == "JobNotFound"
        wait_for(lambda: client.redis.hexists(keys.MODELS, MODEL), 30, "no re-registration")

    after = {client.submit(tokens=t, model=MODEL, top_k=1, logits="full"): t
             for t in (ids(40, 50), ids(44, 51))}
    for job, token_ids in after.items():
        assert_exact(client.result(job, timeout=60), tiny, token_ids)
    assert all(p.proc.poll() is None for p in procs), "a worker died"


class Waiter:
    """A client blocked in `result` across the restart, on a thread; `outcome` says how it
    ended: ``finished``, or the name of what it raised."""

    def __init__(self, client: PrefillClient, job: str):
        self._ended: list[str] = []
        self._thread = threading.Thread(target=self._wait, args=(client, job), daemon=True)
        self._thread.start()

    def _wait(self, client: PrefillClient, job: str) -> None:
        try:
            client.result(job, timeout=180)
            self._ended.append("finished")
        except Exception as error:
            self._ended.append(type(error).__name__)

    def outcome(self, timeout: float) -> str:
        self._thread.join(timeout)
        assert self._ended, "the waiter is still blocked"
        return self._ended[0]


@pytest.mark.long
def test_repeated_redis_restarts_with_aof(tmp_path, workers, tiny):
    srv = RedisServer(tmp_path / "redis", appendonly=True)
    srv.workdir.mkdir()
    srv.start()
    try:
        client = PrefillClient.from_url(srv.url)
        procs = [workers(f"w{i}", *WORKER_ARGS, url=srv.url) for i in (1, 2, 3)]
        load = {}
        for seed in range(12):
            token_ids = ids(300 + 100 * seed, 30 + seed)
            load[client.submit(tokens=token_ids, model=MODEL, top_k=1, logits="full")] = \
                token_ids
        for _ in range(3):
            wait_for(lambda: any(client.redis.hget(keys.job(j), "state") == b"prefilling"
                                 for j in load), 120, "nothing in flight")
            srv.stop()
            time.sleep(1.0)
            srv.start()
        for job, token_ids in load.items():
            assert_exact(client.result(job, timeout=300), tiny, token_ids)
        assert publishes(procs) == collections.Counter(list(load))
        assert all(p.proc.poll() is None for p in procs)
    finally:
        srv.stop()
