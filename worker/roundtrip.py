"""One Redis round trip per step: its jobs' fenced transitions plus what the loop needs next.

After each step the worker sends every stepped job's progress (or publish) script, the other
resident jobs' cancel flags, the admission queues' lengths, the step's chunk stats and the
jobs that left since the last round trip (`Departures`) together.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from redis import Redis
from redis.exceptions import NoScriptError

from jobs import keys, stats
from jobs.schema import JobState
from jobs.scripts import Call, Scripts

# Raise a tenant's virtual service to a floor (VTC's lift, `worker.fair_share`): a max, so
# that two workers lifting one tenant at once lift it once.
LIFT = """
local now = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if now < tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 0
"""


@dataclass
class Departures:
    """Jobs that left worker `worker` and are not forgotten in Redis yet: their ids leave its
    held jobs (``keys.worker_jobs``, the reaper's list) and the ended ones are counted
    (`jobs.stats`). A step's scripts decide whether a job ends, so the jobs they end are
    forgotten in the next round trip (`Probe.departed`) or, when none follows, in one of
    their own (`send`): one round trip a step also when jobs end.

    Attributes:
        job_ids: jobs to remove from the held set (a hand-back parked for later is not).
        ended: how many ended in each terminal state.
        reused: prompt tokens the finished ones reused (a session's slot, the prefix cache).
        hits: finished jobs a prefix cache served a prefix of; misses: served none of.
    """

    worker: str
    job_ids: list[str] = field(default_factory=list)
    ended: Counter = field(default_factory=Counter)
    reused: int = 0
    hits: int = 0
    misses: int = 0

    def __bool__(self) -> bool:
        return bool(self.job_ids or self.ended)

    def merge(self, other: Departures) -> None:
        """Add `other`'s jobs and counts to these."""
        self.job_ids.extend(j for j in other.job_ids if j not in self.job_ids)
        self.ended.update(other.ended)
        self.reused += other.reused
        self.hits += other.hits
        self.misses += other.misses

    @contextmanager
    def taken(self) -> Iterator[Departures]:
        """These departures, moved out for a round trip (these are empty then) and put back
        when it raises, to go with the next one."""
        out = Departures(self.worker, self.job_ids, self.ended, self.reused, self.hits,
                         self.misses)
        self.job_ids, self.ended, self.reused, self.hits, self.misses = [], Counter(), 0, 0, 0
        try:
            yield out
        except BaseException:
            self.merge(out)
            raise

    def send(self, connection: Redis, resident: Container[str] = ()) -> None:
        """Write these departures (`write`) in one round trip of their own.

        Raises:
            the SREM's Redis error.
        """
        if not self:
            return
        with connection.pipeline(transaction=False) as pipe:
            self.write(pipe, resident)
            replies = pipe.execute(raise_on_error=False)
        if self.unheld(resident) and isinstance(replies[0], Exception):
            raise replies[0]

    def unheld(self, resident: Container[str] = ()) -> list[str]:
        """The ids to remove from the held set: not those `resident` again (a job back on
        this worker under a new attempt stays held)."""
        return [j for j in self.job_ids if j not in resident]

    def write(self, pipe, resident: Container[str] = ()) -> None:
        """Queue the SREM of `unheld` (first, where there are any) and the counts on `pipe`;
        the counts are best effort (`jobs.stats`: one Redis refuses is dropped), the SREM,
        a deletion, is never refused."""
        if job_ids := self.unheld(resident):
            pipe.srem(keys.worker_jobs(self.worker), *job_ids)
        for state, n in self.ended.items():
            stats.record_terminal(pipe, JobState(state), n)
        stats.record_reused(pipe, self.reused, self.hits, self.misses)


@dataclass
class Probe:
    """What rides along with a step's scripts.

    Attributes:
        others: ids of the resident jobs outside the step, whose cancel flags are read.
        queue_keys: Redis keys of the RQ queues to admit from (empty: no room).
        chunks: the chunks the step computed, ``(seconds, tokens)`` each, whose stats are
            written (empty: no chunk ran, e.g. a cancel or an exact session hit).
        lifts: tenant -> the floor its virtual service in ``keys.TENANT_SERVICE`` is raised
            to (`LIFT`), before the additions (`worker.fair_share`; best effort, as they).
        service: tenant -> virtual service this worker charged since its last round trip,
            added to ``keys.TENANT_SERVICE`` (`worker.fair_share`; best effort).
        tokens: tenant -> tokens prefilled, added to ``keys.TENANT_TOKENS``.
        held: with `worker`, tenant -> the jobs it holds, written over
            ``keys.worker_tenants(worker)`` (None: unchanged).
        read_service: read ``keys.TENANT_SERVICE`` back (after those additions).
        set_keys: Redis sets whose sizes are read (the tenants' intake levels: a new one is
            seen within a step, not within the scheduler's refresh).
        departed: the jobs that left since the last round trip, forgotten in this one
            (None: none did).
        resident: the jobs resident now, whose ids a departure does not remove.
    """

    others: Sequence[str] = ()
    queue_keys: Sequence[str] = ()
    chunks: Sequence[tuple[float, int]] = ()
    lifts: Mapping[str, float] = field(default_factory=dict)
    service: Mapping[str, float] = field(default_factory=dict)
    tokens: Mapping[str, int] = field(default_factory=dict)
    worker: str = ""
    held: Mapping[str, int] | None = None
    read_service: bool = False
    set_keys: Sequence[str] = ()
    departed: Departures | None = None
    resident: Mapping[str, object] = field(default_factory=dict)


@dataclass
class Reply:
    """What came back: each script's reply (a str for a status word; a Redis error in place
    of a script that failed, e.g. ``OutOfMemoryError`` under maxmemory) and the probe's
    answers (`service`: HGETALL ``keys.TENANT_SERVICE``, None when not read or refused)."""

    outcomes: list
    canceled: list[str] = field(default_factory=list)
    intake_waiting: bool = False
    service: dict | None = None
    set_sizes: list[int] | None = None

    @property
    def outcome(self) -> str:
        """The one script's outcome (a round trip of one call).

        Raises:
            the Redis error that script got.
        """
        (outcome,) = self.outcomes
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def run_scripts(connection: Redis, scripts: Scripts, calls: Sequence[Call],
                probe: Probe | None = None) -> Reply:
    """Run `calls` (registered in `scripts`), `probe`'s reads and its chunks' stats in one
    round trip: a non-transactional pipeline, since each script is atomic on its own and the
    jobs and the stats (`jobs.stats.record_chunks`, on ``keys.STATS``) are in different
    Redis Cluster slots. The rest needs no atomicity: a flag or a queue length a moment old
    only delays a decision by one step; the chunks were computed whatever the scripts answer.

    The scripts go out as plain EVALSHA: redis-py's pipelines otherwise send ``SCRIPT
    EXISTS`` in a round trip of its own before every execution
    (`redis.client.Pipeline.load_scripts`). Those answered ``NOSCRIPT`` (a server that lost
    its script cache) are loaded and sent again, alone: the rest ran. A stats write Redis
    refuses (maxmemory) is dropped: the counters are best effort, the jobs' writes are not.

    Returns:
        the outcomes in the order of `calls`; a script Redis refused holds its error, so
        one job's refused write does not hide the others' outcomes.
    Raises:
        whatever Redis answers for one of the probe's reads (after every script ran).
    """
    probe = probe or Probe()
    replies = _send(connection, scripts, calls, probe, probe.chunks)
    outcomes = replies[:len(calls)]
    missing = [i for i, r in enumerate(outcomes) if isinstance(r, NoScriptError)]
    if missing:
        for script in {id(s): s for s in (scripts.script(calls[i]) for i in missing)}.values():
            script.sha = connection.script_load(script.script)
        again = _send(connection, scripts, [calls[i] for i in missing], Probe(), ())
        for i, reply in zip(missing, again, strict=True):
            outcomes[i] = reply
    n_flags = len(probe.others)
    reads = replies[len(calls):len(calls) + n_flags + len(probe.queue_keys)]
    errors = [r for r in reads if isinstance(r, Exception)]
    if errors:
        raise errors[0]
    flags, lengths = reads[:n_flags], reads[n_flags:]
    service = None
    # after the reads, the lifts and the additions
    at = (len(calls) + len(reads) + len(probe.lifts) + len(probe.service) + len(probe.tokens)
          + _held_writes(probe))
    if probe.read_service:
        service = None if isinstance(replies[at], Exception) else replies[at]
        at += 1
    sizes = replies[at:at + len(probe.set_keys)] if probe.set_keys else None
    at += len(probe.set_keys)
    if probe.departed and probe.departed.unheld(probe.resident) and isinstance(replies[at],
                                                                              Exception):
        raise replies[at]  # the departures' SREM (their counts are best effort)
    if sizes is not None and any(isinstance(n, Exception) for n in sizes):
        sizes = None
    return Reply(
        outcomes=[o.decode() if isinstance(o, bytes) else o for o in outcomes],
        canceled=[j for j, flagged in zip(probe.others, flags, strict=True) if flagged],
        intake_waiting=any(n > 0 for n in lengths),
        service=service,
        set_sizes=sizes,
    )


def _held_writes(probe: Probe) -> int:
    """Commands that write `probe.held`: a DEL, and an HSET unless it is empty."""
    if probe.held is None or not probe.worker:
        return 0
    return 1 + bool(probe.held)


def _send(connection: Redis, scripts: Scripts, calls: Sequence[Call], probe: Probe,
          chunks: Sequence[tuple[float, int]]) -> list:
    with connection.pipeline(transaction=False) as pipe:
        for call in calls:
            pipe.evalsha(scripts.script(call).sha, len(call.keys), *call.keys, *call.args)
        for job_id in probe.others:
            pipe.exists(keys.cancel(job_id))
        for key in probe.queue_keys:
            pipe.llen(key)
        for tenant, floor in probe.lifts.items():
            pipe.eval(LIFT, 1, keys.TENANT_SERVICE, tenant, repr(floor))
        for tenant, amount in probe.service.items():  # a refusal (maxmemory) is dropped
            pipe.hincrbyfloat(keys.TENANT_SERVICE, tenant, amount)
        for tenant, n in probe.tokens.items():
            pipe.hincrby(keys.TENANT_TOKENS, tenant, n)
        if _held_writes(probe):
            pipe.delete(keys.worker_tenants(probe.worker))
            if probe.held:
                pipe.hset(keys.worker_tenants(probe.worker), mapping=dict(probe.held))
        if probe.read_service:
            pipe.hgetall(keys.TENANT_SERVICE)
        for key in probe.set_keys:
            pipe.scard(key)
        if probe.departed:
            probe.departed.write(pipe, probe.resident)
        if chunks:
            stats.record_chunks(pipe, chunks)
        return pipe.execute(raise_on_error=False)  # every reply, errors included
