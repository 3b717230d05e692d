"""python -m bench.scale [--workers 8] [--jobs N] [--chunks-per-job 64] [--worker-args ARGS]
                       [--json] [--out FILE]

Many worker processes on one redis-server: chunks/s, Redis commands/s and Redis CPU over a
steady window, and from the Redis CPU per chunk how many GPU workers one Redis primary would
serve (`measure`, `report`).
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from jobs import PrefillClient, keys
from jobs.defaults import DEFAULT_MAX_ACTIVE
from jobs.queues import intake_depth
from worker.redis_server import RedisServer, calls_by_command

from .common import Recorder, bench_parser, log, machine_context, refuse_existing

MODEL = "gemma3-tiny"
CHUNK_TOKENS = 16
# 2,048-token Gemma 3 270M chunks an H200 runs a second (docs/benchmarks.md, "The H200
# results", has its tok/s).
GPU_CHUNKS_PER_S = 77.0
# Redis runs commands on one thread: a primary has one core for them.
REDIS_CORES = 1.0
# `prefillq worker` loads the model and registers within this many seconds.
START_TIMEOUT_S = 120.0
# SIGTERM finishes the chunk in progress and hands jobs back within this many seconds.
STOP_TIMEOUT_S = 60.0


@dataclass
class Snapshot:
    """Redis counters and job progress at one moment.

    Attributes:
        at: `time.monotonic` seconds.
        commands: calls so far per command, INFO left out (``INFO commandstats``).
        usec: microseconds Redis spent inside commands so far, INFO left out.
        cpu_s: Redis CPU seconds so far, system plus user (``INFO cpu``).
        chunks: sum of ``chunks_done`` over the submitted jobs.
    """

    at: float
    commands: dict[str, int]
    usec: int
    cpu_s: float
    chunks: int


def snapshot(conn: redis.Redis, job_ids: list[str], info_first: bool) -> Snapshot:
    """One MULTI/EXEC of the jobs' ``chunks_done`` and INFO, in the order that keeps the
    reads of a window's two snapshots out of its command count: INFO last in the opening
    snapshot (`info_first` False), first in the closing one."""
    with conn.pipeline() as pipe:
        if info_first:
            pipe.info("commandstats").info("cpu")
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "chunks_done")
        if not info_first:
            pipe.info("commandstats").info("cpu")
        at = time.monotonic()
        replies = pipe.execute()
    stats, cpu = (replies[0], replies[1]) if info_first else (replies[-2], replies[-1])
    done = replies[2:] if info_first else replies[:-2]
    return Snapshot(
        at=at,
        commands=calls_by_command(stats),
        usec=sum(s["usec"] for name, s in stats.items() if name != "cmdstat_info"),
        cpu_s=cpu["used_cpu_sys"] + cpu["used_cpu_user"],
        chunks=sum(int(n or 0) for n in done),
    )


class WorkerFleet:
    """`count` ``prefillq worker`` child processes named w1..wN serving `model`, logs in
    `log_dir`; `options` are their further ``prefillq worker`` options (default:
    ``--chunk-tokens CHUNK_TOKENS``); `python` is the interpreter command they run under
    (``[sys.executable, "-m", "cProfile", "-o", FILE]`` profiles one: `bench.serve_profile`)."""

    def __init__(self, url: str, count: int, log_dir: Path, model: str = MODEL,
                 options: list[str] | None = None, python: Sequence[str] | None = None):
        self.url, self.log_dir = url, log_dir
        options = ["--chunk-tokens", str(CHUNK_TOKENS)] if options is None else options
        self.procs: dict[str, subprocess.Popen] = {}
        for k in range(1, count + 1):
            name = f"w{k}"
            with open(log_dir / f"{name}.log", "w") as out:
                self.procs[name] = subprocess.Popen(
                    [*(python or [sys.executable]), "-m", "worker", "worker", "--redis", url,
                     "--model", model, *options, "--name", name],
                    stdout=out, stderr=subprocess.STDOUT)

    def wait_registered(self, conn: redis.Redis) -> None:
        """Block until every worker's heartbeat key exists.

        Raises:
            RuntimeError: a worker exited or did not register within START_TIMEOUT_S
                (with the tail of its log).
        """
        deadline = time.monotonic() + START_TIMEOUT_S
        for name, proc in self.procs.items():
            while not conn.exists(keys.worker_heartbeat(name)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (self.log_dir / f"{name}.log").read_text()[-3000:]
                    raise RuntimeError(f"worker {name} did not register:\n{tail}")
                time.sleep(0.1)

    def alive(self) -> bool:
        """Whether every worker process is still running."""
        return all(proc.poll() is None for proc in self.procs.values())

    def stop(self) -> list[int | None]:
        """SIGTERM every worker, wait for each (SIGKILL past STOP_TIMEOUT_S); exit codes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in self.procs.values():
            try:
                codes.append(proc.wait(timeout=STOP_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes


def submit_jobs(client: PrefillClient, jobs: int, chunks_per_job: int) -> list[str]:
    """`jobs` prompts of `chunks_per_job` chunks each, distinct token ids per job (so no
    job finds another's prefix cached); returns their ids."""
    vocab = client.models()[MODEL].vocab_size
    n = chunks_per_job * CHUNK_TOKENS
    job_ids = []
    for seed in range(jobs):
        rng = random.Random(seed)
        ids = [2, *(rng.randrange(3, vocab) for _ in range(n - 1))]
        job_ids.append(client.submit(tokens=ids, model=MODEL, top_k=1))
    return job_ids


@dataclass
class Window:
    """What one steady window measured, and how."""

    start: Snapshot
    end: Snapshot
    saturated: bool  # jobs still waited for intake when the window closed
    exit_codes: list[int | None]

    @property
    def seconds(self) -> float:
        return self.end.at - self.start.at

    @property
    def chunks(self) -> int:
        return self.end.chunks - self.start.chunks

    @property
    def by_command(self) -> dict[str, int]:
        """Calls per command inside the window, the snapshots' own MULTI/EXEC left out."""
        before, after = self.start.commands, self.end.commands
        delta = {k: after[k] - before.get(k, 0) for k in after}
        delta["exec"], delta["multi"] = delta["exec"] - 1, delta["multi"] - 1
        return {k: n for k, n in sorted(delta.items()) if n}

    @property
    def commands(self) -> int:
        return sum(self.by_command.values())

    @property
    def cpu_s(self) -> float:
        return self.end.cpu_s - self.start.cpu_s


def measure(args: argparse.Namespace, log_dir: Path) -> Window:
    """Start redis-server and the workers, submit, warm up, measure one window, stop.

    Its own redis-server and ``prefillq worker`` processes (the tiny Gemma 3 with 16-token
    chunks, so Redis sees many chunks a second); enough jobs to keep every worker busy; one
    window after a warm-up; then SIGTERM to the workers (they hand their jobs back) and the
    server killed. Run it with the OpenBLAS env (``env $(python -m model.runtime.blas)``).
    """
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        fleet = WorkerFleet(server.url, args.workers, log_dir, options=[
            "--chunk-tokens", str(CHUNK_TOKENS), *shlex.split(args.worker_args)])
        try:
            fleet.wait_registered(conn)
            log(f"scale: {args.workers} workers registered; submitting {args.jobs} jobs")
            job_ids = submit_jobs(PrefillClient(conn), args.jobs, args.chunks_per_job)
            time.sleep(args.warmup)
            start = snapshot(conn, job_ids, info_first=False)
            time.sleep(args.seconds)
            end = snapshot(conn, job_ids, info_first=True)
            saturated = intake_depth(conn, MODEL) > 0
        finally:
            codes = fleet.stop()
        return Window(start, end, saturated, codes)


def report(rec: Recorder, args: argparse.Namespace, w: Window) -> None:
    """The six records of one window, each with how it was measured.

    On a machine with fewer cores than workers chunks/s is bound by the workers' CPU; the
    Redis CPU per chunk is the number that carries over to fast workers.
    """
    cores = os.cpu_count()
    how = {"workers": args.workers, "window_s": round(w.seconds, 2), "chunks": w.chunks,
           "jobs": args.jobs, "chunks_per_job": args.chunks_per_job,
           "chunk_tokens": CHUNK_TOKENS, "model": MODEL, "machine_cores": cores,
           "saturated": w.saturated}
    us_per_chunk = w.cpu_s / w.chunks * 1e6
    rec("scale_chunks_per_s", w.chunks / w.seconds, "chunks/s", **how,
        bound_by=f"the workers' CPU ({cores} cores shared by {args.workers} workers)")
    rec("scale_redis_commands_per_s", w.commands / w.seconds, "commands/s", **how,
        commands=w.commands)
    rec("scale_redis_commands_per_chunk", w.commands / w.chunks, "commands", **how,
        by_command={k: round(n / w.chunks, 3) for k, n in w.by_command.items()})
    rec("scale_redis_cpu_fraction", w.cpu_s / w.seconds, "ratio", **how,
        redis_cpu_s=round(w.cpu_s, 4),
        in_commands_s=round((w.end.usec - w.start.usec) / 1e6, 4))
    rec("scale_redis_cpu_us_per_chunk", us_per_chunk, "us", **how)
    rec("gpu_workers_per_redis_primary", REDIS_CORES * 1e6 / (us_per_chunk * GPU_CHUNKS_PER_S),
        "workers", **how, gpu_chunks_per_s=GPU_CHUNKS_PER_S, redis_cores=REDIS_CORES,
        from_metric="scale_redis_cpu_us_per_chunk")


def _context(args: argparse.Namespace) -> dict:
    return machine_context("scale", redis=True) | {
        "workers": args.workers, "jobs": args.jobs, "chunks_per_job": args.chunks_per_job,
        "warmup_s": args.warmup, "window_s": args.seconds, "worker_args": args.worker_args}


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("python -m bench.scale", __doc__)
    p.add_argument("--workers", type=int, default=8, help="worker processes (default 8)")
    p.add_argument("--jobs", type=int,
                   help="jobs to submit (default: 8 x max_active per worker, enough to keep "
                   "every worker busy through warm-up and window on 2 cores)")
    p.add_argument("--worker-args", default="",
                   help="further prefillq worker options, split as a shell would (e.g. "
                   "'--max-batch-jobs 1' for one-job steps; default: none)")
    p.add_argument("--chunks-per-job", type=int, default=64,
                   help=f"{CHUNK_TOKENS}-token chunks per job (default %(default)s)")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds after submitting before the window (default %(default)s)")
    p.add_argument("--seconds", type=float, default=20.0,
                   help="length of the measured window (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    if args.jobs is None:
        args.jobs = 8 * DEFAULT_MAX_ACTIVE * args.workers
    rec = Recorder(args.json, _context(args), args.out)
    with tempfile.TemporaryDirectory(prefix="prefillq-scale-") as log_dir:
        window = measure(args, Path(log_dir))
    if window.chunks <= 0:
        log("scale: no chunk finished inside the window; pass more --jobs or --chunks-per-job")
        return 1
    if not window.saturated:
        log("scale: the intake queue ran dry inside the window; pass more --jobs")
    if any(code != 0 for code in window.exit_codes):
        log(f"scale: worker exit codes after SIGTERM: {window.exit_codes}")
    report(rec, args, window)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
