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


def weighted_spread(url: str, weights: dict[str, float], jobs_each: int, seed: int
                    ) -> tuple[dict[str, list[str]], dict[str, int], dict[str, int]]:
    """Submit `jobs_each` 2,048-token jobs per tenant of `weights`; once every tenant has
    been served a few chunks, the tokens each is served over one second. Returns the jobs,
    the cursors at the end, and the tokens served in the second (all still backlogged)."""
    client = PrefillClient.from_url(url)
    conn = redis.Redis.from_url(url)
    jobs = {t: [client.submit(tokens=ids(2048, seed + 10 * k + i), model=MODEL, tenant=t)
                for i in range(jobs_each)] for k, t in enumerate(weights)}
    wait_for(lambda: min(cursors(conn, jobs).values()) >= 2 * CHUNK, 60,
             "not every tenant was served")
    start = cursors(conn, jobs)
    time.sleep(1.0)
    end = cursors(conn, jobs)
    served = {t: end[t] - start[t] for t in weights}
    assert min(end.values()) < 2048  # each still backlogged at the end
    print(f"measured served {served}, weighted spread {spread(served, weights)}")
    return jobs, end, served


def cancel_all(url: str, jobs: dict[str, list[str]]) -> None:
    client = PrefillClient.from_url(url)
    for job_ids in jobs.values():
        for job_id in job_ids:
            client.cancel(job_id)


def spread(served: dict[str, int], weights: dict[str, float]) -> float:
    weighted = [served[t] / w for t, w in weights.items()]
    return max(weighted) - min(weighted)


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
        # every tenant resident (2 slots, then one beyond for each newcomer) and served
        jobs, end, served = weighted_spread(server.url, weights, 2, seed=0)
        assert spread(served, weights) <= BOUND_TOKENS, served
        assert served["w4"] >= 8 * CHUNK, served  # the interval held many steps
        tenants = read_cluster_stats_sync(redis.Redis.from_url(server.url)).tenants  # /metrics
        assert all(tenants[t].prefilling >= 1 and tenants[t].tokens_prefilled >= end[t]
                   for t in weights), tenants
        shown = subprocess.run([*MODULE_MAIN, "tenants", "--redis", server.url, "--json"],
                               capture_output=True, text=True, check=True).stdout
        rows = {r["tenant"]: r for r in json.loads(shown)["tenants"]}
        assert rows["w4"]["weight"] is None  # --tenant-weights is the worker's; not the hash
        assert rows["w4"]["prefilling"] >= 1 and rows["w1"]["tokens_prefilled"] > 0
        cancel_all(server.url, jobs)


def test_two_workers_share_the_counters_so_the_weights_hold_for_the_cluster(tmp_path):
    weights = {"a": 1.0, "b": 3.0}
    args = ("--chunk-tokens", str(CHUNK), "--max-active", "2", "--max-batch-jobs", "1",
            "--tenant-weights", "b=3")
    with redis_and_worker(tmp_path, "wc1", *args) as (server, _):
        second = WorkerProcess(server.url, "wc2", tmp_path, *args)
        try:
            jobs, _, served = weighted_spread(server.url, weights, 4, seed=20)
            # the bound a worker, twice, and a chunk of each worker's snapshot skew
            assert spread(served, weights) <= 2 * BOUND_TOKENS, served
            assert served["b"] >= 8 * CHUNK, served
            cancel_all(server.url, jobs)
        finally:
            second.stop()
