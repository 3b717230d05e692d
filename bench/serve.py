"""python -m bench.serve [--jobs 1000] [--rounds 2] [--model gemma3-tiny]
                       [--arm NAME=FLAGS ...] [--json] [--out FILE]

Short scoring jobs through the queue, as a deployment sees them: one redis-server, one
``prefillq worker`` process, `--jobs` prompts of 32-512 tokens (lm-eval-like lengths) with
``top_k=1``. Arms (each a set of extra worker flags) alternate in one run: every round gives
each arm in turn a fresh worker on a flushed Redis. Per arm and round: jobs/s, tokens/s,
latency, Redis commands and CPU per job, and a top-1 spot check against in-process prefills
(`run_arm`, `report`).
"""

from __future__ import annotations

import argparse
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis

from jobs import JobState, JobStatus, PrefillClient
from worker.redis_server import RedisServer, calls_since, command_calls, cpu_seconds

from .common import Recorder, bench_parser, load_or_exit, log, machine_context, refuse_existing
from .load import TOKEN_IDS, statuses_of, wait_until
from .load_report import percentile
from .observe import EventCounter
from .scale import WorkerFleet

MODEL = "gemma3-tiny"
LENGTHS = (32, 512)  # prompt tokens, inclusive: lm-eval's multiple-choice and short tasks
# Client threads submitting, a connection each: enough that submitting outruns one worker.
CLIENTS = 2
# Jobs each fresh worker runs before the measured jobs: MLX builds its kernels, Redis
# caches the scripts and allocates each command's histogram at its first call.
WARMUP_JOBS = 8
CHECKED_JOBS = 4  # jobs per arm and round whose top-1 id is checked against in-process
# Issue 26's floors over one-job steps: the tiny model (host-bound like a GPU), and Gemma 3
# 270M's shapes on a GPU.
TINY_FLOOR = 3.0
GPU_270M_FLOOR = 10.0
ARM_NAME = re.compile(r"[A-Za-z0-9_.-]+")
BATCH_FLAG = "--max-batch-jobs"


@dataclass(frozen=True)
class Arm:
    """A worker configuration under test: `name` (file-safe) and the extra
    ``prefillq worker`` flags it runs with."""

    name: str
    flags: tuple[str, ...]


def parse_arm(text: str) -> Arm:
    """``NAME=FLAGS`` (FLAGS split as a shell would, may be empty) -> `Arm`.

    Raises:
        argparse.ArgumentTypeError: no ``=``, or a name other than letters, digits, ``_.-``.
    """
    name, sep, flags = text.partition("=")
    if not sep or not ARM_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"{text!r}: want NAME=FLAGS, NAME of [A-Za-z0-9_.-]")
    return Arm(name, tuple(shlex.split(flags)))


def default_arms() -> tuple[list[Arm], str]:
    """One-job steps against the worker's defaults, and how they were chosen: with
    ``--max-batch-jobs 1`` when ``prefillq worker --help`` lists that flag, else (a worker
    that always steps one job) one resident job (``--max-active 1``) against the default."""
    shown = subprocess.run([sys.executable, "-m", "worker", "worker", "--help"],
                           capture_output=True, text=True, check=True).stdout
    if BATCH_FLAG in shown:
        return [Arm("one-job", (BATCH_FLAG, "1")), Arm("default", ())], BATCH_FLAG
    return ([Arm("max-active-1", ("--max-active", "1")), Arm("default", ())],
            f"fallback: the worker has no {BATCH_FLAG}; max-active 1 against the default")


def plan_prompts(jobs: int, model: str, vocab_size: int, seed: int) -> list[list[int]]:
    """`jobs` prompts, each BOS then random ids, lengths uniform in `LENGTHS`: plain ids of
    the tiny Gemma 3 (`bench.load.TOKEN_IDS`), ids 3 up to `vocab_size` for a real model."""
    rng, (lo, hi) = random.Random(seed), TOKEN_IDS if model == MODEL else (3, vocab_size)
    return [[2, *(rng.randrange(lo, hi) for _ in range(rng.randint(*LENGTHS) - 1))]
            for _ in range(jobs)]


def submit_all(url: str, model: str, prompts: list[list[int]]) -> list[str]:
    """Submit every prompt (``top_k=1``) from `CLIENTS` threads, each its own connection and
    every `CLIENTS`-th prompt, as fast as each goes; the job ids in prompt order."""
    def submit_share(first: int) -> list[tuple[int, str]]:
        client = PrefillClient.from_url(url)
        try:
            return [(i, client.submit(tokens=prompts[i], model=model, top_k=1))
                    for i in range(first, len(prompts), CLIENTS)]
        finally:
            client.redis.close()

    ids = [""] * len(prompts)
    with ThreadPoolExecutor(CLIENTS) as pool:  # map re-raises a thread's error here
        for share in pool.map(submit_share, range(CLIENTS)):
            for i, job_id in share:
                ids[i] = job_id
    return ids


@dataclass
class ArmRun:
    """One arm's round: the measured jobs' statuses, the Redis commands they cost, the
    spot check and the worker's exit code.

    Attributes:
        first_submit: epoch seconds before the first measured submit.
        commands: calls per command from just before the first submit to the last job's
            terminal message (``INFO commandstats``, INFO itself left out).
        redis_cpu_s: Redis CPU seconds over the same span (`cpu_seconds`).
        mismatches: checked jobs whose top-1 id differed from the in-process prefill's.
        machine: `machine_context` as the round ended (its load average).
    """

    arm: Arm
    round: int
    prompts: list[list[int]]
    statuses: dict[str, JobStatus | None]
    first_submit: float
    commands: dict[str, int]
    redis_cpu_s: float
    checked: int
    mismatches: int
    exit_code: int | None
    machine: dict


def run_jobs(conn: redis.Redis, url: str, model: str, prompts: list[list[int]],
             timeout_s: float, alive: Callable[[], bool] | None = None
             ) -> tuple[list[str], float, dict[str, int], float]:
    """Submit `prompts` and wait for each job's terminal message (one pattern subscription,
    no polling, so the only commands counted are the clients' and the worker's); the job
    ids, the first submit's epoch seconds, the commands in between and the Redis CPU
    seconds they took (`cpu_seconds`: commands, network and pub/sub delivery).

    Raises:
        TimeoutError: not every job ended within `timeout_s`. RuntimeError: `alive` (the
            workers are running) turned false first.
    """
    counter, ended = EventCounter(conn), set()
    try:
        cpu_before, before = cpu_seconds(conn), command_calls(conn)
        first_submit = time.time()
        job_ids = submit_all(url, model, prompts)

        def all_ended() -> bool:
            ended.update(counter.take_ended())
            if alive is not None and not alive() and not ended >= set(job_ids):
                raise RuntimeError(f"the worker exited with {len(set(job_ids) - ended)} of "
                                   f"{len(job_ids)} jobs not ended")
            return ended >= set(job_ids)

        wait_until(all_ended, timeout_s, f"{len(job_ids)} jobs did not all end", poll_s=0.02)
        commands = calls_since(conn, before)
        cpu_s = cpu_seconds(conn) - cpu_before
    finally:
        counter.stop()
    return job_ids, first_submit, commands, cpu_s


def spot_check(client: PrefillClient, job_ids: list[str], statuses: dict,
               expected: dict[int, frozenset[int]]) -> int:
    """How many of the jobs at `expected`'s indices (index -> the ids of the in-process
    largest logit, `top_ids`) finished with a top-1 id outside them, or did not finish."""
    wrong = 0
    for i, top in expected.items():
        status = statuses[job_ids[i]]
        if status is None or status.state != JobState.FINISHED:
            wrong += 1
        else:
            wrong += client.result(job_ids[i], timeout=0).top_k[0].id not in top
    return wrong


def top_ids(logits) -> frozenset[int]:
    """The ids whose logit equals the largest: several where they tie, as bfloat16 logits
    of a 262,144-token vocabulary do now and then (between 2 and 4 a bfloat16 step is 1/64),
    so that either id of a tie counts as the top-1."""
    values = np.asarray(logits, dtype=np.float32).ravel()
    return frozenset(int(i) for i in np.flatnonzero(values == values.max()))


@dataclass(frozen=True)
class Workload:
    """What every arm runs: the `model` its jobs name, served from `spec`, the measured
    `prompts` (token ids), the `warmup` prompts before them, and the in-process top-1 id of
    a few measured prompts, by index (`expected`, `top_ids`)."""

    model: str
    spec: str  # the worker's --model: a registry name, or NAME=/path.gguf
    prompts: list[list[int]]
    warmup: list[list[int]]
    expected: dict[int, frozenset[int]]


def run_arm(server: RedisServer, arm: Arm, round_: int, work: Workload, log_dir: Path,
            timeout_s: float) -> ArmRun:
    """Flush Redis, start one worker with `arm`'s flags, run the warm-up and then the
    measured jobs (`run_jobs`), read their statuses, spot-check them, stop the worker
    (SIGTERM).

    Raises:
        RuntimeError: the worker did not register. TimeoutError: jobs did not end in time.
    """
    conn = redis.Redis.from_url(server.url)
    conn.flushall()
    worker_logs = log_dir / f"{arm.name}-{round_}"
    worker_logs.mkdir()
    fleet = WorkerFleet(server.url, 1, worker_logs, work.spec, list(arm.flags))
    try:
        fleet.wait_registered(conn)
        run_jobs(conn, server.url, work.model, work.warmup, timeout_s, fleet.alive)
        job_ids, first_submit, commands, cpu_s = run_jobs(
            conn, server.url, work.model, work.prompts, timeout_s, fleet.alive)
        statuses = statuses_of(conn, job_ids)
        wrong = spot_check(PrefillClient(conn), job_ids, statuses, work.expected)
    finally:
        (code,) = fleet.stop()
    run = ArmRun(arm, round_, work.prompts, statuses, first_submit, commands, cpu_s,
                 len(work.expected), wrong, code, machine_context("serve"))
    log(f"serve: round {round_} {arm.name}: {len(job_ids)} jobs, {wrong} top-1 mismatches")
    return run


def arm_record(run: ArmRun) -> tuple[float, dict]:
    """jobs/s of `run` and the details of its record (see docs/benchmarks.md, "Served
    throughput")."""
    done = [s for s in run.statuses.values() if s is not None and s.state == JobState.FINISHED]
    wall_s = max(s.finished_at for s in done) - run.first_submit if done else float("nan")
    latency = [s.finished_at - s.enqueued_at for s in done] or [float("nan")]
    running = [s.finished_at - s.started_at for s in done] or [float("nan")]
    n = len(run.prompts)
    # a step's round trip sends one HINCRBYFLOAT (`jobs.stats.record_chunks`), nothing else here
    steps, calls = run.commands.get("hincrbyfloat", 0), sum(run.commands.values())
    details = {
        "arm": run.arm.name, "round": run.round, "worker_flags": shlex.join(run.arm.flags),
        "jobs": n, "finished": len(done), "tokens": sum(map(len, run.prompts)),
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(sum(map(len, run.prompts)) / wall_s, 1),
        "latency_p50_s": round(percentile(latency, 50), 4),
        "latency_p99_s": round(percentile(latency, 99), 4),
        "run_p50_s": round(percentile(running, 50), 4),
        "run_p99_s": round(percentile(running, 99), 4),
        "redis_commands_per_job": round(calls / n, 2), "steps": steps,
        "jobs_per_step": round(n / steps, 3) if steps else None,
        "redis_commands_per_step": round(calls / steps, 2) if steps else None,
        "redis_commands_per_job_by_command": {k: round(v / n, 3)
                                              for k, v in sorted(run.commands.items())},
        "redis_cpu_us_per_job": round(run.redis_cpu_s * 1e6 / n, 1),
        # one Redis core's jobs a second at this cost: Redis runs commands on one thread
        "jobs_per_redis_core_s": round(n / run.redis_cpu_s) if run.redis_cpu_s else None,
        "top1_checked": run.checked, "top1_mismatches": run.mismatches,
        "worker_exit_code": run.exit_code, "machine": run.machine}
    return len(done) / wall_s, details


SUMMARIZED = ("tokens_per_s", "latency_p50_s", "latency_p99_s", "run_p50_s", "run_p99_s",
              "redis_commands_per_job", "jobs_per_step", "redis_commands_per_step",
              "redis_cpu_us_per_job")


def report(rec: Recorder, runs: list[ArmRun], arms: list[Arm], model: str,
           floor: float | None) -> None:
    """A ``serve_jobs_per_s`` record per arm and round, a ``serve_jobs_per_s_median`` per
    arm (each field the median over rounds), and a ``serve_jobs_per_s_over_<first arm>``
    per other arm: the median over rounds of the two arms' jobs/s in the same round, with
    `floor` as its floor where one is given."""
    measured: dict[str, list[tuple[float, dict]]] = {arm.name: [] for arm in arms}
    for run in runs:
        value, details = arm_record(run)
        measured[run.arm.name].append((value, details))
        rec("serve_jobs_per_s", value, "jobs/s", model=model, **details)
    for arm in arms:
        rows = measured[arm.name]
        rec("serve_jobs_per_s_median", statistics.median(v for v, _ in rows), "jobs/s",
            model=model, arm=arm.name, worker_flags=shlex.join(arm.flags), rounds=len(rows),
            **{k: round(statistics.median(d[k] for _, d in rows), 4) for k in SUMMARIZED})
    base = arms[0].name
    for arm in arms[1:]:
        per_round = [v / b for (v, _), (b, _) in zip(measured[arm.name], measured[base],
                                                      strict=True)]
        rec(f"serve_jobs_per_s_over_{base}", statistics.median(per_round), "ratio",
            model=model, arm=arm.name, over=base, per_round=[round(r, 3) for r in per_round],
            how="median over rounds of the two arms' jobs/s in the same round",
            **({} if floor is None else {"floor": floor}))


def floor_for(model: str, arms_chosen: str) -> float | None:
    """Issue 26's floor on the default arm over one-job steps for `model`: `TINY_FLOOR` for
    the tiny Gemma 3, `GPU_270M_FLOOR` for Gemma 3 270M (or its shapes) on a GPU; None for
    other models or arms."""
    if arms_chosen != BATCH_FLAG:
        return None
    if model == MODEL:
        return TINY_FLOOR
    import mlx.core as mx

    return GPU_270M_FLOOR if model.startswith("gemma3-270m") and mx.default_device() == mx.gpu \
        else None


def workload(loaded, spec: str, jobs: int, seed: int, every_length: bool = False
             ) -> Workload:
    """`jobs` prompts (`plan_prompts`, `seed`), `WARMUP_JOBS` others (with `every_length`,
    one of each length in `LENGTHS` instead, shortest first), and the in-process top-1 ids
    (``Prefill.run``) of `CHECKED_JOBS` measured prompts: the shortest, the longest, and
    random others."""
    prompts = plan_prompts(jobs, loaded.name, loaded.vocab_size, seed)
    by_length = sorted(range(jobs), key=lambda i: len(prompts[i]))
    picks, rng = {by_length[0], by_length[-1]}, random.Random(seed)
    while len(picks) < min(CHECKED_JOBS, jobs):
        picks.add(rng.randrange(jobs))
    expected = {i: top_ids(loaded.start_prefill(prompts[i]).run()) for i in sorted(picks)}
    if every_length:  # the ids do not matter, the shapes do
        warmup = [[2] * n for n in range(LENGTHS[0], LENGTHS[1] + 1)]
    else:
        warmup = plan_prompts(WARMUP_JOBS, loaded.name, loaded.vocab_size, -1 - seed)
    return Workload(loaded.name, spec, prompts, warmup, expected)


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("python -m bench.serve", __doc__)
    p.add_argument("--jobs", type=int, default=1000, help="measured jobs (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds; each runs every arm once, in turn (default %(default)s)")
    p.add_argument("--model", default=MODEL,
                   help="model to serve: a registry name or NAME=/path.gguf (e.g. "
                   "gemma3-270m-shapes=FILE from python -m bench.shapes_gguf FILE; default "
                   "%(default)s)")
    p.add_argument("--arm", type=parse_arm, action="append", metavar="NAME=FLAGS",
                   help="an arm: its name and extra prefillq worker flags (repeatable; the "
                   "first is the one the others are divided by; default: one-job steps, "
                   "then the worker's defaults)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed (default 0)")
    p.add_argument("--warmup-every-length", action="store_true",
                   help="warm each worker up with one prompt of every length in 32-512 "
                   "instead of 8: a backend that builds something per shape (cuDNN's "
                   "attention on a CUDA GPU) is then measured in its steady state")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds an arm's jobs may take to end (default %(default)s)")
    return p


def _context(args: argparse.Namespace, arms: list[Arm], chosen: str, work: Workload) -> dict:
    from model.runtime.blas import blas_summary

    return machine_context("serve", redis=True) | {
        "jobs": args.jobs, "rounds": args.rounds, "model": args.model, "seed": args.seed,
        "arms": {arm.name: shlex.join(arm.flags) for arm in arms}, "arms_chosen": chosen,
        "clients": CLIENTS, "warmup_jobs": len(work.warmup), "lengths": LENGTHS,
        "tokens": sum(map(len, work.prompts)), "top1_checked": sorted(work.expected),
        "submitted": "all at once, as fast as the clients go", "blas": blas_summary()}


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    arms, chosen = (args.arm, "given") if args.arm else default_arms()
    if len({arm.name for arm in arms}) != len(arms):
        p.error("arm names must differ")
    work = workload(load_or_exit(p, args.model), args.model, args.jobs, args.seed,
                    args.warmup_every_length)
    rec = Recorder(args.json, _context(args, arms, chosen, work), args.out)
    runs = []
    with tempfile.TemporaryDirectory(prefix="prefillq-serve-") as log_dir, \
            RedisServer() as server:
        for round_ in range(args.rounds):
            runs += [run_arm(server, arm, round_, work, Path(log_dir), args.timeout)
                     for arm in arms]
    report(rec, runs, arms, work.model, floor_for(work.model, chosen))
    for line in rec.bounds_report():  # a missed bound is a measurement: exit status 0
        log(line)
    broken = [f"round {r.round} {r.arm.name}" for r in runs if r.mismatches or any(
        s is None or s.state != JobState.FINISHED for s in r.statuses.values())]
    if broken:  # a fast wrong answer is no result
        log(f"serve: unfinished jobs or top-1 mismatches in {', '.join(broken)}")
    return 1 if broken else 0


if __name__ == "__main__":
    from model.runtime.blas import ensure_blas

    ensure_blas()
    raise SystemExit(main())
