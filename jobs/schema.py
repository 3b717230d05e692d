"""What clients read: job states, `JobStatus` and `PrefillResult`.

A job is one Redis hash, decoded by `jobs.record.JobRecord`; `JobRecord.status()` gives the
`JobStatus`. docs/architecture.md ("Job lifecycle") gives each field's meaning.
"""

from __future__ import annotations

import array
import math
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from .serializer import unpackb


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


@dataclass
class JobStatus:
    """A job's status as the client sees it. Times are UTC epoch seconds, sizes tokens.

    ``cached_tokens`` were reused from the session's slot (the cursor starts there) and
    ``reuse`` says how: ``cold`` (no slot, or not a session job), ``live`` (the prompt
    extends every committed token), ``recovery-anchor`` (it extends the turn anchor's),
    ``reset`` (neither; the slot starts over), ``exact`` (the prompt equals the committed
    tokens: no forward pass), or ``grow-live``, ``grow-recovery-anchor``, ``grow-reset`` when
    the slot's cache grew first. DESIGN.md §7 and `model.session` have the rules.
    ``resumed_from`` is the cursor this attempt restored from a KV checkpoint (None: it
    started without one); the cursor never goes back past it (DESIGN.md §9).
    """

    job_id: str
    state: JobState
    model: str
    n_tokens: int | None
    cursor: int
    progress: float
    recovery_position: int | None
    chunks_done: int
    cached_tokens: int
    reuse: str
    resumed_from: int | None
    attempts: int
    cancel_requested: bool
    worker: str | None
    enqueued_at: float | None
    started_at: float | None
    updated_at: float | None
    finished_at: float | None
    error: dict[str, str] | None

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
        prompt_logprobs: with ``prompt_logprobs=K``, n_tokens + 1 entries
            ``{"token": int | None, "logprob": float | None, "top": [{"id": int,
            "logprob": float}, ...]}`` (`prompt_logprobs_of`); else None.
        timings: ``queue_wait_s``, ``prefill_s`` (first start to finish), ``compute_s``
            (forward passes only), ``tokens_per_s`` ((n_tokens - cached_tokens) / prefill_s:
            tokens prefilled, not reused from a session's slot).
    """

    job_id: str
    n_tokens: int
    cached_tokens: int
    reuse: str
    chunks_done: int
    top_k: list[TopLogit]
    timings: dict[str, float]
    model_sha256: str
    logits: array.array | None = field(default=None, repr=False)
    prompt_logprobs: list[dict] | None = field(default=None, repr=False)

    @classmethod
    def from_blob(cls, job_id: str, blob: bytes, logits: bytes | None,
                  prompt_logprobs: bytes | None = None) -> PrefillResult:
        data = unpackb(blob)
        values = None
        if logits is not None:
            values = array.array("f")
            values.frombytes(unpackb(logits))
        return cls(
            job_id=job_id,
            n_tokens=data["n_tokens"],
            cached_tokens=data.get("cached_tokens", 0),
            reuse=data.get("reuse", "cold"),
            chunks_done=data["chunks_done"],
            top_k=[TopLogit(**t) for t in data["top_k"]],
            timings=data["timings"],
            model_sha256=data["model_sha256"],
            logits=values,
            prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs_of(
                prompt_logprobs),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("logits")
        return out


def result_record(status: JobStatus, result: PrefillResult | None) -> dict:
    """What ``prefillq result --json`` prints and ``GET /v1/prefill/{id}/result`` returns:
    the status fields merged with the result's (not its full logits), plus ``chunks``
    (= ``chunks_done``)."""
    record = status.to_dict()
    if result is not None:
        record.update(result.to_dict())
        record["chunks"] = result.chunks_done
    else:
        record["chunks"] = status.chunks_done
    return record


def _floats(blob: bytes, code: str) -> list:
    values = array.array(code)
    values.frombytes(blob)
    return values.tolist()


def prompt_logprobs_of(blob: bytes) -> list[dict]:
    """Decode a job's prompt logprobs key (OpenAI's ``echo`` convention, DESIGN §10).

    The key is msgpack ``{"k": K, "ids": int32 (n,), "token_logprob": float32 (n + 1,),
    "top_ids": int32 (n + 1, K), "top_logprobs": float32 (n + 1, K)}``, arrays as raw
    little-endian bytes and NaN where there is no value.

    Returns:
        n + 1 entries: entry i < n is prompt token i, ``{"token": id, "logprob": log p(ids[i]
        | ids[:i]) (None at i = 0), "top": the K likeliest ids given ids[:i] (empty at
        i = 0)}``; entry n, after the prompt, is ``{"token": None, "logprob": None, "top":
        the final logits' top K}`` (the ``top_k`` result's logprobs). ``top`` is
        ``[{"id": int, "logprob": float}, ...]``, highest first.
    """
    data = unpackb(blob)
    k, ids = data["k"], _floats(data["ids"], "i")
    token = _floats(data["token_logprob"], "f")
    top_ids, top_lp = _floats(data["top_ids"], "i"), _floats(data["top_logprobs"], "f")
    out = []
    for i in range(len(ids) + 1):
        top = [] if i == 0 else [{"id": top_ids[j], "logprob": top_lp[j]}
                                 for j in range(i * k, (i + 1) * k)]
        out.append({"token": ids[i] if i < len(ids) else None,
                    "logprob": None if math.isnan(token[i]) else token[i], "top": top})
    return out
