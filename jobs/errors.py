"""Errors a client sees. Input errors are raised at `submit`; a job that fails later carries
``error.type`` (e.g. ``PromptTooLong``, ``ModelError``, ``WorkerLost``) in its status.

The input errors a worker finds (after tokenizing: `EmptyPrompt`, `TokenOutOfRange`,
`PromptTooLong`; before it, checking the job again against its own limits: any
`InvalidRequest`, `PromptTooLarge`) are these same classes: the job's ``error.type`` is the
class name. A record the worker cannot decode fails with ``CorruptJob``.
"""

from __future__ import annotations


class PrefillQError(Exception):
    """Base class of prefillq client errors."""


class InvalidRequest(PrefillQError, ValueError):
    """The submitted job is malformed (no input, two inputs, empty prompt, bad top_k, ...).

    The message starts with the offending field's name (``top_k must be ...``,
    ``tokens[3] must be ...``). The worker checks every job again when it starts it, so a
    job a foreign or older client enqueued fails with the same error type."""


class UnknownModel(InvalidRequest):
    """No registered worker serves this model."""


class TokenOutOfRange(InvalidRequest):
    """A token id is outside the model's vocabulary."""


class QueueFull(PrefillQError):
    """The model's intake queue is at its configured depth."""


class JobNotFound(PrefillQError, KeyError):
    """No such job (never submitted, or its record expired)."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


class JobFailed(PrefillQError):
    """`result` on a failed job. Attributes: ``error_type``, ``message``."""

    def __init__(self, job_id: str, error_type: str, message: str):
        super().__init__(f"job {job_id} failed: {error_type}: {message}")
        self.job_id, self.error_type, self.message = job_id, error_type, message


class JobCanceled(PrefillQError):
    """`result` on a canceled job."""


class JobTimeout(PrefillQError, TimeoutError):
    """`result` waited its timeout and the job is not terminal yet."""


class EmptyPrompt(InvalidRequest):
    """The prompt has no tokens (found at submit for token ids, by the worker for text)."""


class PromptTooLong(InvalidRequest):
    """The prompt has more tokens than the model's serving context (or the client's or
    worker's ``Limits.max_prompt_tokens``)."""


class PromptTooLarge(PromptTooLong):
    """The prompt (or the chat messages' text) has more UTF-8 bytes than
    ``Limits.max_prompt_bytes``: refused at `submit` before it reaches Redis, and again by
    the worker before it tokenizes."""


class CorruptJob(PrefillQError, ValueError):
    """A job's Redis record (or its result) cannot be decoded: it was written by something
    other than prefillq, truncated, or garbled. Attribute ``fields``: the names of the
    fields that do not decode. `status` and `result` raise it; a worker that dequeues such a
    job fails it with ``error.type`` ``CorruptJob`` (dropping the undecodable fields, so its
    status reads again)."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.fields = tuple(fields)


class TokenizerUnavailable(PrefillQError):
    """No usable tokenizer is published for a registered model: its workers predate
    tokenizer publishing, or published a format newer than this client reads."""


class TokenizerMalformed(TokenizerUnavailable):
    """The published tokenizer blob cannot be decoded (truncated, garbled, wrong fields)."""


class JobRefused(PrefillQError):
    """An RQ job on a prefillq queue that is not prefillq's own execution: another
    function, other arguments, RQ callbacks or webhooks, or a payload msgpack cannot decode.
    The worker records it failed in RQ and runs nothing of it (`jobs.queues.refusal`)."""
