"""python -m bench.serve_profile [--jobs 1000] [--model gemma3-tiny] [--worker-args FLAGS]
                                [--top 25] [--out FILE]

Where a served worker's host time goes: `bench.serve`'s workload (short scoring jobs, one
redis-server, one ``prefillq worker`` process) with the worker's main thread under
cProfile (``python -m cProfile``, the standard library's deterministic profiler). cProfile
adds a few microseconds to every Python call, so the totals run slower than `bench.serve`'s;
the shares between functions are what it is for.

Prints JSON lines: a ``serve_profile_ms_per_job`` record (the worker's profiled seconds over
the measured jobs, warm-up and start-up included), then one ``serve_profile_function`` record
per function among the `--top` by own time (``tottime``) and the `--top` by cumulative time,
each in ms a job. The raw profile is kept beside `--out` (``FILE.prof``, for ``pstats``).
"""

from __future__ import annotations

import argparse
import pstats
import shlex
import sys
import tempfile
from pathlib import Path

import redis

from worker.redis_server import RedisServer

from .common import Recorder, bench_parser, load_or_exit, log, machine_context, refuse_existing
from .scale import WorkerFleet
from .serve import MODEL, run_jobs, workload


def function_rows(stats: pstats.Stats, top: int, jobs: int) -> list[dict]:
    """The `top` functions by own time and the `top` by cumulative time (each once), in ms a
    job: ``{"function", "calls_per_job", "own_ms_per_job", "cumulative_ms_per_job"}``,
    own time first."""
    rows = {}
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows[f"{Path(path).name}:{line}:{name}"] = {
            "calls_per_job": round(calls / jobs, 3),
            "own_ms_per_job": round(own * 1e3 / jobs, 4),
            "cumulative_ms_per_job": round(cumulative * 1e3 / jobs, 4)}
    by_own = sorted(rows, key=lambda f: -rows[f]["own_ms_per_job"])[:top]
    by_cumulative = sorted(rows, key=lambda f: -rows[f]["cumulative_ms_per_job"])[:top]
    chosen = sorted(set(by_own) | set(by_cumulative),
                    key=lambda f: (-rows[f]["own_ms_per_job"], f))
    return [{"function": f, **rows[f]} for f in chosen]


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("python -m bench.serve_profile", __doc__, json_lines=False)
    p.add_argument("--jobs", type=int, default=1000, help="measured jobs (default 1000)")
    p.add_argument("--model", default=MODEL,
                   help=f"a registry name or NAME=/path.gguf (default {MODEL})")
    p.add_argument("--worker-args", default="",
                   help="extra prefillq worker flags, one string (default: none)")
    p.add_argument("--top", type=int, default=25,
                   help="functions kept by own and by cumulative time (default 25)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed (default 0)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds the jobs may take to end (default 3600)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    work = workload(load_or_exit(p, args.model), args.model, args.jobs, args.seed)
    flags = shlex.split(args.worker_args)
    context = machine_context("serve_profile", redis=True) | {
        "jobs": args.jobs, "model": args.model, "worker_flags": args.worker_args,
        "warmup_jobs": len(work.warmup), "profiler": "cProfile, the worker's main thread"}
    rec = Recorder(True, context, args.out)
    with tempfile.TemporaryDirectory(prefix="prefillq-serve-profile-") as tmp, \
            RedisServer() as server:
        prof = Path(tmp) / "worker.prof"
        fleet = WorkerFleet(server.url, 1, Path(tmp), work.spec, flags,
                            python=[sys.executable, "-m", "cProfile", "-o", str(prof)])
        conn = redis.Redis.from_url(server.url)
        try:
            fleet.wait_registered(conn)
            run_jobs(conn, server.url, work.model, work.warmup, args.timeout, fleet.alive)
            run_jobs(conn, server.url, work.model, work.prompts, args.timeout, fleet.alive)
        finally:
            (code,) = fleet.stop()
        if code != 0 or not prof.exists():
            log(f"serve_profile: the worker exited {code}; no profile")
            return 1
        stats = pstats.Stats(str(prof))
        if args.out is not None:
            prof.replace(args.out.with_name(args.out.name + ".prof"))
    rec("serve_profile_ms_per_job", stats.total_tt * 1e3 / args.jobs, "ms/job",
        jobs=args.jobs, worker_seconds=round(stats.total_tt, 3))
    for row in function_rows(stats, args.top, args.jobs):
        rec("serve_profile_function", row.pop("own_ms_per_job"), "ms/job own", **row)
    return 0


if __name__ == "__main__":
    from model.runtime.blas import ensure_blas

    ensure_blas()
    raise SystemExit(main())
