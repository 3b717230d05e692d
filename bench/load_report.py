"""What a load run (`bench.load`) shows: its exactly-once checks, jobs/s and latency per
length class, and the records of a results file."""

from __future__ import annotations

import math
from collections import Counter

from jobs import JobState

from .common import Recorder
from .load import CLASS_SHARES, LENGTH_CLASSES
from .observe import TERMINAL

ALL = "all"
# |memory_growth| within this many bytes is "back to baseline": Redis's one-off allocations
# (a Lua script's first run, the keyspace tables resized, new histogram fields, a pool
# connection opened late) do not grow with the jobs (docs/benchmarks.md, "Load"). Keys left
# per job are `keys_grown`'s and `job_keys_left`'s to find.
MEMORY_MARGIN = 8192
# A key of a pattern the baseline had may grow by this many bytes (counters' digits, new
# histogram fields); an entry naming a job costs >= 33 bytes (its id), 2 KB over 60 jobs.
KEY_MARGIN = 512


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (0 < q <= 100) of `values` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def finished_once(phase) -> int:
    """Jobs of `phase` whose status is finished and whose channel carried one terminal
    message, ``finished``."""
    terminal = Counter()
    for (job_id, kind), n in phase.events.items():
        if kind in TERMINAL:
            terminal[job_id, kind] += n
    return sum(1 for j, s in phase.statuses.items()
               if s is not None and s.state == JobState.FINISHED
               and terminal[j, JobState.FINISHED.value] == 1
               and sum(terminal[j, k] for k in TERMINAL) == 1)


def exactly_once_problems(phase, jobs: int) -> list[str]:
    """What broke "every job finished, once" in `phase` (a `bench.load.Phase` of `jobs`
    jobs); empty when nothing did. Checks each job's status (finished), its events
    (exactly one terminal message, ``finished``), the counters (submitted and finished
    each grew by `jobs`, nothing else ended) and the idempotent retries (same job id)."""
    out = []
    if len(phase.classes) != jobs:
        out.append(f"{len(phase.classes)} distinct job ids for {jobs} submits")
    states = Counter(s.state.value if s else "no record" for s in phase.statuses.values())
    if states != Counter({JobState.FINISHED.value: jobs}):
        out.append(f"states {dict(states)}, want {jobs} finished")
    terminal = Counter()
    for (job_id, kind), n in phase.events.items():
        if kind in TERMINAL:
            terminal[job_id] += n
            if kind != JobState.FINISHED.value:
                out.append(f"job {job_id}: {n} {kind!r} message(s)")
    not_once = {j: terminal[j] for j in phase.classes if terminal[j] != 1}
    if not_once:
        out.append(f"{len(not_once)} jobs without exactly one terminal message: "
                   f"{dict(list(not_once.items())[:5])}")
    want = {"submitted": jobs, "finished": jobs, "failed": 0, "canceled": 0}
    if phase.totals != want:
        out.append(f"counters grew by {phase.totals}, want {want}")
    if phase.duplicate_ids:
        out.append(f"{phase.duplicate_ids} idempotent retries got a new job id")
    return out


def job_keys_left(phase) -> dict[str, dict[str, int]]:
    """The key patterns left at the end of `phase` that hold a job id (``*``)."""
    return {p: row for p, row in phase.keys.items() if "*" in p}


def keys_grown(run) -> dict[str, dict]:
    """Key patterns that hold more after the measured phase than at the baseline: more
    keys, more than `KEY_MARGIN` bytes more a key, or a new pattern of keys that never
    expire (a new one whose keys all expire, such as RQ's maintenance lock, is not)."""
    out = {}
    for pattern, row in run.load.keys.items():
        was = run.warmup.keys.get(pattern)
        if was is None and row["no_ttl"] == 0:
            continue
        was = was or {"count": 0, "bytes": 0, "no_ttl": 0}
        if row["count"] > was["count"] or row["bytes"] - was["bytes"] > KEY_MARGIN * row["count"]:
            out[pattern] = {"baseline": was, "after": row}
    return out


def by_class(phase) -> dict[str, dict[str, float]]:
    """Per length class and for ``all``: ``jobs``, ``jobs_per_s`` (the class's jobs over
    its first submit to its last finish), ``p50_s``, ``p99_s``, ``max_s`` (submit to
    finished: ``finished_at - enqueued_at``), ``run_p50_s`` and ``run_p99_s`` (the last
    attempt's start to finished: the latency less the wait in the queue), ``tokens`` and
    ``chunks``; finished jobs only."""
    groups: dict[str, list] = {}
    for job_id, cls in phase.classes.items():
        status = phase.statuses.get(job_id)
        if status is not None and status.state == JobState.FINISHED:
            groups.setdefault(cls, []).append(status)
            groups.setdefault(ALL, []).append(status)
    out = {}
    for cls in [c for c in (*LENGTH_CLASSES, ALL) if c in groups]:
        done = groups[cls]
        latency = [s.finished_at - s.enqueued_at for s in done]
        running = [s.finished_at - s.started_at for s in done]
        span = max(s.finished_at for s in done) - min(s.enqueued_at for s in done)
        out[cls] = {"jobs": len(done), "jobs_per_s": len(done) / span,
                    "p50_s": percentile(latency, 50), "p99_s": percentile(latency, 99),
                    "max_s": max(latency), "run_p50_s": percentile(running, 50),
                    "run_p99_s": percentile(running, 99),
                    "tokens": sum(s.n_tokens or 0 for s in done),
                    "chunks": sum(s.chunks_done for s in done)}
    return out


def report(rec: Recorder, run) -> None:
    """The records of a `bench.load.LoadRun`: exactly-once, then jobs/s and latency per
    class, then Redis memory at baseline, peak and after (with the keys left)."""
    cfg, phase = run.config, run.load
    how = {"jobs": cfg.jobs, "workers": cfg.workers, "clients": cfg.clients,
           "model": cfg.model, "chunk_tokens": cfg.chunk_tokens, "ttl_s": cfg.ttl_s}
    problems = exactly_once_problems(phase, cfg.jobs)
    rec("load_finished_exactly_once", finished_once(phase), "jobs", **how,
        floor=cfg.jobs, problems=problems[:10], counters=phase.totals,
        idempotent_retries_new_id=phase.duplicate_ids, submit_s=round(phase.submit_s, 2),
        ended_s=round(phase.ended_s, 2))
    for cls, row in by_class(phase).items():
        where = {"length_class": cls, "token_range": LENGTH_CLASSES.get(cls, "mixed"),
                 "share": CLASS_SHARES.get(cls, 1.0), "class_jobs": row["jobs"]}
        rec("load_jobs_per_s", row["jobs_per_s"], "jobs/s", **where, **how,
            tokens_per_s=round(row["tokens"] * row["jobs_per_s"] / row["jobs"], 1),
            chunks_per_job=round(row["chunks"] / row["jobs"], 2))
        rec("load_latency_p50_s", row["p50_s"], "s", **where, **how,
            run_p50_s=round(row["run_p50_s"], 3))
        rec("load_latency_p99_s", row["p99_s"], "s", **where, **how,
            max_s=round(row["max_s"], 3), run_p99_s=round(row["run_p99_s"], 3))
    memory = run.memory
    for moment in ("baseline", "peak", "after"):
        rec("load_redis_used_memory", memory[moment], "bytes", moment=moment, **how)
    base, after = run.warmup.memory, phase.memory
    rec("load_redis_used_memory_growth", memory["after"] - memory["baseline"], "bytes",
        **how, connections_memory_growth=after["connections_memory"]
        - base["connections_memory"])
    rec("load_redis_memory_growth_apart_from_connections", memory_growth(run), "bytes",
        **how, ceiling=MEMORY_MARGIN, baseline=_detail(base), after=_detail(after),
        registered=_detail(run.registered), warmup_jobs=cfg.warmup_jobs,
        expired_after_s=round(phase.expired_s, 2),
        commands_first_called=sorted(set(after["commands"]) - set(base["commands"])),
        job_keys_left=job_keys_left(phase), keys_grown=keys_grown(run), keys_after=phase.keys)


def memory_growth(run) -> int:
    """used_memory apart from the connections' buffers, after the measured phase's TTLs
    minus at the baseline (bytes; `bench.observe.memory_now`)."""
    return (run.load.memory["apart_from_connections"]
            - run.warmup.memory["apart_from_connections"])


def _detail(memory: dict) -> dict:
    return {k: v for k, v in memory.items() if k != "commands"}
