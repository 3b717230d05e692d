"""Validation of a submitted prefill, shared by every client and by the worker.

`new_record` checks what can be checked without Redis and builds the job's record;
`check_token_ids` checks token ids against a model's limits, at submit (for ``tokens=``) and
in the worker (after tokenizing a text prompt), so both raise the same typed errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .defaults import MAX_TOP_K
from .errors import EmptyPrompt, InvalidRequest, PromptTooLong, TokenOutOfRange
from .record import JobRecord
from .schema import LogitsMode


@dataclass(frozen=True)
class ModelInfo:
    """What a worker registered for a model name (``keys.MODELS``)."""

    name: str
    vocab_size: int
    context_length: int
    architecture: str
    sha256: str


def check_token_ids(ids: Sequence[int], vocab_size: int, context_length: int) -> None:
    """Raise unless `ids` is a non-empty prompt of in-vocabulary ids that fits the context.

    Raises:
        EmptyPrompt: no ids.
        TokenOutOfRange: an id outside ``[0, vocab_size)``.
        PromptTooLong: more than `context_length` ids.
    """
    if len(ids) == 0:
        raise EmptyPrompt("the prompt has no tokens")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise TokenOutOfRange(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) > context_length:
        raise PromptTooLong(
            f"prompt has {len(ids)} tokens, more than the serving context of {context_length}"
        )


def new_record(
    job_id: str,
    *,
    prompt: str | None,
    tokens: Sequence[int] | None,
    messages: Sequence[dict] | None,
    model: str,
    top_k: int,
    logits: str | LogitsMode,
    parse_special: bool,
    session: str | None,
    priority: int,
    chunk_tokens: int | None,
    idempotency_key: str | None,
    max_attempts: int,
    enqueued_at: float,
) -> JobRecord:
    """Check a submit's arguments (see `PrefillClient.submit`) and build its queued record.

    Token ids are not checked against the model here (`check_token_ids` does that).

    Raises:
        InvalidRequest: no input or two, empty/whitespace prompt, empty token list, bad
            top_k, logits, chunk_tokens or max_attempts.
    """
    if sum(x is not None for x in (prompt, tokens, messages)) != 1:
        raise InvalidRequest("give exactly one of prompt, tokens or messages")
    if messages is not None:
        raise InvalidRequest("messages (chat templates) are not supported yet")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise InvalidRequest("prompt is empty")
    if tokens is not None and len(tokens) == 0:
        raise InvalidRequest("tokens is empty")
    if not 0 <= int(top_k) <= MAX_TOP_K:
        raise InvalidRequest(f"top_k must be in [0, {MAX_TOP_K}], got {top_k}")
    try:
        logits_mode = LogitsMode(logits)
    except ValueError as e:
        raise InvalidRequest(f"logits must be none, top_k or full, got {logits!r}") from e
    if chunk_tokens is not None and int(chunk_tokens) < 1:
        raise InvalidRequest(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if int(max_attempts) < 1:
        raise InvalidRequest(f"max_attempts must be >= 1, got {max_attempts}")
    return JobRecord(
        job_id=job_id,
        model=model,
        prompt=prompt,
        tokens=None if tokens is None else [int(t) for t in tokens],
        top_k=int(top_k),
        logits_mode=logits_mode,
        parse_special=bool(parse_special),
        priority=int(priority),
        chunk_tokens=None if chunk_tokens is None else int(chunk_tokens),
        session=session,
        idempotency_key=idempotency_key,
        max_attempts=int(max_attempts),
        enqueued_at=enqueued_at,
    )


def check_against_model(record: JobRecord, info: ModelInfo) -> None:
    """Check a record's token ids (if it has ids, not text) against `info`'s limits.

    Raises:
        TokenOutOfRange, PromptTooLong: as `check_token_ids`.
    """
    if record.tokens is not None:
        check_token_ids(record.tokens, info.vocab_size, info.context_length)
