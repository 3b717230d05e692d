"""The cluster's numbers in Redis: what workers and clients record, and how a reader gets them.

Workers have no HTTP server, so what a gateway serves (``/metrics``, ``/health``) lives in
Redis: counters in one hash, ``keys.STATS`` (`ClusterStats` says what each counts), the rest
read from the keys the queue keeps anyway (`read_plan`).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections import Counter
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field

from . import keys
from .queues import intake_levels_of, rq_queue_key
from .schema import JobState

# Prometheus's default buckets (s), 2-2.5x apart: 5 ms (a small chunk on a GPU) to 10 s, past
# a 2,048-token Gemma 3 270M chunk on a CPU (docs/benchmarks.md).
CHUNK_SECONDS_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

SUBMITTED = "submitted"
TOKENS_PREFILLED = "tokens_prefilled"
TOKENS_REUSED = "tokens_reused"
PREFIX_HITS = "prefix_hits"
PREFIX_MISSES = "prefix_misses"
CHUNK_SECONDS_SUM = "chunk_seconds_sum"
TERMINAL_STATES = (JobState.FINISHED, JobState.FAILED, JobState.CANCELED)
# Commands `record_chunks` adds for one chunk (the chunk count is the buckets' sum); a step's
# chunks add one more for each further bucket their times fall in.
COMMANDS_PER_CHUNK = 3


def bucket_field(seconds: float) -> str:
    """The ``keys.STATS`` field of the histogram bucket of a chunk of `seconds`: the first
    bound >= `seconds` (Prometheus's ``le``), ``chunk_le:+Inf`` past the last."""
    i = bisect_left(CHUNK_SECONDS_BUCKETS, seconds)
    return "chunk_le:" + (f"{CHUNK_SECONDS_BUCKETS[i]:g}" if i < len(CHUNK_SECONDS_BUCKETS)
                          else "+Inf")


BUCKET_FIELDS = tuple(bucket_field(b) for b in CHUNK_SECONDS_BUCKETS) + ("chunk_le:+Inf",)


def record_chunks(pipe, chunks: Iterable[tuple[float, int]]) -> None:
    """Add a step's chunks' counts to `pipe`, on ``keys.STATS`` only: one HINCRBY of the
    tokens, one per histogram bucket the chunks fall in, one HINCRBYFLOAT of the seconds
    (`COMMANDS_PER_CHUNK` for one chunk). Nothing for no chunks.

    Args:
        pipe: a redis or redis.asyncio pipeline.
        chunks: ``(seconds, tokens)`` per chunk: its forward pass in wall seconds, and the
            tokens it computed (not those a session's slot or a checkpoint supplied).
    """
    chunks = list(chunks)
    if not chunks:
        return
    pipe.hincrby(keys.STATS, TOKENS_PREFILLED, sum(int(tokens) for _, tokens in chunks))
    for bucket, n in Counter(bucket_field(seconds) for seconds, _ in chunks).items():
        pipe.hincrby(keys.STATS, bucket, n)
    pipe.hincrbyfloat(keys.STATS, CHUNK_SECONDS_SUM, sum(float(s) for s, _ in chunks))


def terminal(outcome: str | bytes) -> JobState | None:
    """The terminal state a script's outcome names (``finished``, ``failed``,
    ``canceled``), or None (``continue``, ``queued``, ``fenced``, ...): what to count."""
    outcome = outcome.decode() if isinstance(outcome, bytes) else outcome
    return JobState(outcome) if outcome in TERMINAL_STATES else None


def record_terminal(pipe, state: JobState | str, n: int = 1) -> None:
    """Count `n` jobs that ended in `state` on `pipe` (one HINCRBY).

    Args:
        pipe: a redis or redis.asyncio pipeline.
        state: ``finished``, ``failed`` or ``canceled``.

    Raises:
        ValueError: `state` is not terminal.
    """
    state = JobState(state)
    if state not in TERMINAL_STATES:
        raise ValueError(f"{state} is not a terminal state")
    pipe.hincrby(keys.STATS, state.value, n)


def record_reused(pipe, tokens: int, hits: int = 0, misses: int = 0) -> None:
    """Count `tokens` prompt tokens that finished jobs reused instead of computing (a
    session's slot or the worker's prefix cache), and finished jobs whose prompt a worker's
    prefix cache served a prefix of (`hits`) or none of (`misses`), on `pipe` (an HINCRBY
    each that is not 0)."""
    for name, n in ((TOKENS_REUSED, tokens), (PREFIX_HITS, hits), (PREFIX_MISSES, misses)):
        if n:
            pipe.hincrby(keys.STATS, name, int(n))


def record_submitted(pipe) -> None:
    """Count one new job on `pipe` (the submit's MULTI)."""
    pipe.hincrby(keys.STATS, SUBMITTED, 1)


@dataclass(frozen=True)
class ChunkHistogram:
    """Chunk forward-pass times, as a Prometheus histogram.

    Attributes:
        bounds: upper bounds in seconds, ascending (``+Inf`` implied after the last).
        cumulative: chunks of at most each bound, then of any time (``+Inf``):
            ``len(bounds) + 1`` non-decreasing counts.
        sum_seconds: seconds of every chunk.
        count: chunks (``cumulative[-1]``).
    """

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum_seconds: float
    count: int


@dataclass(frozen=True)
class TenantStats:
    """One tenant's numbers (``""``: jobs without a tenant).

    Attributes:
        queued: jobs in its intake queues (every model and priority).
        prefilling: its jobs live workers hold.
        tokens_prefilled: tokens its jobs ran through a forward pass, since tenants came
            into play (``keys.TENANT_TOKENS``).
        service: its virtual service, tokens over weight with the lifts
            (``keys.TENANT_SERVICE``, `worker.fair_share`).
    """

    queued: int = 0
    prefilling: int = 0
    tokens_prefilled: int = 0
    service: float = 0.0


@dataclass(frozen=True)
class ClusterStats:
    """The cluster's numbers (`read_cluster_stats`).

    The counters are fields of ``keys.STATS``, incremented by whoever makes the transition,
    in a round trip it sends anyway where there is one. They are best effort: a worker drops
    a stats write Redis refuses (maxmemory) rather than fail a job, and a pipeline redis-py
    resends after a lost connection counts twice.

    Attributes:
        submitted: jobs a `submit` created (in its MULTI; an idempotent resubmit returns
            the first job and counts nothing).
        finished, failed, canceled: jobs that reached that state, each once, counted by the
            caller whose fenced script ended it (a worker's publish, progress, fail or
            requeue, the reaper, or a client's cancel of a queued job); a fenced script ends
            nothing.
        tokens_prefilled: tokens run through a forward pass, never those reused from a
            session's slot or restored from a checkpoint; a chunk counts even when its job
            was canceled or fenced meanwhile (the work was done).
        tokens_reused: prompt tokens of finished jobs that a session's slot or a worker's
            prefix cache supplied instead of a forward pass (their ``cached_tokens``).
        prefix_hits, prefix_misses: finished jobs that started on a worker with a prefix
            cache (not a session's) and reused a prefix of their prompt from it, or none.
        prefix_bytes: the bytes live workers' prefix caches hold (each worker's figure as
            of its last insert).
        chunks: the chunk-time histogram (fields ``chunk_le:<bound>``, one increment per
            chunk, not cumulative, and ``chunk_seconds_sum``).
        queue_depth: per registered model, executions waiting in its intake queues (every
            priority): what `submit`'s QueueFull check counts, so a job canceled while queued
            stays in until a worker pops (and skips) it.
        routed: executions waiting in workers' own queues (a session's next turn, routed to
            the worker that keeps its slot); a worker's queue may mix its models, so these
            are not split by model.
        prefilling: jobs held by live workers (a dead worker's jobs count once the reaper
            has requeued them, within one heartbeat).
        live_workers: per registered model, workers with a live heartbeat that serve it.
        workers_alive, workers_dead: registered workers whose heartbeat key exists /
            has expired (not reaped yet).
        tenants: per tenant (`TenantStats`), every tenant with a number.
    """

    submitted: int = 0
    finished: int = 0
    failed: int = 0
    canceled: int = 0
    tokens_prefilled: int = 0
    tokens_reused: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_bytes: int = 0
    chunks: ChunkHistogram = field(default_factory=lambda: histogram_of({}))
    queue_depth: dict[str, int] = field(default_factory=dict)
    routed: int = 0
    prefilling: int = 0
    live_workers: dict[str, int] = field(default_factory=dict)
    workers_alive: int = 0
    workers_dead: int = 0
    tenants: dict[str, TenantStats] = field(default_factory=dict)

    @property
    def service_spread(self) -> float:
        """The largest difference of virtual service between two tenants that have jobs
        queued or prefilling now (0 with fewer than two): what the fair share bounds."""
        busy = [t.service for t in self.tenants.values() if t.queued or t.prefilling]
        return max(busy) - min(busy) if len(busy) > 1 else 0.0

    @property
    def served_models(self) -> frozenset[str]:
        """The models a live worker serves: what the gateway lists, takes jobs for, and
        counts as serving in ``/health``."""
        return frozenset(m for m, n in self.live_workers.items() if n > 0)

    @property
    def queued(self) -> int:
        """Executions waiting now: every intake queue and every worker's own queue."""
        return sum(self.queue_depth.values()) + self.routed

    def totals(self) -> dict[str, int]:
        """Jobs by ``submitted`` and each terminal state (a counter each)."""
        return {SUBMITTED: self.submitted, **{s.value: getattr(self, s.value)
                                             for s in TERMINAL_STATES}}


def _fields(raw: Mapping) -> dict[str, bytes | str]:
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}


def histogram_of(raw: Mapping) -> ChunkHistogram:
    """Decode the histogram from HGETALL ``keys.STATS`` (fields of other bounds ignored)."""
    raw = _fields(raw)
    running, cumulative = 0, []
    for name in BUCKET_FIELDS:
        running += int(raw.get(name, 0))
        cumulative.append(running)
    return ChunkHistogram(bounds=CHUNK_SECONDS_BUCKETS, cumulative=tuple(cumulative),
                          sum_seconds=float(raw.get(CHUNK_SECONDS_SUM, 0.0)), count=running)


def _names(members) -> list[str]:
    return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)


Reads = list[tuple]  # (pipeline method name, *args)


def read_plan() -> Generator[Reads, list, ClusterStats]:
    """Every read of `ClusterStats`, without I/O: yields the commands of each pipeline and
    is sent their replies (in order); returns the decoded `ClusterStats`.

    Round trip 1 reads the counters, the registered models and workers and the tenants'
    service and tokens; 2, per model its intake priorities, its tenants' levels and
    priority-0 length, per worker its heartbeat, models, held jobs (all, and by tenant), own
    queue and prefix bytes; 3 (only when needed) the other intake queues' lengths.
    The commands grow with the registered models, workers and tenants' levels, not with
    jobs. `read_cluster_stats` (redis.asyncio)
    and `read_cluster_stats_sync` (redis) only send these pipelines, so they cannot drift.
    """
    raw, model_names, worker_names, service, tokens = yield [
        ("hgetall", keys.STATS), ("hkeys", keys.MODELS), ("smembers", keys.WORKERS),
        ("hgetall", keys.TENANT_SERVICE), ("hgetall", keys.TENANT_TOKENS)]
    models, workers = _names(model_names), _names(worker_names)
    reads: Reads = []
    for m in models:
        reads += [("smembers", keys.priorities(m)), ("smembers", keys.tenant_levels(m)),
                  ("llen", rq_queue_key(keys.intake_queue(m)))]
    for w in workers:
        reads += [("exists", keys.worker_heartbeat(w)), ("smembers", keys.worker_models(w)),
                  ("scard", keys.worker_jobs(w)), ("llen", rq_queue_key(keys.own_queue(w))),
                  ("hget", keys.PREFIX_BYTES, w), ("hgetall", keys.worker_tenants(w))]
    replies = (yield reads) if reads else []
    per_model, per_worker = replies[:3 * len(models)], replies[3 * len(models):]
    depth = {m: per_model[3 * i + 2] for i, m in enumerate(models)}
    others = [(m, p, t) for i, m in enumerate(models)
              for p, t in intake_levels_of(m, per_model[3 * i], per_model[3 * i + 1])
              if (p, t) != (0, None)]
    queued: Counter = Counter()
    if others:
        lengths = yield [("llen", rq_queue_key(keys.intake_queue(m, p, t)))
                         for m, p, t in others]
        for (m, _, t), n in zip(others, lengths, strict=True):
            depth[m] += n
            if t is not None:
                queued[t] += n
    stats = _decode(raw, depth, per_worker)
    return dataclasses.replace(stats, tenants=_tenants(service, tokens, queued, per_worker))


_PER_WORKER = 6  # `read_plan`'s reads of each worker


def _tenants(service: Mapping, tokens: Mapping, queued: Counter, per_worker: list
             ) -> dict[str, TenantStats]:
    """Per tenant: its queued jobs, the jobs live workers hold (``keys.worker_tenants``),
    its tokens and service; entries that do not decode are skipped."""
    prefilling: Counter = Counter()
    for i in range(0, len(per_worker), _PER_WORKER):
        if per_worker[i]:  # a live worker's
            prefilling.update({k: int(v) for k, v in numbers_of(per_worker[i + 5]).items()})
    service, tokens = numbers_of(service), numbers_of(tokens)
    names = set(queued) | set(prefilling) | set(service) | set(tokens)
    return {t: TenantStats(queued=queued[t], prefilling=prefilling[t],
                           tokens_prefilled=int(tokens.get(t, 0)),
                           service=float(service.get(t, 0.0))) for t in sorted(names)}


def numbers_of(raw: Mapping) -> dict[str, float]:
    """A Redis hash of numbers (HGETALL's reply) as ``{name: float}``; an entry whose name
    is not UTF-8 or whose value is not a number is skipped."""
    out = {}
    for name, value in (raw or {}).items():
        try:
            out[name.decode() if isinstance(name, bytes) else name] = float(value)
        except (ValueError, UnicodeDecodeError):
            continue
    return out


def _decode(raw: Mapping, depth: dict[str, int], per_worker: list
            ) -> ClusterStats:
    live = dict.fromkeys(depth, 0)
    alive = prefilling = routed = prefix_bytes = 0
    for i in range(0, len(per_worker), _PER_WORKER):
        beat, served, held, own, cached, _ = per_worker[i:i + _PER_WORKER]
        routed += own
        if not beat:
            continue
        alive += 1
        prefilling += held
        prefix_bytes += int(cached or 0)
        for m in _names(served):
            live[m] = live.get(m, 0) + 1
    fields = _fields(raw)
    counts = {name: int(fields.get(name, 0)) for name in
              (SUBMITTED, TOKENS_PREFILLED, TOKENS_REUSED, PREFIX_HITS, PREFIX_MISSES,
               *(s.value for s in TERMINAL_STATES))}
    return ClusterStats(
        **counts, prefix_bytes=prefix_bytes, chunks=histogram_of(raw), queue_depth=depth,
        routed=routed, prefilling=prefilling, live_workers=live, workers_alive=alive,
        workers_dead=len(per_worker) // _PER_WORKER - alive)


def read_cluster_stats_sync(redis) -> ClusterStats:
    """`ClusterStats` through a redis (sync) connection, in `read_plan`'s round trips."""
    plan = read_plan()
    reads = next(plan)
    while True:
        with redis.pipeline(transaction=False) as pipe:
            for name, *args in reads:
                getattr(pipe, name)(*args)
            replies = pipe.execute()
        try:
            reads = plan.send(replies)
        except StopIteration as done:
            return done.value


async def read_cluster_stats(redis) -> ClusterStats:
    """`ClusterStats` through a redis.asyncio connection, in `read_plan`'s round trips."""
    plan = read_plan()
    reads = next(plan)
    while True:
        async with redis.pipeline(transaction=False) as pipe:
            for name, *args in reads:
                getattr(pipe, name)(*args)
            replies = await pipe.execute()
        try:
            reads = plan.send(replies)
        except StopIteration as done:
            return done.value
