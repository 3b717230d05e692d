"""One Redis round trip per chunk: the job's fenced transition plus what the loop needs next.

After each chunk the worker sends, in one non-transactional pipeline: the job's fenced
checkpoint (or publish) script, the cancel flag of every other resident job, and the length
of each queue it would admit from. The script is atomic on its own; the reads beside it need
no atomicity (a flag or a queue length a moment old only delays a decision by one chunk).

Scripts go out as plain EVALSHA: redis-py's pipelines otherwise send ``SCRIPT EXISTS`` in a
round trip of their own before every execution (`redis.client.Pipeline.load_scripts`). A
server that lost its script cache (a restart) answers ``NOSCRIPT``; the script is loaded and
the whole pipeline, whose other commands only read, is sent again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from redis import Redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from jobs import keys


@dataclass
class Probe:
    """The reads that ride along with a chunk's script.

    Attributes:
        others: ids of the other resident jobs, whose cancel flags are read.
        queue_keys: Redis keys of the RQ queues to admit from (empty: no room).
    """

    others: Sequence[str] = ()
    queue_keys: Sequence[str] = ()


@dataclass
class Reply:
    """What came back: the script's outcome and the probe's answers."""

    outcome: str
    canceled: list[str] = field(default_factory=list)
    intake_waiting: bool = False


def run_script(connection: Redis, script: Script, script_keys: Sequence[str],
               args: Sequence, probe: Probe | None = None) -> Reply:
    """Run `script` on `script_keys`/`args` and `probe`'s reads in one round trip.

    Raises:
        whatever Redis answers for the script (e.g. ``OutOfMemoryError`` under maxmemory),
        after the probe's reads have run.
    """
    probe = probe or Probe()
    try:
        replies = _send(connection, script, script_keys, args, probe)
    except NoScriptError:
        script.sha = connection.script_load(script.script)
        replies = _send(connection, script, script_keys, args, probe)
    outcome = replies[0]
    flags = replies[1:1 + len(probe.others)]
    lengths = replies[1 + len(probe.others):]
    return Reply(
        outcome=outcome.decode() if isinstance(outcome, bytes) else str(outcome),
        canceled=[j for j, flagged in zip(probe.others, flags, strict=True) if flagged],
        intake_waiting=any(n > 0 for n in lengths),
    )


def _send(connection: Redis, script: Script, script_keys: Sequence[str], args: Sequence,
          probe: Probe) -> list:
    with connection.pipeline(transaction=False) as pipe:
        pipe.evalsha(script.sha, len(script_keys), *script_keys, *args)
        for job_id in probe.others:
            pipe.exists(keys.cancel(job_id))
        for key in probe.queue_keys:
            pipe.llen(key)
        return pipe.execute()
