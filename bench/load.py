"""python -m bench.load [--jobs 1000] [--workers 3] [--model gemma3-tiny] [--json] [--out FILE]

Many jobs of mixed lengths through ``prefillq worker`` processes on one redis-server: that
every job finishes exactly once, jobs/s and latency per length class, and Redis memory
before, at its peak, and once the jobs' TTLs have expired (`run_load`).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis

from jobs import JobStatus, PrefillClient, keys, protocol, stats
from worker.redis_server import RedisServer

from .common import Recorder, bench_parser, log, machine_context, refuse_existing
from .observe import EventCounter, MemorySampler, keyspace, memory_now
from .scale import WorkerFleet

MODEL = "gemma3-tiny"
# Token lengths (inclusive) of each class, and the share of jobs in it.
LENGTH_CLASSES = {"short": (16, 64), "medium": (256, 512), "long": (1024, 2048)}
CLASS_SHARES = {"short": 0.5, "medium": 0.3, "long": 0.2}
# gemma3-tiny's vocabulary is 365 ids: plain tokens only, as tests/integration/processes.py
TOKEN_IDS = (260, 365)
# Every IDEMPOTENT_EVERY-th job carries an idempotency key and is submitted twice.
IDEMPOTENT_EVERY = 4
# 256-token chunks: a medium job takes 1-2 chunks and a long one 4-8, so long jobs share
# each worker's loop with the others (round-robin) instead of running in one piece.
CHUNK_TOKENS = 256
TTL_S = 5
# After the last record expired: Redis frees and shrinks in its cron (10 Hz) and resizes
# idle clients' buffers after 2 s idle.
SETTLE_S = 3.0


@dataclass(frozen=True)
class LoadConfig:
    """One load run.

    Attributes:
        jobs: jobs submitted. workers: ``prefillq worker`` processes. clients: submitting
        threads, a `PrefillClient` each. ttl_s: the workers' ``--result-ttl`` and
        ``--logits-ttl`` and the clients' ``result_ttl_s`` (seconds). timeout_s: the
        longest wait for a phase's jobs to end, and again for their records to expire.
        warmup_per_worker: jobs of the warm-up phase per worker. seed: the prompts' random
        seed.
    """

    jobs: int = 1000
    workers: int = 3
    model: str = MODEL
    clients: int = 2
    chunk_tokens: int = CHUNK_TOKENS
    ttl_s: int = TTL_S
    timeout_s: float = 3600.0
    warmup_per_worker: int = 4
    seed: int = 0

    @property
    def warmup_jobs(self) -> int:
        return self.warmup_per_worker * self.workers


@dataclass
class Phase:
    """What one phase saw. Memory in bytes, times in seconds.

    Attributes:
        classes: each job's length class, by job id (submit order).
        statuses: each job's status as its terminal message came (None: no record).
        events: messages per (job id, message) on the jobs' events channels.
        totals: how much each cluster counter grew in the phase (`ClusterStats.totals`).
        duplicate_ids: retried idempotent submits that got a different job id.
        peak: highest used_memory sampled while the jobs ran.
        memory: `memory_now` once every record had expired; keys: `keyspace` then.
        submit_s: submitting everything; ended_s: first submit to the last job's end;
        expired_s: from then until every record had expired.
    """

    classes: dict[str, str]
    statuses: dict[str, JobStatus | None]
    events: Counter
    totals: dict[str, int]
    duplicate_ids: int
    peak: int
    memory: dict[str, int]
    keys: dict[str, dict[str, int]]
    submit_s: float
    ended_s: float
    expired_s: float


@dataclass
class LoadRun:
    """A run: memory once the workers registered, the warm-up phase (whose end is the
    baseline), the measured phase, and the workers' exit codes after SIGTERM."""

    config: LoadConfig
    registered: dict[str, int]
    warmup: Phase
    load: Phase
    worker_exit_codes: list[int | None] = field(default_factory=list)

    @property
    def memory(self) -> dict[str, int]:
        """used_memory (bytes) at ``baseline`` (the warm-up's end), ``peak`` and ``after``."""
        return {"registered": self.registered["used_memory"],
                "baseline": self.warmup.memory["used_memory"], "peak": self.load.peak,
                "after": self.load.memory["used_memory"]}


def plan_jobs(jobs: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """`jobs` prompts as (length class, token ids), the classes in `CLASS_SHARES` (rounded)
    and shuffled, each prompt BOS then random plain ids, its length uniform in its class."""
    rng = random.Random(seed)
    counts = {c: round(jobs * share) for c, share in CLASS_SHARES.items()}
    counts["short"] += jobs - sum(counts.values())
    classes = [c for c, n in counts.items() for _ in range(n)]
    rng.shuffle(classes)
    out = []
    for c in classes:
        lo, hi = LENGTH_CLASSES[c]
        n = rng.randint(lo, hi)
        out.append((c, [2, *(rng.randrange(*TOKEN_IDS) for _ in range(n - 1))]))
    return out


def submit_all(url: str, cfg: LoadConfig, planned: list[tuple[str, list[int]]]
               ) -> tuple[list[str], int]:
    """Submit every planned prompt from `cfg.clients` threads (a connection and a
    contiguous share each, as fast as each can); every `IDEMPOTENT_EVERY`-th with an
    idempotency key, twice. The job ids in plan order, and how many retries got an id
    other than their first submit's."""
    ids: list[str] = [""] * len(planned)
    duplicates, errors = [0], []

    def run(share: range) -> None:
        client = PrefillClient.from_url(url, result_ttl_s=cfg.ttl_s)
        try:
            for i in share:
                submit = {"tokens": planned[i][1], "model": cfg.model, "top_k": 1}
                if i % IDEMPOTENT_EVERY == 0:
                    submit["idempotency_key"] = uuid.uuid4().hex
                ids[i] = client.submit(**submit)
                if "idempotency_key" in submit and client.submit(**submit) != ids[i]:
                    duplicates[0] += 1
        except BaseException as e:  # re-raised on the calling thread
            errors.append(e)
        finally:
            client.redis.close()

    step = -(-len(planned) // cfg.clients)
    threads = [threading.Thread(target=run, args=(range(k, min(k + step, len(planned))),))
               for k in range(0, len(planned), step)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return ids, duplicates[0]


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1) -> float:
    """Poll `predicate` until true; the seconds it took.

    Raises:
        TimeoutError: not true within `timeout_s` (the message says `what`).
    """
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        time.sleep(poll_s)
    return time.monotonic() - t0


def totals(conn: redis.Redis) -> dict[str, int]:
    """The cluster's job counters (`jobs.stats.ClusterStats.totals`)."""
    return stats.read_cluster_stats_sync(conn).totals()


def statuses_of(conn: redis.Redis, job_ids: list[str]) -> dict[str, JobStatus | None]:
    """Every job's status, one pipeline (None: no record, e.g. expired)."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        raw = pipe.execute()
    return {job_id: protocol.status_of(job_id, r) if r else None
            for job_id, r in zip(job_ids, raw, strict=True)}


def records_left(conn: redis.Redis, job_ids: list[str]) -> int:
    """How many of the jobs' records still exist."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.exists(keys.job(job_id))
        return sum(pipe.execute())


def run_phase(cfg: LoadConfig, url: str, conn: redis.Redis,
              planned: list[tuple[str, list[int]]]) -> Phase:
    """Submit `planned`, read each job's status as its terminal message comes, until the
    events and the counters both say every job ended; then wait for every record to
    expire, `SETTLE_S` more, and read the keys and memory.

    Raises:
        TimeoutError: the jobs did not all end, or their records expire, in `cfg.timeout_s`.
    """
    before, n = totals(conn), len(planned)
    ended_before = sum(before[s.value] for s in stats.TERMINAL_STATES)
    counter, sampler = EventCounter(conn), MemorySampler(url)
    statuses: dict[str, JobStatus | None] = {}

    def all_ended() -> bool:  # each status is read now, well inside its TTL
        statuses.update(statuses_of(conn, counter.take_ended()))
        ended = sum(totals(conn)[s.value] for s in stats.TERMINAL_STATES) - ended_before
        return len(statuses) >= n and ended >= n

    try:
        t0 = time.monotonic()
        job_ids, duplicates = submit_all(url, cfg, planned)
        submit_s = time.monotonic() - t0
        wait_until(all_ended, cfg.timeout_s, f"{n} jobs did not all end")
        ended_s = time.monotonic() - t0
        time.sleep(0.5)  # a second terminal message would come right after the first
        statuses.update(statuses_of(conn, counter.take_ended()))
        grown = {k: v - before[k] for k, v in totals(conn).items()}
    finally:
        events, peak = counter.stop(), sampler.stop()
    log(f"load: {n} jobs submitted in {submit_s:.1f} s, all ended after {ended_s:.1f} s")
    expired_s = wait_until(lambda: records_left(conn, job_ids) == 0, cfg.timeout_s,
                           "job records did not expire", poll_s=0.2)
    time.sleep(SETTLE_S)
    keys_left = keyspace(conn)  # before memory_now: its commands' first calls are counted
    return Phase(
        classes={j: c for j, (c, _) in zip(job_ids, planned, strict=True)}, statuses=statuses,
        events=events, totals=grown, duplicate_ids=duplicates, peak=peak,
        memory=memory_now(conn), keys=keys_left, submit_s=submit_s, ended_s=ended_s,
        expired_s=expired_s)


def run_load(cfg: LoadConfig, log_dir: Path) -> LoadRun:
    """Start redis-server and `cfg.workers` workers, run the warm-up and the measured
    phase (`run_phase`), stop the workers (SIGTERM) and the server.

    Raises:
        RuntimeError: a worker did not register.
        TimeoutError: a phase's jobs did not all end, or their records expire, in time.

    Each phase subscribes to every job's events channel (``prefillq:*:events``, counted per
    job), submits from `cfg.clients` threads, reads each job's status as its terminal message
    comes, waits for every job to end and then for every record to expire (short
    ``--result-ttl``/``--logits-ttl``), and reads memory and the keys left. The warm-up (4 jobs
    per worker, so a worker also admits between chunks) comes first: Redis allocates some
    memory once, at a command's first call or a queue's first job, so the baseline is taken
    after it. Memory is compared apart from the connections' buffers too
    (`bench.observe.memory_now`); latency is a job's ``finished_at`` minus its ``enqueued_at``.
    Run it with the OpenBLAS env (``env $(python -m model.runtime.blas)``); workers inherit it.
    """
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        fleet = WorkerFleet(server.url, cfg.workers, log_dir, cfg.model, worker_args(cfg))
        try:
            fleet.wait_registered(conn)
            registered = memory_now(conn)
            warmup = run_phase(cfg, server.url, conn, plan_jobs(cfg.warmup_jobs, -1 - cfg.seed))
            log(f"load: warm-up done; baseline {warmup.memory['used_memory']} bytes")
            load = run_phase(cfg, server.url, conn, plan_jobs(cfg.jobs, cfg.seed))
        finally:
            codes = fleet.stop()
    return LoadRun(cfg, registered, warmup, load, codes)


def worker_args(cfg: LoadConfig) -> list[str]:
    """The ``prefillq worker`` options of every worker of a run (after the model)."""
    return ["--chunk-tokens", str(cfg.chunk_tokens), "--result-ttl", str(cfg.ttl_s),
            "--logits-ttl", str(cfg.ttl_s)]


def _context(cfg: LoadConfig) -> dict:
    return machine_context("load", redis=True) | {
        "jobs": cfg.jobs, "workers": cfg.workers, "clients": cfg.clients, "model": cfg.model,
        "chunk_tokens": cfg.chunk_tokens, "ttl_s": cfg.ttl_s, "warmup_jobs": cfg.warmup_jobs,
        "length_classes": LENGTH_CLASSES, "class_shares": CLASS_SHARES,
        "idempotent_every": IDEMPOTENT_EVERY}


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("python -m bench.load", __doc__)
    d = LoadConfig()
    p.add_argument("--jobs", type=int, default=d.jobs, help="jobs (default %(default)s)")
    p.add_argument("--workers", type=int, default=d.workers,
                   help="worker processes (default %(default)s)")
    p.add_argument("--model", default=d.model, help="model to serve (default %(default)s)")
    p.add_argument("--clients", type=int, default=d.clients,
                   help="submitting threads (default %(default)s)")
    p.add_argument("--ttl", type=int, default=d.ttl_s,
                   help="the workers' --result-ttl and --logits-ttl (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    from .load_report import report

    p = build_parser()
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    cfg = LoadConfig(jobs=args.jobs, workers=args.workers, model=args.model,
                     clients=args.clients, ttl_s=args.ttl)
    rec = Recorder(args.json, _context(cfg), args.out)
    with tempfile.TemporaryDirectory(prefix="prefillq-load-") as log_dir:
        run = run_load(cfg, Path(log_dir))
    if any(code != 0 for code in run.worker_exit_codes):
        log(f"load: worker exit codes after SIGTERM: {run.worker_exit_codes}")
    report(rec, run)
    for line in rec.bounds_report():  # exit status 0 either way, as `python -m bench`
        log(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
