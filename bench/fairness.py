"""python -m bench.fairness [--model gemma3-tiny] [--flood-jobs 500] [--flood-tokens 1024]
                           [--tenants 5] [--short-jobs 20] [--short-tokens 64]
                           [--workers 3] [--rounds 1] [--seed N] [--json] [--out FILE]

Tenants sharing workers (issue 29): a flood tenant submits `--flood-jobs` jobs of
`--flood-tokens` tokens at once, then `--tenants` other tenants each submit `--short-jobs`
jobs of `--short-tokens` tokens, one every 50 ms in turn, while the flood runs; `--workers`
``prefillq worker`` processes on one redis-server serve them. Two arms, alternating over
`--rounds`, each on fresh workers and a flushed Redis: ``fair`` (every job names its tenant:
weighted fair share, `worker.fair_share`) and ``fifo`` (the same jobs without tenants:
first in, first out). The flood jobs are canceled once the last short job has its result.

Records (JSON lines): per arm, round and tenant ``fairness_latency_p50_s`` and
``fairness_latency_p99_s`` (a short job's enqueue to its finish, as its record says; the
flood's jobs are not timed); per round ``fairness_p99_speedup`` (the worst short tenant's
p99, fifo over fair); and ``fairness_flood_tokens_while_waiting``: the most tokens the
flood was served (its ``prefillq:tenant-service``, sampled every 20 ms) between a short
job's enqueue and its start, in the fair arm: the service difference of two backlogged
tenants, against the bound of two steps' tokens a worker (docs/operations.md), `--workers`
of them.
"""

from __future__ import annotations

import bisect
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis

from jobs import PrefillClient, keys
from worker.redis_server import RedisServer
from worker.settings import default_step_tokens

from .cache_arms import MODEL, served_name, vocab_size
from .common import Recorder, bench_parser, log, machine_context, refuse_existing
from .gateway import _spawn, _wait
from .load import TOKEN_IDS

SUBMIT_EVERY_S = 0.05
SAMPLE_EVERY_S = 0.02
FLOOD = "flood"


@dataclass
class ArmRun:
    """One arm's run: each short tenant's latencies (s), each short job's enqueue and start
    (epoch s), and in the fair arm the flood's service over time (``(epoch s, tokens)``)."""

    name: str
    round: int
    latencies: dict[str, list[float]] = field(default_factory=dict)
    waits: list[tuple[float, float]] = field(default_factory=list)
    flood: list[tuple[float, float]] = field(default_factory=list)

    def flood_while_waiting(self) -> list[float]:
        """The flood's service gained between each short job's enqueue and start."""
        times = [t for t, _ in self.flood]

        def at(moment: float) -> float:  # the last sample at or before `moment`
            i = bisect.bisect_right(times, moment)
            return self.flood[i - 1][1] if i else 0.0

        return [at(start) - at(enqueued) for enqueued, start in self.waits]


def prompts(n: int, tokens: int, lo: int, hi: int, rng: random.Random) -> list[list[int]]:
    return [[2, *(rng.randrange(lo, hi) for _ in range(tokens - 1))] for _ in range(n)]


def run_arm(server: RedisServer, name: str, round_: int, args, logs: Path) -> ArmRun:
    """Fresh workers on a flushed Redis; the flood, then the short tenants' jobs paced."""
    conn = redis.Redis.from_url(server.url)
    conn.flushall()
    rng = random.Random(args.seed)
    lo, hi = TOKEN_IDS if args.model == MODEL else (3, vocab_size(args.model))
    model, fair = served_name(args.model), name == "fair"
    workers = [f"fair-{name}-{round_}-{i}" for i in range(args.workers)]
    procs = [_spawn(["worker", "--redis", server.url, "--name", w, "--model", args.model],
                    logs / f"{w}.log") for w in workers]
    run = ArmRun(name, round_)
    try:
        for w in workers:
            _wait(lambda w=w: conn.exists(keys.worker_heartbeat(w)), 300, f"worker {w}")
        client = PrefillClient.from_url(server.url, max_queue_depth=10**6)
        flood = [client.submit(tokens=ids, model=model, tenant=FLOOD if fair else None)
                 for ids in prompts(args.flood_jobs, args.flood_tokens, lo, hi, rng)]
        tenants = [f"t{i}" for i in range(args.tenants)]
        short = {t: prompts(args.short_jobs, args.short_tokens, lo, hi, rng) for t in tenants}
        submitted: dict[str, str] = {}  # job id -> tenant
        done = threading.Event()
        sampler = threading.Thread(target=_sample, args=(conn, done, run), daemon=True)
        if fair:
            sampler.start()
        for i in range(args.short_jobs):
            for t in tenants:
                job = client.submit(tokens=short[t][i], model=model, top_k=1,
                                    tenant=t if fair else None)
                submitted[job] = t
                time.sleep(SUBMIT_EVERY_S)
        run.latencies = {t: [] for t in tenants}
        for job, t in submitted.items():  # the record's times: the watch may come late
            for status in client.watch(job, timeout=3600):
                if status.state.is_terminal:
                    run.latencies[t].append(status.finished_at - status.enqueued_at)
                    run.waits.append((status.enqueued_at, status.started_at))
        done.set()
        for job in flood:
            client.cancel(job)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    worst = max(np.percentile(v, 99) for v in run.latencies.values())
    flood_max = max(run.flood_while_waiting(), default=0.0) if fair else 0.0
    log(f"fairness: round {round_} {name}: worst short tenant p99 {worst:.2f} s"
        + (f", flood tokens while a short job waited {flood_max:.0f}" if fair else ""))
    return run


def _sample(conn, done: threading.Event, run: ArmRun) -> None:
    """Every `SAMPLE_EVERY_S` until `done`: the flood's virtual service (weight 1: its
    tokens launched), with the time."""
    while not done.wait(SAMPLE_EVERY_S):
        value = conn.hget(keys.TENANT_SERVICE, FLOOD)
        run.flood.append((time.time(), float(value or 0)))


def report(rec: Recorder, runs: list[ArmRun], args) -> None:
    """The records the module docstring lists."""
    for run in runs:
        for t, values in run.latencies.items():
            rec("fairness_latency_p50_s", float(np.percentile(values, 50)), "s", arm=run.name,
                round=run.round, tenant=t)
            rec("fairness_latency_p99_s", float(np.percentile(values, 99)), "s", arm=run.name,
                round=run.round, tenant=t)
    for round_ in sorted({r.round for r in runs}):
        fair, fifo = (next(r for r in runs if r.round == round_ and r.name == n)
                      for n in ("fair", "fifo"))
        worst = {r.name: max(np.percentile(v, 99) for v in r.latencies.values())
                 for r in (fair, fifo)}
        rec("fairness_p99_speedup", worst["fifo"] / worst["fair"], "ratio", round=round_,
            how="the worst short tenant's p99 latency, fifo over fair")
        gained = fair.flood_while_waiting()
        bound = 2 * default_step_tokens() * args.workers
        rec("fairness_flood_tokens_while_waiting", max(gained), "tokens", round=round_,
            ceiling=bound, p99=float(np.percentile(gained, 99)), workers=args.workers,
            how="the flood's prefillq:tenant-service gained between a short job's enqueue "
                "and start (sampled every 20 ms), the most over the fair arm's short jobs; "
                "ceiling: 2 steps' tokens a worker")


def build_parser():
    p = bench_parser("python -m bench.fairness", __doc__)
    p.add_argument("--model", default=MODEL, help=f"a registry name (default {MODEL})")
    p.add_argument("--flood-jobs", type=int, default=500, help="the flood's jobs (500)")
    p.add_argument("--flood-tokens", type=int, default=1024, help="a flood job's tokens (1024)")
    p.add_argument("--tenants", type=int, default=5, help="short-job tenants (5)")
    p.add_argument("--short-jobs", type=int, default=20, help="jobs a short tenant (20)")
    p.add_argument("--short-tokens", type=int, default=64, help="a short job's tokens (64)")
    p.add_argument("--workers", type=int, default=3, help="worker processes (3)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of both arms (1)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (0)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    context = machine_context("fairness", redis=True) | {
        k: getattr(args, k) for k in ("model", "flood_jobs", "flood_tokens", "tenants",
                                      "short_jobs", "short_tokens", "workers", "rounds",
                                      "seed")}
    rec = Recorder(args.json, context, args.out)
    runs = []
    with RedisServer() as server, tempfile.TemporaryDirectory() as logs:
        for round_ in range(args.rounds):
            arms = ["fair", "fifo"] if round_ % 2 == 0 else ["fifo", "fair"]
            runs += [run_arm(server, name, round_, args, Path(logs)) for name in arms]
    report(rec, runs, args)
    for line in rec.bounds_report():  # a missed bound is a measurement: exit status 0
        log(line)
    return 0


if __name__ == "__main__":
    from model.runtime.blas import ensure_blas

    ensure_blas()
    raise SystemExit(main())
