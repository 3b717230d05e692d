"""Worker processes against a real redis-server: SIGKILL and the reaper, SIGTERM hand-back,
three workers sharing 30 jobs, a Redis restart under a running worker.

Workers run the tiny Gemma 3 (`gemma3-tiny`) with 4-token chunks so a prefill lasts long
enough to be interrupted, and a 2 s heartbeat TTL so dead workers are found quickly.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import redis

from jobs import JobState, PrefillClient, keys
from jobs.reaper import reap
from jobs.serializer import packb
from tests.conftest import RedisServer

from .processes import MODEL, WorkerProcess, expected_top, ids, long_job_in_flight, wait_for


def test_sigkill_mid_prefill_then_a_second_worker_finishes_it(server, workers, tiny):
    client = PrefillClient.from_url(server.url)
    w1 = workers("w1")
    job, token_ids = long_job_in_flight(client, w1, 0, top_k=5, logits="full")
    w1.signal(signal.SIGKILL)
    w1.wait()
    killed_at = client.status(job)
    assert killed_at.state == JobState.PREFILLING and killed_at.worker == "w1"

    workers("w2")  # its reaper finds w1's heartbeat gone and requeues the job
    result = client.result(job, timeout=120)
    status = client.status(job)
    assert (status.state, status.attempts, status.worker) == (JobState.FINISHED, 2, "w2")
    top, logits = expected_top(tiny, token_ids, 5)
    assert [t.id for t in result.top_k] == top
    got = np.frombuffer(result.logits, dtype=np.float32)
    assert np.abs(got - logits).max() <= 1e-3 * np.abs(logits).max()
    assert not client.redis.sismember(keys.WORKERS, "w1")


def test_sigterm_hands_active_jobs_back_and_exits_zero(server, workers, tiny):
    client = PrefillClient.from_url(server.url)
    w1 = workers("w1")
    job, token_ids = long_job_in_flight(client, w1, 1, top_k=3)
    w1.signal(signal.SIGTERM)
    assert w1.wait() == 0
    status = client.status(job)
    assert (status.state, status.cursor, status.attempts) == (JobState.QUEUED, 0, 1)
    assert client.redis.exists(keys.worker_heartbeat("w1")) == 0
    assert not client.redis.sismember(keys.WORKERS, "w1")
    assert "handed back: queued" in w1.text()

    workers("w2")
    result = client.result(job, timeout=120)
    assert client.status(job).attempts == 2
    assert [t.id for t in result.top_k] == expected_top(tiny, token_ids, 3)[0]


def test_three_workers_finish_thirty_jobs_exactly_once(server, workers):
    client = PrefillClient.from_url(server.url)
    procs = [workers(f"w{i}", "--max-active", "2") for i in range(3)]
    jobs = [client.submit(tokens=ids(40 + 7 * i, 100 + i), model=MODEL, top_k=1)
            for i in range(30)]
    for job in jobs:
        client.result(job, timeout=180)
    for p in procs:
        p.signal(signal.SIGTERM)
        assert p.wait() == 0
    finished = collections.Counter()
    ran_on = collections.defaultdict(set)
    for p in procs:
        for m in re.finditer(r"job (\w+) finished:", p.text()):
            finished[m.group(1)] += 1
        for m in re.finditer(r"job (\w+) chunk \d+:", p.text()):
            ran_on[m.group(1)].add(p.name)
    assert set(finished) == set(jobs)
    assert set(finished.values()) == {1}, "a job was published twice"
    assert all(len(ran_on[j]) == 1 for j in jobs), "a continuation left its cache's worker"
    assert all(client.status(j).attempts == 1 for j in jobs)
    assert len({name for names in ran_on.values() for name in names}) == 3


def test_worker_survives_a_redis_restart_and_resumes(server, workers, tiny):
    client = PrefillClient.from_url(server.url)
    w1 = workers("w1")
    job, token_ids = long_job_in_flight(client, w1, 2, top_k=3)
    server.stop()
    time.sleep(1.0)
    server.start()  # AOF on: the job's record and queues survive

    result = client.result(job, timeout=120)
    assert [t.id for t in result.top_k] == expected_top(tiny, token_ids, 3)[0]
    assert client.status(job).attempts == 1, "the worker kept its cache across the outage"
    after = client.submit(tokens=ids(30, 3), model=MODEL, top_k=1)
    assert client.result(after, timeout=60).n_tokens == 30
    assert w1.proc.poll() is None, "the worker is still running"


def test_sigterm_with_redis_gone_exits_non_zero_within_a_heartbeat_ttl(server, tmp_path):
    client = PrefillClient.from_url(server.url)
    w1 = WorkerProcess(server.url, "w1", tmp_path)
    try:
        long_job_in_flight(client, w1, 8)
        server.stop()
        time.sleep(1.0)  # the worker is retrying now
        assert w1.proc.poll() is None
        signaled = time.monotonic()
        w1.signal(signal.SIGTERM)
        code = w1.wait(timeout=30)
        took = time.monotonic() - signaled
    finally:
        w1.stop()
    assert code != 0
    assert took <= 2 + 5, f"exited {took:.1f} s after SIGTERM (heartbeat TTL 2 s)"
    last = w1.text().strip().splitlines()[-1]
    assert last == ("prefillq: error: Redis unreachable for 2 s after SIGTERM; exiting without "
                    "handing back 1 job (the reaper will requeue them)")


def test_worker_carries_on_when_a_redis_restart_lost_everything(tmp_path, workers):
    srv = RedisServer(tmp_path / "volatile", appendonly=False)
    os.makedirs(srv.workdir)
    srv.start()
    try:
        w1 = WorkerProcess(srv.url, "w1", tmp_path)
        client = PrefillClient.from_url(srv.url)
        long_job_in_flight(client, w1, 4)
        srv.stop()
        time.sleep(1.0)
        srv.start()  # empty: the job's record is gone
        # the worker re-registers its model on its next heartbeat, then serves new jobs
        wait_for(lambda: client.redis.hexists(keys.MODELS, MODEL), 30, "no re-registration", w1)
        after = client.submit(tokens=ids(30, 5), model=MODEL, top_k=1)
        assert client.result(after, timeout=60).n_tokens == 30
        assert w1.proc.poll() is None
        w1.signal(signal.SIGTERM)
        assert w1.wait() == 0
    finally:
        srv.stop()


def test_reap_cli_requeues_then_fails_a_dead_workers_job(redis_server):
    conn = redis.Redis.from_url(redis_server)
    conn.flushall()
    info = {"vocab_size": 365, "context_length": 4096, "architecture": "gemma3", "sha256": ""}
    conn.hset(keys.MODELS, MODEL, packb(info))  # as a worker registers it
    client = PrefillClient(conn)
    job = client.submit(tokens=ids(20, 6), model=MODEL, max_attempts=2)
    for attempt, expected in ((1, "queued"), (2, "failed")):
        # a worker takes the job, then dies without a heartbeat
        conn.hset(keys.job(job), mapping={"state": "prefilling", "worker": "ghost",
                                          "attempts": attempt})
        conn.sadd(keys.WORKERS, "ghost")
        conn.sadd(keys.worker_jobs("ghost"), job)
        proc = subprocess.run([sys.executable, "-m", "worker", "reap", "--redis", redis_server],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert f"{job}: {expected} (worker ghost)" in proc.stdout
        assert client.status(job).state == JobState(expected)
        assert not conn.sismember(keys.WORKERS, "ghost")
    assert client.status(job).error == {
        "type": "WorkerLost",
        "message": "worker ghost stopped heartbeating while holding the job",
    }
    assert reap(conn) == []  # nothing left to reap
