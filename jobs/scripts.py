"""Every job transition as a Python function with named arguments (the Lua is `jobs.lua`).

A function builds a `Call`: which script, and its KEYS and ARGV in the order the Lua reads
them, so no caller spells a position. `Scripts(redis).run(call)` runs it (EVALSHA with a
reload, as redis-py's `Script`; awaitable on a ``redis.asyncio`` client), in a pipeline
when given ``client=pipe``; `worker.roundtrip` sends a call beside a chunk's other reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.commands.core import Script

from . import keys, lua
from .defaults import MAX_ERROR_CHARS

SOURCES = {
    "start": lua.START, "progress": lua.PROGRESS, "publish": lua.PUBLISH, "fail": lua.FAIL,
    "requeue": lua.REQUEUE, "reap": lua.REAP, "checkpoint_switch": lua.CHECKPOINT_SWITCH,
    "cancel": lua.CANCEL, "refuse": lua.REFUSE, "release": lua.RELEASE, "take": lua.TAKE,
}


@dataclass(frozen=True)
class Call:
    """One invocation of script `name` (a key of `SOURCES`) with its KEYS and ARGV."""

    name: str
    keys: tuple[str, ...]
    args: tuple = ()


@dataclass(frozen=True)
class Fence:
    """The fencing token of a job's attempt: the worker holding it and the attempt number
    its start was given. A fenced script changes nothing once either no longer matches."""

    worker: str
    attempt: int


@dataclass(frozen=True)
class StartCounts:
    """What a start records beside ``prefilling``: the prompt's size in tokens, the recovery
    position, where this attempt's cursor starts, the tokens reused from a session's slot,
    how they were reused (``cold``, ...) and the cursor a KV checkpoint restored (None: not
    resumed)."""

    n_tokens: int
    recovery_position: int
    cursor: int
    cached_tokens: int
    reuse: str
    resumed_from: int | None


class Scripts:
    """The scripts registered on one connection (sync or ``redis.asyncio``)."""

    def __init__(self, redis):
        self._scripts: dict[str, Script] = {n: redis.register_script(s)
                                            for n, s in SOURCES.items()}

    def script(self, call: Call) -> Script:
        """The registered script `call` runs (its ``sha`` and source)."""
        return self._scripts[call.name]

    def run(self, call: Call, client=None):
        """Run `call` on the connection, or queue it on `client` (a pipeline); returns the
        script's reply (a coroutine of it on an asyncio connection)."""
        return self._scripts[call.name](keys=list(call.keys), args=list(call.args),
                                        client=client)


def _job_keys(job_id: str) -> tuple[str, str, str]:
    return keys.job(job_id), keys.cancel(job_id), keys.events(job_id)


def start(job_id: str, *, worker: str, now: float, token: str, chunk_plan: bytes = b"",
          counts: StartCounts | None = None) -> Call:
    """Take a queued job: ``queued -> prefilling``, attempts + 1. Replies ``[outcome,
    attempt]``: ``started`` (again for a retried start with the same `token`), else the
    job's state or ``missing``.

    Args:
        token: unique to this start, so a start retried after a lost reply finds itself.
        chunk_plan: the packed chunk plan, recorded at the job's first start only.
        counts: the prefill's counts; None when its input failed (it fails next).
    """
    sizes = () if counts is None else (
        counts.n_tokens, counts.recovery_position, counts.cursor, counts.cached_tokens,
        counts.reuse, "" if counts.resumed_from is None else counts.resumed_from)
    return Call("start", (keys.job(job_id), keys.events(job_id)),
                (worker, now, token, chunk_plan, *sizes))


def _fenced(name: str, job_id: str, fence: Fence, now: float, ttl_s: int, *args,
            extra_keys: Sequence[str] = ()) -> Call:
    return Call(name, (*_job_keys(job_id), *extra_keys),
                (fence.worker, fence.attempt, now, ttl_s, *args))


def progress(job_id: str, fence: Fence, *, now: float, ttl_s: int, cursor: int,
             chunks_done: int, n_tokens: int, recovery_position: int) -> Call:
    """Record a chunk's progress, then stop if a cancel was requested. Replies
    ``continue``, ``canceled`` (the record lives `ttl_s` seconds more) or ``fenced``."""
    return _fenced("progress", job_id, fence, now, ttl_s, cursor, chunks_done, n_tokens,
                   recovery_position)


def publish(job_id: str, fence: Fence, *, now: float, ttl_s: int, result: bytes,
            logits: bytes, logits_ttl_s: int, cursor: int, chunks_done: int,
            prompt_logprobs: bytes) -> Call:
    """Publish the result (`jobs.result`) and ``finished`` together, unless canceled or
    fenced. `logits` and `prompt_logprobs` are their blobs or ``b""`` (none asked for); they
    live `logits_ttl_s` seconds. Replies ``finished``, ``canceled`` or ``fenced``."""
    return _fenced("publish", job_id, fence, now, ttl_s, result, logits, logits_ttl_s,
                   cursor, chunks_done, prompt_logprobs,
                   extra_keys=(keys.logits(job_id), keys.prompt_logprobs(job_id)))


def fail(job_id: str, fence: Fence, *, now: float, ttl_s: int, error_type: str,
         message: str) -> Call:
    """Fail the job with ``error.type`` `error_type` (the message cut to
    ``MAX_ERROR_CHARS``). Replies ``failed`` or ``fenced``."""
    return _fenced("fail", job_id, fence, now, ttl_s, error_type, message[:MAX_ERROR_CHARS])


def requeue(job_id: str, fence: Fence, *, now: float, ttl_s: int,
            failure: tuple[str, str] | None = None) -> Call:
    """Hand the job back (cursor 0, ``queued``), or fail it once its failures reach
    ``max_attempts``; canceled wins. `failure` ``(error type, message)`` counts toward
    them; a hand-back (None) does not. The caller enqueues its RQ job in the same MULTI.
    Replies ``queued``, ``failed``, ``canceled`` or ``fenced``."""
    return _fenced("requeue", job_id, fence, now, ttl_s, *_failure_args(failure))


def reap(job_id: str, worker: str, *, now: float, ttl_s: int, message: str) -> Call:
    """The reaper takes dead `worker`'s job: as `requeue` with a ``WorkerLost`` failure,
    fenced on the worker only."""
    return _fenced("reap", job_id, Fence(worker, 0), now, ttl_s,
                   *_failure_args(("WorkerLost", message)))


def _failure_args(failure: tuple[str, str] | None) -> tuple[str, str, str]:
    error_type, message = failure or ("", "")
    return "1" if failure else "0", error_type, message[:MAX_ERROR_CHARS]


def checkpoint_switch(job_id: str, fence: Fence, *, record_key: str, cursor: int) -> Call:
    """Point the job at the KV checkpoint `record_key` (at `cursor`) once its blobs are all
    stored, unless `fence` lost the job. Replies ``switched`` or ``fenced``."""
    return Call("checkpoint_switch", (keys.job(job_id),),
                (fence.worker, fence.attempt, record_key, cursor))


def cancel(job_id: str, *, now: float, ttl_s: int) -> Call:
    """A client's cancel: a queued job ends ``canceled`` at once (its record lives `ttl_s`
    seconds more), a prefilling one is flagged for its worker. Replies ``canceled``,
    ``requested``, ``pending`` (flagged before), ``unchanged`` (ended) or ``missing``."""
    return Call("cancel", _job_keys(job_id), (now, ttl_s))


def refuse(job_id: str, *, now: float, ttl_s: int, error_type: str, message: str,
           drop_fields: Sequence[str] = ()) -> Call:
    """Fail a job whose record does not decode, dropping `drop_fields` so its status reads
    again; a held job is left alone. Replies ``failed``, ``unchanged`` or ``missing``."""
    return Call("refuse", (keys.job(job_id), keys.events(job_id)),
                (now, ttl_s, error_type, message[:MAX_ERROR_CHARS], *drop_fields))


def release(key: str, owner: str) -> Call:
    """Delete `key` only while it holds `owner` (an idempotency claim's job id, a session
    holder's worker name). Replies 1 (deleted) or 0."""
    return Call("release", (key,), (owner,))


def take(taking_key: str, queue_keys: Sequence[str], count: int = 1,
         caps: Sequence[int] | None = None) -> Call:
    """Pop up to `count` RQ job ids of `queue_keys`, in order, at most ``caps[i]`` of
    ``queue_keys[i]`` (None: no cap but `count`), and add each to the worker's taking set
    `taking_key` in the same step. Replies ``[queue key, id, queue key, id, ...]``, empty
    when the queues are."""
    return Call("take", (taking_key, *queue_keys), (int(count), *map(int, caps or ())))
