"""Tenants through a real redis-server and a real worker process on the tiny Gemma 3
(`worker.fair_share`): a flooding tenant does not hold back another tenant's short job, and
backlogged tenants of weights 1:2:4 are served tokens in that ratio within the bound."""

from __future__ import annotations

import json
import subprocess
import time

import redis

from jobs import JobState, PrefillClient, keys
from jobs.stats import read_cluster_stats_sync
from tests.integration.processes import (
    MODEL,
    MODULE_MAIN,
    WorkerProcess,
    ids,
    redis_and_worker,
    wait_for,
)

CHUNK = 16
# the bound: two backlogged tenants' weighted tokens served differ by at most 2 steps'
# tokens; here a step is one chunk (--max-batch-jobs 1), and a snapshot of the cursors may
# miss one landed step of each tenant, so 2 + 1 chunks
BOUND_TOKENS = 3 * CHUNK


def cursors(conn, jobs: dict[str, list[str]]) -> dict[str, int]:
    """Each tenant's tokens prefilled so far (its jobs' cursors), read in one MULTI."""
    with conn.pipeline() as pipe:
        for job_ids in jobs.values():
            for job_id in job_ids:
                pipe.hget(keys.job(job_id), "cursor")
        values = iter(pipe.execute())
    return {tenant: sum(int(next(values) or 0) for _ in job_ids)
            for tenant, job_ids in jobs.items()}


def test_a_short_job_of_another_tenant_runs_beside_a_flood(tmp_path):
    args = ("--chunk-tokens", str(CHUNK), "--max-active", "2", "--max-batch-jobs", "1")
    with redis_and_worker(tmp_path, "wt1", *args) as (server, _):
        client = PrefillClient.from_url(server.url)
        conn = redis.Redis.from_url(server.url)
        flood = [client.submit(tokens=ids(1024, i), model=MODEL, tenant="flood")
                 for i in range(6)]  # 64 chunks each; 2 resident, 4 waiting
        wait_for(lambda: cursors(conn, {"f": flood})["f"] >= 4 * CHUNK, 60, "no flood chunks")
        before = cursors(conn, {"f": flood})["f"]
        short = client.submit(tokens=ids(40, 99), model=MODEL, tenant="short")
        assert client.result(short, timeout=60).n_tokens == 40
        during = cursors(conn, {"f": flood})["f"] - before
        print(f"measured {during // CHUNK} flood chunks while the short job ran")
        # it took a slot beyond --max-active at once and alternated with the flood: a few
        # flood chunks ran meanwhile (3 of its own, one admission, the watch's wake), where
        # first-in first-out would have run the 4 queued flood jobs' first chunks and the
        # 2 resident ones to their end (over 120) before it
        assert during <= 8 * CHUNK, during / CHUNK  # measured 4-5
        queued = [client.status(j) for j in flood[2:]]
        assert all(s.state == JobState.QUEUED for s in queued), [s.state for s in queued]
        for job_id in flood:
            client.cancel(job_id)


def test_weighted_tenants_are_served_tokens_in_their_weights_ratio(tmp_path):
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
    args = ("--chunk-tokens", str(CHUNK), "--max-active", "2", "--max-batch-jobs", "1",
            "--tenant-weights", ",".join(f"{t}={w:g}" for t, w in weights.items()))
    with redis_and_worker(tmp_path, "wt2", *args) as (server, _):
        client = PrefillClient.from_url(server.url)
        conn = redis.Redis.from_url(server.url)
        jobs = {t: [client.submit(tokens=ids(2048, 10 * k + i), model=MODEL, tenant=t)
                    for i in range(2)] for k, t in enumerate(weights)}
        # every tenant resident (2 slots, then one beyond for each newcomer) and served
        wait_for(lambda: min(cursors(conn, jobs).values()) >= 2 * CHUNK, 60,
                 "not every tenant was served")
        start = cursors(conn, jobs)
        time.sleep(1.0)
        end = cursors(conn, jobs)
        served = {t: end[t] - start[t] for t in weights}
        assert min(end[t] for t in weights) < 2048  # each still backlogged at the end
        weighted = [served[t] / w for t, w in weights.items()]
        print(f"measured served {served}, weighted spread {max(weighted) - min(weighted)}")
        assert max(weighted) - min(weighted) <= BOUND_TOKENS, served
        assert served["w4"] >= 8 * CHUNK, served  # the interval held many steps
        tenants = read_cluster_stats_sync(conn).tenants  # what /metrics shows of them
        assert all(tenants[t].prefilling >= 1 and tenants[t].tokens_prefilled >= end[t]
                   for t in weights), tenants
        shown = subprocess.run([*MODULE_MAIN, "tenants", "--redis", server.url, "--json"],
                               capture_output=True, text=True, check=True).stdout
        rows = {r["tenant"]: r for r in json.loads(shown)["tenants"]}
        assert rows["w4"]["weight"] is None  # --tenant-weights is the worker's; not the hash
        assert rows["w4"]["prefilling"] >= 1 and rows["w1"]["tokens_prefilled"] > 0
        for job_ids in jobs.values():
            for job_id in job_ids:
                client.cancel(job_id)


def test_two_workers_share_the_counters_so_the_weights_hold_for_the_cluster(tmp_path):
    weights = {"a": 1.0, "b": 3.0}
    args = ("--chunk-tokens", str(CHUNK), "--max-active", "2", "--max-batch-jobs", "1",
            "--tenant-weights", "b=3")
    with redis_and_worker(tmp_path, "wc1", *args) as (server, _):
        second = WorkerProcess(server.url, "wc2", tmp_path, *args)
        try:
            client = PrefillClient.from_url(server.url)
            conn = redis.Redis.from_url(server.url)
            jobs = {t: [client.submit(tokens=ids(2048, 20 * k + i), model=MODEL, tenant=t)
                        for i in range(4)] for k, t in enumerate(weights)}
            wait_for(lambda: min(cursors(conn, jobs).values()) >= 4 * CHUNK, 60,
                     "not every tenant was served")
            start = cursors(conn, jobs)
            time.sleep(1.0)
            end = cursors(conn, jobs)
            served = {t: end[t] - start[t] for t in weights}
            weighted = [served[t] / w for t, w in weights.items()]
            print(f"measured served {served}, weighted spread {max(weighted) - min(weighted)}")
            # the bound a worker, twice, and a chunk of each worker's snapshot skew
            assert max(weighted) - min(weighted) <= 2 * BOUND_TOKENS, served
            assert served["b"] >= 8 * CHUNK, served
            for job_ids in jobs.values():
                for job_id in job_ids:
                    client.cancel(job_id)
        finally:
            second.stop()
