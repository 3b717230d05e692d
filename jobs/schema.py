"""Job states and the records clients read: `JobStatus` and `PrefillResult`.

A job is one Redis hash (``keys.job(id)``); these classes decode it. Field names and
meanings are DESIGN.md §2.
"""

from __future__ import annotations

import array
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from .serializer import unpackb

DEFAULT_MAX_ATTEMPTS = 3
# Once terminal, a job's record (status + top-k result) lives this long; full logits less.
DEFAULT_RESULT_TTL_S = 24 * 3600
DEFAULT_LOGITS_TTL_S = 3600
# A worker counts as dead this long after its last heartbeat.
DEFAULT_HEARTBEAT_TTL_S = 30
# Error messages are capped so a pathological input cannot bloat Redis.
MAX_ERROR_CHARS = 2000


class JobState(str, Enum):
    """A job's state; compares equal to, and prints as, its plain string value."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.FINISHED, JobState.FAILED, JobState.CANCELED)

    def __str__(self) -> str:
        return self.value


class LogitsMode(str, Enum):
    NONE = "none"
    TOP_K = "top_k"
    FULL = "full"


def now() -> float:
    """UTC epoch seconds."""
    return time.time()


def _str(raw: dict[bytes, bytes], name: str) -> str | None:
    value = raw.get(name.encode())
    return None if value is None or value == b"" else value.decode()


def _int(raw: dict[bytes, bytes], name: str, default: int | None = 0) -> int | None:
    value = _str(raw, name)
    return default if value is None else int(value)


def _float(raw: dict[bytes, bytes], name: str) -> float | None:
    value = _str(raw, name)
    return None if value is None else float(value)


@dataclass
class JobStatus:
    """A job's status as the client sees it (DESIGN.md §2). Times are UTC epoch seconds."""

    job_id: str
    state: JobState
    model: str
    n_tokens: int | None
    cursor: int
    progress: float
    recovery_position: int | None
    chunks_done: int
    cached_tokens: int
    attempts: int
    cancel_requested: bool
    worker: str | None
    enqueued_at: float | None
    started_at: float | None
    updated_at: float | None
    finished_at: float | None
    error: dict[str, str] | None

    @classmethod
    def from_hash(cls, job_id: str, raw: dict[bytes, bytes]) -> JobStatus:
        n_tokens = _int(raw, "n_tokens", None)
        cursor = _int(raw, "cursor") or 0
        error_type = _str(raw, "error_type")
        return cls(
            job_id=job_id,
            state=JobState(_str(raw, "state")),
            model=_str(raw, "model") or "",
            n_tokens=n_tokens,
            cursor=cursor,
            progress=(cursor / n_tokens) if n_tokens else 0.0,
            recovery_position=_int(raw, "recovery_position", None),
            chunks_done=_int(raw, "chunks_done") or 0,
            cached_tokens=_int(raw, "cached_tokens") or 0,
            attempts=_int(raw, "attempts") or 0,
            cancel_requested=bool(_int(raw, "cancel_requested")),
            worker=_str(raw, "worker"),
            enqueued_at=_float(raw, "enqueued_at"),
            started_at=_float(raw, "started_at"),
            updated_at=_float(raw, "updated_at"),
            finished_at=_float(raw, "finished_at"),
            error=(
                {"type": error_type, "message": _str(raw, "error_message") or ""}
                if error_type
                else None
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["state"] = self.state.value
        return out


@dataclass
class TopLogit:
    id: int
    logit: float
    logprob: float
    piece: str


@dataclass
class PrefillResult:
    """What a finished job produced.

    Attributes:
        top_k: highest logits first; ``logprob`` is log-softmax over the whole vocabulary.
        logits: float32 ``[vocab]`` (``array('f')``) when submitted with ``logits="full"``.
        timings: ``queue_wait_s``, ``prefill_s`` (first start to finish), ``compute_s``
            (forward passes only), ``tokens_per_s`` (n_tokens / prefill_s).
    """

    job_id: str
    n_tokens: int
    cached_tokens: int
    chunks_done: int
    top_k: list[TopLogit]
    timings: dict[str, float]
    model_sha256: str
    logits: array.array | None = field(default=None, repr=False)

    @classmethod
    def from_blob(cls, job_id: str, blob: bytes, logits: bytes | None) -> PrefillResult:
        data = unpackb(blob)
        values = None
        if logits is not None:
            values = array.array("f")
            values.frombytes(unpackb(logits))
        return cls(
            job_id=job_id,
            n_tokens=data["n_tokens"],
            cached_tokens=data.get("cached_tokens", 0),
            chunks_done=data["chunks_done"],
            top_k=[TopLogit(**t) for t in data["top_k"]],
            timings=data["timings"],
            model_sha256=data["model_sha256"],
            logits=values,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("logits")
        return out
