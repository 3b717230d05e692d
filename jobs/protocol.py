"""What every client of the queue does the same way, whatever its Redis I/O: the pieces
`PrefillClient` (redis) and `AsyncPrefillClient` (redis.asyncio) share.

Each function is pure (no Redis calls): it builds what a client sends (a new record, the
keys and arguments of a script) or decodes what Redis replied, and raises the typed errors.
The clients only do the I/O around them, so the two cannot drift apart.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping

from . import keys
from .errors import (
    JobCanceled,
    JobFailed,
    JobNotFound,
    JobTimeout,
    QueueFull,
    TokenizerUnavailable,
    UnknownModel,
)
from .record import JobRecord
from .requests import ModelInfo, new_record
from .schema import JobState, JobStatus, PrefillResult, now
from .serializer import unpackb
from .tokenizer import ServedTokenizer

# `watch` re-reads the job at least this often (seconds), in case a pub/sub message was lost.
WATCH_RECHECK_S = 1.0


def submitted_record(**submit) -> JobRecord:
    """A new job's queued record under a fresh id, from `submit`'s keywords (checked by
    `jobs.requests.new_record`, whose errors it raises)."""
    return new_record(uuid.uuid4().hex, enqueued_at=now(), **submit)


def model_info(name: str, blob: bytes) -> ModelInfo:
    """Decode one ``keys.MODELS`` entry (msgpack) of model `name`."""
    return ModelInfo(name=name, **unpackb(blob))


def models_of(raw: Mapping[bytes, bytes]) -> dict[str, ModelInfo]:
    """Decode HGETALL ``keys.MODELS``: the registered models by name."""
    return {name.decode(): model_info(name.decode(), blob) for name, blob in raw.items()}


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


def check_depth(model: str, depth: int, max_queue_depth: int) -> None:
    """Raises QueueFull when `model`'s intake queues hold `max_queue_depth` jobs or more."""
    if depth >= max_queue_depth:
        raise QueueFull(f"intake queues of {model} hold {max_queue_depth} jobs")


def not_found(job_id: str) -> JobNotFound:
    return JobNotFound(f"no job {job_id!r} (never submitted, or expired)")


def status_of(job_id: str, raw: Mapping[bytes, bytes]) -> JobStatus:
    """Decode HGETALL of the job's record. Raises JobNotFound on an empty reply."""
    if not raw:
        raise not_found(job_id)
    return JobRecord.from_hash(job_id, dict(raw)).status()


def cancel_keys(job_id: str) -> list[str]:
    """KEYS of ``scripts.CANCEL`` for `job_id`."""
    return [keys.job(job_id), keys.cancel(job_id), keys.events(job_id)]


def cancel_args(result_ttl_s: int) -> list[float | int]:
    """ARGV of ``scripts.CANCEL``: now, and the TTL (s) of a record canceled while queued."""
    return [now(), result_ttl_s]


def cancel_changed(job_id: str, outcome: bytes) -> bool:
    """Decode ``scripts.CANCEL``'s reply: True if the cancel changed anything.

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


def check_finished(job_id: str, status: JobStatus) -> None:
    """Raise unless the terminal `status` is ``finished``.

    Raises:
        JobFailed: the job failed (``error_type``, ``message``).
        JobCanceled: the job was canceled.
    """
    if status.state == JobState.FAILED:
        raise JobFailed(job_id, status.error["type"], status.error["message"])
    if status.state == JobState.CANCELED:
        raise JobCanceled(f"job {job_id} was canceled at cursor {status.cursor}")


def result_of(job_id: str, blob: bytes, logits: bytes | None,
              prompt_logprobs: bytes | None = None) -> PrefillResult:
    """Decode a finished job's ``result`` field, its logits key and its prompt logprobs key
    (each None when absent)."""
    return PrefillResult.from_blob(job_id, blob, logits, prompt_logprobs)
