"""The pure pieces of both clients (`PrefillClient`, `AsyncPrefillClient`) that the plans of
`jobs.core` and the two `watch` loops use: decoding what Redis replied, building a script's
call, a watch's deadline and outage (`Watch`), each raising the typed errors. No Redis calls.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping

from . import scripts
from .errors import (
    CorruptJob,
    JobCanceled,
    JobFailed,
    JobNotFound,
    JobTimeout,
    QueueFull,
    TokenizerUnavailable,
    UnknownModel,
)
from .limits import Limits
from .record import JobRecord
from .requests import ModelInfo, new_record
from .result import PrefillResult
from .schema import JobState, JobStatus, now
from .serializer import DECODE_ERRORS, unpackb
from .tokenizer import ServedTokenizer

# `watch` re-reads the job at least this often (seconds), in case a pub/sub message was lost.
WATCH_RECHECK_S = 1.0


def submitted_record(limits: Limits, **submit) -> JobRecord:
    """A new job's queued record under a fresh id, from `submit`'s keywords (checked against
    `limits` by `jobs.requests.new_record`, whose errors it raises)."""
    return new_record(uuid.uuid4().hex, enqueued_at=now(), limits=limits, **submit)


def model_info(name: str, blob: bytes) -> ModelInfo:
    """Decode one ``keys.MODELS`` entry (msgpack) of model `name`.

    Raises:
        UnknownModel: the entry does not decode (written by something other than a worker;
            the model's workers rewrite it with every heartbeat).
    """
    try:
        info = ModelInfo(name=name, **unpackb(blob))
        if not all(isinstance(getattr(info, f), int) for f in ("vocab_size", "context_length")):
            raise TypeError("vocab_size and context_length must be integers")
        return info
    except DECODE_ERRORS as e:
        raise UnknownModel(f"model {name!r}'s registration cannot be decoded "
                           f"({type(e).__name__}: {e})") from e


def models_of(raw: Mapping[bytes, bytes]) -> dict[str, ModelInfo]:
    """Decode HGETALL ``keys.MODELS``: the registered models by name (entries that do not
    decode are left out)."""
    out = {}
    for name, blob in raw.items():
        try:
            out[name.decode()] = model_info(name.decode(), blob)
        except (UnicodeDecodeError, UnknownModel):
            continue
    return out


def unknown_model(name: str, registered: Mapping[str, ModelInfo]) -> UnknownModel:
    """The error for a submit to `name`, which no worker in `registered` serves."""
    known = ", ".join(sorted(registered)) or "none"
    return UnknownModel(f"no registered worker serves model {name!r} (registered: {known})")


def tokenizer_of(model: ModelInfo, blob: bytes | None) -> ServedTokenizer:
    """Build `model`'s tokenizer from GET ``keys.tokenizer(model.sha256)`` (~1 s for Gemma 3:
    run it off the event loop).

    Raises:
        TokenizerUnavailable: no blob (the model's workers predate tokenizer publishing),
            or one of a newer format.
        TokenizerMalformed: the blob cannot be decoded.
    """
    if blob is None:
        raise TokenizerUnavailable(
            f"no tokenizer is published for model {model.name!r} (sha256 {model.sha256[:12]}): "
            "its workers predate tokenizer publishing; upgrade and restart one")
    return ServedTokenizer.from_blob(blob)


def check_depth(model: str, depth: int, tenant_depth: int, tenant_quota: int | None,
                max_queue_depth: int, tenant: str | None = None) -> None:
    """Raises QueueFull when `model`'s intake queues hold `max_queue_depth` jobs or more, or
    `tenant`'s hold its quota (``keys.TENANT_MAX_QUEUED``) or more: then only that tenant's
    submits are refused."""
    if depth >= max_queue_depth:
        raise QueueFull(f"intake queues of {model} hold {max_queue_depth} jobs")
    if tenant_quota is not None and tenant_depth >= tenant_quota:
        raise QueueFull(f"tenant {tenant!r} is at its quota of {tenant_quota} queued jobs "
                        f"for {model} (prefillq:tenant-max-queued)")


def quota(raw: bytes | None) -> int | None:
    """HGET of a tenant's quota: a non-negative integer, else None (no quota; junk is
    none, so a typo never refuses a tenant's every job)."""
    try:
        value = int(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 else None


def not_found(job_id: object) -> JobNotFound:
    return JobNotFound(f"no job {job_id!r} (never submitted, or expired)")


def checked_id(job_id: object) -> str:
    """`job_id` if it can name a job (a non-empty str that UTF-8 encodes), checked before
    any Redis call. Raises JobNotFound otherwise (no job has such an id)."""
    if not isinstance(job_id, str) or not job_id:
        raise not_found(job_id)
    try:
        job_id.encode("utf-8")
    except UnicodeEncodeError as e:
        raise not_found(job_id) from e
    return job_id


def status_of(job_id: str, raw: Mapping[bytes, bytes]) -> JobStatus:
    """Decode HGETALL of the job's record.

    Raises:
        JobNotFound: an empty reply.
        CorruptJob: the record does not decode (`JobRecord.from_hash`).
    """
    if not raw:
        raise not_found(job_id)
    return JobRecord.from_hash(job_id, dict(raw)).status()


def cancel_call(job_id: str, result_ttl_s: int) -> scripts.Call:
    """The `jobs.scripts.cancel` of `job_id` now; a record canceled while queued lives
    `result_ttl_s` seconds more. Raises JobNotFound for an id no job has."""
    return scripts.cancel(checked_id(job_id), now=now(), ttl_s=result_ttl_s)


def cancel_changed(job_id: str, outcome: bytes) -> bool:
    """Decode `jobs.scripts.cancel`'s reply: True if the cancel changed anything.

    Raises:
        JobNotFound: no such job.
    """
    outcome = outcome.decode()
    if outcome == "missing":
        raise not_found(job_id)
    return outcome in ("canceled", "requested")


def live_holder(holder: bytes | None, alive: bool) -> str | None:
    """The session holder GET replied (`holder`) if its heartbeat key exists (`alive`)."""
    return holder.decode() if holder is not None and alive else None


def watch_deadline(timeout: float | None) -> float | None:
    """The monotonic time (s) a `watch` of `timeout` seconds ends, or None."""
    return None if timeout is None else time.monotonic() + timeout


def subscribe_wait(deadline: float | None) -> float:
    """Seconds `watch` waits for its channel's SUBSCRIBE to be confirmed before its first
    read: at most WATCH_RECHECK_S, 0 once `deadline` (monotonic, or None) has passed."""
    left = WATCH_RECHECK_S if deadline is None else deadline - time.monotonic()
    return max(0.0, min(left, WATCH_RECHECK_S))


# A `watch` rides out Redis being unreachable (a restart, a failover) for up to this many
# seconds of failed reads in a row, never past its deadline; then it raises the error.
WATCH_OUTAGE_S = 30.0
# between tries it waits 0.05 s, doubling to at most 1 s
OUTAGE_RETRY_FIRST_S = 0.05
OUTAGE_RETRY_MAX_S = 1.0


class Outage:
    """How a `watch` rides out an unreachable Redis: `retry_in` after each failed read
    says how long to wait before the next, or that it is time to give up."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.delay = 0.0

    def ended(self) -> None:
        """A read succeeded."""
        self.since, self.delay = None, 0.0

    def retry_in(self, deadline: float | None) -> float | None:
        """Seconds to wait before the next try, or None: the outage has lasted
        WATCH_OUTAGE_S or the `deadline` (monotonic, or None) has passed."""
        at = time.monotonic()
        if self.since is None:
            self.since = at
        limit = self.since + WATCH_OUTAGE_S
        if deadline is not None:
            limit = min(limit, deadline)
        if at >= limit:
            return None
        self.delay = min(max(2 * self.delay, OUTAGE_RETRY_FIRST_S), OUTAGE_RETRY_MAX_S)
        return min(self.delay, limit - at)


def watch_wait(job_id: str, status: JobStatus, deadline: float | None) -> float:
    """Seconds `watch` waits for the next event after seeing a non-terminal `status`.

    Raises:
        JobTimeout: `deadline` has passed.
    """
    left = WATCH_RECHECK_S if deadline is None else deadline - time.monotonic()
    if left <= 0:
        raise JobTimeout(f"job {job_id} is still {status.state.value}")
    return min(left, WATCH_RECHECK_S)


class Watch:
    """What one `watch` of `job_id` keeps between reads, whatever its I/O: its deadline
    (monotonic s, or None), the status it last yielded, and its `Outage`.

    Raises:
        JobNotFound: `job_id` cannot name a job (`checked_id`), before any Redis call.
    """

    def __init__(self, job_id: str, timeout: float | None):
        self.job_id = checked_id(job_id)
        self.deadline = watch_deadline(timeout)
        self.outage = Outage()
        self.last: JobStatus | None = None

    def news(self, status: JobStatus) -> bool:
        """A read returned `status`: whether it differs from the last one (to yield)."""
        self.outage.ended()
        new = status != self.last
        self.last = status
        return new

    def retry_in(self, error: Exception) -> float:
        """Seconds to wait after a failed read. Raises `error` once the outage has lasted
        WATCH_OUTAGE_S or the deadline has passed."""
        delay = self.outage.retry_in(self.deadline)
        if delay is None:
            raise error
        return delay

    def first_wait(self) -> float:
        """Seconds to wait for the channel's SUBSCRIBE to be confirmed (`subscribe_wait`)."""
        return subscribe_wait(self.deadline)

    def wait(self, status: JobStatus) -> float:
        """Seconds to wait for the next event after a non-terminal `status`. Raises
        JobTimeout once the deadline has passed (`watch_wait`)."""
        return watch_wait(self.job_id, status, self.deadline)


def check_finished(job_id: str, status: JobStatus) -> None:
    """Raise unless the terminal `status` is ``finished``.

    Raises:
        JobFailed: the job failed (``error_type``, ``message``).
        JobCanceled: the job was canceled.
    """
    if status.state == JobState.FAILED:
        error = status.error or {"type": "unknown", "message": "the record holds no error"}
        raise JobFailed(job_id, error["type"], error["message"])
    if status.state == JobState.CANCELED:
        raise JobCanceled(f"job {job_id} was canceled at cursor {status.cursor}")


def result_of(job_id: str, blob: bytes | None, logits: bytes | None,
              prompt_logprobs: bytes | None = None) -> PrefillResult:
    """Decode a finished job's ``result`` field, its logits key and its prompt logprobs key
    (each None when absent).

    Raises:
        CorruptJob: the result is missing or any of them does not decode.
    """
    try:
        return PrefillResult.from_blob(job_id, blob, logits, prompt_logprobs)
    except DECODE_ERRORS as e:
        raise CorruptJob(f"job {job_id}'s result cannot be decoded ({type(e).__name__}: "
                         f"{str(e)[:200]})", fields=("result",)) from e
