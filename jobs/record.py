"""`JobRecord`: the one codec of a job's Redis hash (``keys.job(id)``).

Every reader and writer of the hash goes through it: `submit` writes a new record, `status`
decodes one, the worker decodes one to start a job. The Lua scripts in `jobs.scripts` update
single fields by the same names. In Redis every field is a string: integers and floats in
decimal, flags as ``0``/``1``, enums as their value, token ids and the chunk plan as msgpack,
chat messages as a msgpack list of ``{role, content}`` maps, the result as a msgpack blob; a
missing field (or an empty string) is the field's default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .defaults import DEFAULT_MAX_ATTEMPTS, DEFAULT_TOP_K
from .errors import CorruptJob
from .schema import JobState, JobStatus, LogitsMode
from .serializer import DECODE_ERRORS, packb, unpackb


@dataclass
class JobRecord:
    """A job as stored in Redis. Times are UTC epoch seconds; sizes are in tokens.

    The input is exactly one of `prompt` (text), `tokens` (ids) and `messages` (chat,
    ``[{"role": str, "content": str}, ...]``, rendered by the worker with the model's chat
    template, ending with the assistant's opening when `add_generation_prompt`). Fields from
    `state` on are written by the worker and the scripts; `chunk_plan` is the chunk
    boundaries (end positions) decided once when a worker first plans the job, so every
    worker continues it at the same boundaries. `checkpoint` is the record key of the job's
    latest complete KV checkpoint (switched by ``CHECKPOINT_SWITCH``) at `checkpoint_cursor`
    tokens; `resumed_from` is the cursor the current attempt restored from one (None: cold).
    """

    job_id: str
    model: str
    prompt: str | None = None
    tokens: list[int] | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    top_k: int = DEFAULT_TOP_K
    logits_mode: LogitsMode = LogitsMode.TOP_K
    parse_special: bool = True
    priority: int = 0
    tenant: str | None = None  # whose job: the fair share's unit (None: no tenant)
    chunk_tokens: int | None = None
    session: str | None = None
    prompt_logprobs: int | None = None  # K: per-position logprobs and top K (None: off)
    # scored from the end of the prompt: token-id lists after `tokens`, strings after `prompt`
    continuations: list[str | list[int]] | None = None
    cache_salt: str | None = None  # a prefix cache shares blocks only among equal salts
    label_token_ids: list[int] | None = None  # their logprobs after the prompt (and each
    # continuation) are in the result
    idempotency_key: str | None = None
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    enqueued_at: float | None = None

    state: JobState = JobState.QUEUED
    attempts: int = 0
    failures: int = 0
    cursor: int = 0
    chunks_done: int = 0
    cached_tokens: int = 0
    reuse: str = "cold"
    n_tokens: int | None = None
    recovery_position: int | None = None
    chunk_plan: list[int] | None = None
    checkpoint: str | None = None
    checkpoint_cursor: int | None = None
    resumed_from: int | None = None
    cancel_requested: bool = False
    worker: str | None = None
    start_token: str | None = None
    first_started_at: float | None = None
    started_at: float | None = None
    updated_at: float | None = None
    finished_at: float | None = None
    error_type: str | None = None
    error_message: str | None = None
    result: bytes | None = None

    def to_hash(self) -> dict[str, str | int | float | bytes]:
        """The fields to HSET: every field that is not None, encoded for Redis."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = _CODECS[f.name][0](value)
        return out

    @classmethod
    def from_hash(cls, job_id: str, raw: dict[bytes, bytes]) -> JobRecord:
        """Decode an HGETALL reply; unknown fields are ignored, missing ones default (but
        ``state``, which every record has).

        Raises:
            CorruptJob: (a ValueError) fields hold values their types cannot decode (bad
                msgpack, a non-integer, non-UTF-8 text, an unknown state), or ``state`` is
                missing; ``fields`` names them all.
        """
        values: dict[str, Any] = {"job_id": job_id}
        bad: dict[str, str] = {}
        for name, blob in raw.items():
            name = name.decode("utf-8", "replace")
            if name in _CODECS and name != "job_id" and blob != b"":
                try:
                    values[name] = _CODECS[name][1](blob)
                except DECODE_ERRORS as e:
                    bad[name] = f"{type(e).__name__}: {e}"
        if "state" not in values and "state" not in bad:
            bad["state"] = "missing"
        if bad:
            detail = "; ".join(f"{k} ({v[:80]})" for k, v in sorted(bad.items()))
            raise CorruptJob(f"job {job_id}'s record cannot be decoded: {detail}",
                             fields=tuple(sorted(bad)))
        values.setdefault("model", "")
        return cls(**values)

    @property
    def error(self) -> dict[str, str] | None:
        """``{type, message}`` of a failed job, else None."""
        if not self.error_type:
            return None
        return {"type": self.error_type, "message": self.error_message or ""}

    def status(self) -> JobStatus:
        """What a client sees of this record."""
        return JobStatus(
            job_id=self.job_id,
            state=self.state,
            model=self.model,
            n_tokens=self.n_tokens,
            cursor=self.cursor,
            progress=(self.cursor / self.n_tokens) if self.n_tokens else 0.0,
            recovery_position=self.recovery_position,
            chunks_done=self.chunks_done,
            cached_tokens=self.cached_tokens,
            reuse=self.reuse,
            resumed_from=self.resumed_from,
            attempts=self.attempts,
            cancel_requested=self.cancel_requested,
            worker=self.worker or None,
            enqueued_at=self.enqueued_at,
            started_at=self.started_at,
            updated_at=self.updated_at,
            finished_at=self.finished_at,
            error=self.error,
            tenant=self.tenant,
        )


def encode_field(name: str, value: Any) -> str | int | float | bytes:
    """`value` of field `name` as HSET (or a script's ARGV) takes it.

    Raises:
        KeyError: no such field.
    """
    return _CODECS[name][0](value)


def _text(blob: bytes) -> str:
    return blob.decode()


def _flag(blob: bytes) -> bool:
    return int(blob) != 0


def _ids(blob: bytes) -> list[int]:
    ids = unpackb(blob)
    # exactly ints (token ids, chunk boundaries): a float or a bool is corrupt, never cut
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError("not a msgpack list of integers")
    return ids


def _messages(blob: bytes) -> list[dict]:
    messages = unpackb(blob)
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages is not a msgpack list of maps")
    return messages


def _continuations(blob: bytes) -> list:
    continuations = unpackb(blob)
    if not isinstance(continuations, list) or not all(
            isinstance(c, str) or (isinstance(c, list) and all(type(t) is int for t in c))
            for c in continuations):
        raise ValueError("continuations is not a msgpack list of strings or integer lists")
    return continuations


# Python type of a field (as annotated) -> (encode for HSET, decode from the reply)
_BY_TYPE = {
    "str": (str, _text),
    "int": (int, int),
    "float": (float, float),
    "bool": (int, _flag),
    "JobState": (lambda s: s.value, lambda b: JobState(b.decode())),
    "LogitsMode": (lambda m: m.value, lambda b: LogitsMode(b.decode())),
    "list[int]": (packb, _ids),
    "list[dict]": (packb, _messages),
    "list[str | list[int]]": (packb, _continuations),
    "bytes": (bytes, bytes),
}


def _codec(annotation: str) -> tuple:
    # annotations are strings here (``from __future__ import annotations``)
    return _BY_TYPE[annotation.removesuffix(" | None")]


_CODECS = {f.name: _codec(f.type) for f in dataclasses.fields(JobRecord)}
