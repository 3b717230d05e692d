"""python -m bench.system_prompt [--model gemma3-tiny] [--jobs 200] [--workers 3]
                                [--system-tokens 2000] [--rounds 1]
                                [--prefix-cache-bytes B] [--seed N] [--logs DIR] [--json]
                                [--out FILE]

A chat backend's traffic: every job is one shared system prompt (`--system-tokens`, BOS then
random ids) plus its own user message (50-150 random ids), submitted as token ids through
the native client, served by `--workers` ``prefillq worker`` processes on one redis-server
(issue 27's shared-system-prompt benchmark). Each arm starts fresh workers on a flushed
Redis: ``off`` with ``--prefix-cache-bytes 0``, ``on`` with `--prefix-cache-bytes`; arms
alternate over `--rounds`. An arm first runs one job (the system prompt served once before,
as in a running backend: with the cache on, a worker keeps it and publishes routing
entries), then submits `--jobs` jobs at once and waits for every result.

Records (JSON lines): per arm and round ``system_prompt_mean_s`` (mean seconds from a job's
submit to its result), with the hit rate (jobs whose status says ``reuse`` ``prefix``), the
jobs routed to a holder's own queue at submit, and the prompt tokens computed over
submitted; then ``system_prompt_speedup`` (the off arm's mean time to result over the on
arm's, median over rounds; issue 27's floor 5 on a CPU).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from jobs import PrefillClient, keys
from jobs.queues import rq_queue_key
from worker.redis_server import RedisServer

from .cache_arms import MODEL, add_arm_flags, alternate, log_bounds, served_name, vocab_size
from .common import Recorder, bench_parser, log, machine_context, refuse_existing
from .gateway import _spawn, _wait
from .load import TOKEN_IDS

USER_TOKENS = (50, 150)
CPU_FLOOR = 5.0  # issue 27: mean time to result, cache off over on, on a CPU


@dataclass(frozen=True)
class ArmRun:
    """One arm's run: the mean seconds to result, hits, routed jobs and tokens."""

    name: str
    round: int
    jobs: int
    mean_s: float
    hits: int
    routed: int
    submitted_tokens: int
    cached_tokens: int


def plan_jobs(jobs: int, system_tokens: int, model: str, vocab_size: int, seed: int
              ) -> tuple[list[int], list[list[int]]]:
    """The system prompt and each job's whole prompt (system prompt + user message)."""
    rng = random.Random(seed)
    lo, hi = TOKEN_IDS if model == MODEL else (3, vocab_size)
    system = [2, *(rng.randrange(lo, hi) for _ in range(system_tokens - 1))]
    prompts = [system + [rng.randrange(lo, hi) for _ in range(rng.randint(*USER_TOKENS))]
               for _ in range(jobs)]
    return system, prompts


def routed_jobs(conn: redis.Redis, workers: list[str]) -> int:
    """Jobs waiting in the workers' own queues (routed there at submit)."""
    return sum(conn.llen(rq_queue_key(keys.own_queue(w))) for w in workers)


def run_arm(server: RedisServer, name: str, round_: int, model: str, cache_bytes: int,
            n_workers: int, system: list[int], prompts: list[list[int]], logs: Path
            ) -> ArmRun:
    """Fresh workers on a flushed Redis, one warm-up job on the system prompt, then every
    job submitted at once and each result waited for."""
    conn = redis.Redis.from_url(server.url)
    conn.flushall()
    workers = [f"s-{name}-{round_}-{i}" for i in range(n_workers)]
    served = served_name(model)
    procs = [_spawn(["worker", "--redis", server.url, "--name", w, "--model", model,
                     "--prefix-cache-bytes", str(cache_bytes)], logs / f"{w}.log")
             for w in workers]
    try:
        for w in workers:
            _wait(lambda w=w: conn.exists(keys.worker_heartbeat(w)), 300, f"worker {w}")
        client = PrefillClient.from_url(server.url)
        warm = client.submit(tokens=system + [TOKEN_IDS[0]], model=served, top_k=1)
        client.result(warm, timeout=600)
        submitted_at, job_ids = [], []
        for ids in prompts:
            submitted_at.append(time.perf_counter())
            job_ids.append(client.submit(tokens=ids, model=served, top_k=1))
        routed = routed_jobs(conn, workers)
        waits = []
        for job_id, t0 in zip(job_ids, submitted_at, strict=True):
            for status in client.watch(job_id, timeout=3600):
                if status.state.is_terminal:
                    waits.append(time.perf_counter() - t0)  # within a watch wake of it
        statuses = [client.status(j) for j in job_ids]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    hits = sum(s.reuse == "prefix" for s in statuses)
    run = ArmRun(name, round_, len(statuses), statistics.fmean(waits), hits, routed,
                 sum(s.n_tokens for s in statuses), sum(s.cached_tokens for s in statuses))
    log(f"system prompt: round {round_} {name}: mean {run.mean_s:.2f} s to result, "
        f"{hits} hits, {routed} routed")
    return run


def report(rec: Recorder, runs: list[ArmRun], on_cpu: bool) -> None:
    """The records the module docstring lists."""
    for run in runs:
        rec("system_prompt_mean_s", run.mean_s, "s", arm=run.name, round=run.round,
            hit_rate=round(run.hits / run.jobs, 4),
            routed=run.routed, prompt_tokens=run.submitted_tokens,
            cached_tokens=run.cached_tokens,
            computed_over_submitted=round(1 - run.cached_tokens / run.submitted_tokens, 4))
    off = [r for r in runs if r.name == "off"]
    on = [r for r in runs if r.name == "on"]
    ratios = [a.mean_s / b.mean_s for a, b in zip(off, on, strict=True)]
    floor = {"floor": CPU_FLOOR} if on_cpu else {}
    rec("system_prompt_speedup", statistics.median(ratios), "ratio", **floor,
        per_round=[round(x, 3) for x in ratios],
        how="mean seconds from submit to result with the prefix cache off over on, the same "
            "jobs, median of the rounds' ratios")


def build_parser():
    p = bench_parser("python -m bench.system_prompt", __doc__)
    p.add_argument("--jobs", type=int, default=200, help="jobs an arm (default 200)")
    p.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--system-tokens", type=int, default=2000,
                   help="the system prompt's tokens, BOS included (default 2000)")
    add_arm_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx

    p = build_parser()
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    system, prompts = plan_jobs(args.jobs, args.system_tokens, args.model,
                                vocab_size(args.model), args.seed)
    context = machine_context("system_prompt", redis=True) | {
        "model": args.model, "jobs": args.jobs, "workers": args.workers,
        "system_tokens": args.system_tokens, "user_tokens": USER_TOKENS,
        "rounds": args.rounds, "seed": args.seed, "prefix_cache_bytes": args.prefix_cache_bytes,
        "submit": "token ids through PrefillClient, all at once after one warm-up job"}
    rec = Recorder(args.json, context, args.out)
    runs = alternate(args, lambda server, name, round_, cache_bytes, logs: run_arm(
        server, name, round_, args.model, cache_bytes, args.workers, system, prompts, logs))
    report(rec, runs, on_cpu=mx.default_device() == mx.cpu)
    log_bounds(rec)
    return 0


if __name__ == "__main__":
    from model.runtime.blas import ensure_blas

    ensure_blas()
    raise SystemExit(main())
