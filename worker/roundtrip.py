"""One Redis round trip per chunk: the job's fenced transition plus what the loop needs next.

After each chunk the worker sends the job's checkpoint (or publish) script, the other
resident jobs' cancel flags, the admission queues' lengths and the chunk's stats together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from redis import Redis
from redis.exceptions import NoScriptError

from jobs import keys, stats
from jobs.scripts import Call, Scripts


@dataclass
class Probe:
    """What rides along with a chunk's script.

    Attributes:
        others: ids of the other resident jobs, whose cancel flags are read.
        queue_keys: Redis keys of the RQ queues to admit from (empty: no room).
        chunk: the chunk just computed, ``(seconds, tokens)``, whose stats are written
            (None: no chunk ran, e.g. a cancel or an exact session hit).
    """

    others: Sequence[str] = ()
    queue_keys: Sequence[str] = ()
    chunk: tuple[float, int] | None = None


@dataclass
class Reply:
    """What came back: the script's outcome and the probe's answers."""

    outcome: str
    canceled: list[str] = field(default_factory=list)
    intake_waiting: bool = False


def run_script(connection: Redis, scripts: Scripts, call: Call,
               probe: Probe | None = None) -> Reply:
    """Run `call` (registered in `scripts`), `probe`'s reads and its chunk's stats in one
    round trip: a non-transactional pipeline, since the stats (`jobs.stats.record_chunk`,
    on ``keys.STATS``) are in another Redis Cluster slot than the job. The script is atomic
    on its own; the rest needs no atomicity (a flag or a queue length a moment old only
    delays a decision by one chunk; the chunk was computed whatever the script answers).

    The script goes out as plain EVALSHA: redis-py's pipelines otherwise send ``SCRIPT
    EXISTS`` in a round trip of its own before every execution
    (`redis.client.Pipeline.load_scripts`). On ``NOSCRIPT`` (a server that lost its script
    cache) the script is loaded and the pipeline sent again without the stats, which landed
    the first time. A stats write Redis refuses (maxmemory) is dropped: the counters are
    best effort, the job's write is not.

    Raises:
        whatever Redis answers for the script or a read (e.g. ``OutOfMemoryError`` under
        maxmemory), after the probe's reads and the stats have run; never a stats error.
    """
    probe = probe or Probe()
    script = scripts.script(call)
    replies = _send(connection, script, call, probe, probe.chunk)
    if isinstance(replies[0], NoScriptError):
        script.sha = connection.script_load(script.script)
        replies = _send(connection, script, call, probe, None)
    n_flags = len(probe.others)
    replies = replies[:1 + n_flags + len(probe.queue_keys)]  # the stats' replies are dropped
    errors = [r for r in replies if isinstance(r, Exception)]
    if errors:
        raise errors[0]
    outcome, flags, lengths = replies[0], replies[1:1 + n_flags], replies[1 + n_flags:]
    return Reply(
        outcome=outcome.decode() if isinstance(outcome, bytes) else str(outcome),
        canceled=[j for j, flagged in zip(probe.others, flags, strict=True) if flagged],
        intake_waiting=any(n > 0 for n in lengths),
    )


def _send(connection: Redis, script, call: Call, probe: Probe,
          chunk: tuple[float, int] | None) -> list:
    with connection.pipeline(transaction=False) as pipe:
        pipe.evalsha(script.sha, len(call.keys), *call.keys, *call.args)
        for job_id in probe.others:
            pipe.exists(keys.cancel(job_id))
        for key in probe.queue_keys:
            pipe.llen(key)
        if chunk is not None:
            stats.record_chunk(pipe, *chunk)
        return pipe.execute(raise_on_error=False)  # every reply, errors included
