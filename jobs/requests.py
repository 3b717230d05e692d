"""Validation of a submitted prefill, shared by every client and by the worker.

`new_record` checks what can be checked without Redis and builds the job's record;
`check_token_ids` checks token ids against a model's limits, at submit (for ``tokens=``) and
in the worker (after tokenizing a text prompt), so both raise the same typed errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


# the keys of one chat message: the template reads both, and nothing else is stored
MESSAGE_KEYS = frozenset({"role", "content"})


def check_messages(messages: Any) -> list[dict[str, str]]:
    """Copies of `messages` if they are a chat the worker can render, else raise.

    Returns:
        ``[{"role": str, "content": str}, ...]`` in the given order.

    Raises:
        InvalidRequest: `messages` is not a non-empty list, or an entry is not a dict with
            exactly the keys ``role`` and ``content``, both strings, the role non-empty.
    """
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise InvalidRequest("messages must be a non-empty list of {role, content} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or set(message) != MESSAGE_KEYS:
            keys = sorted(message) if isinstance(message, Mapping) else type(message).__name__
            raise InvalidRequest(f"messages[{i}] must be a dict with keys role and content, "
                                 f"got {keys}")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}]: role must be a non-empty string and content "
                                 f"a string, got {type(role).__name__} and "
                                 f"{type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _check_input(prompt: str | None, tokens: Sequence[int] | None, messages: Any,
                 add_generation_prompt: Any) -> list[dict[str, str]] | None:
    """Exactly one input, well formed; returns the checked `messages` (or None).

    Raises:
        InvalidRequest: as `new_record`.
    """
    if sum(x is not None for x in (prompt, tokens, messages)) != 1:
        raise InvalidRequest("give exactly one of prompt, tokens or messages")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise InvalidRequest("prompt is empty")
    if tokens is not None and len(tokens) == 0:
        raise InvalidRequest("tokens is empty")
    if not isinstance(add_generation_prompt, bool):
        raise InvalidRequest(f"add_generation_prompt must be True or False, "
                             f"got {add_generation_prompt!r}")
    return None if messages is None else check_messages(messages)


def new_record(
    job_id: str,
    *,
    prompt: str | None,
    tokens: Sequence[int] | None,
    messages: Sequence[dict] | None,
    add_generation_prompt: bool = True,
    model: str,
    top_k: int,
    logits: str | LogitsMode,
    parse_special: bool,
    session: str | None,
    priority: int,
    prompt_logprobs: int | None = None,
    chunk_tokens: int | None,
    idempotency_key: str | None,
    max_attempts: int,
    enqueued_at: float,
) -> JobRecord:
    """Check a submit's arguments (see `PrefillClient.submit`) and build its queued record.

    Token ids are not checked against the model here (`check_token_ids` does that), nor
    messages against its chat template (the worker renders them).

    Raises:
        InvalidRequest: no input or two, empty/whitespace prompt, empty token list, malformed
            messages (`check_messages`), a non-bool add_generation_prompt, bad top_k,
            logits, chunk_tokens, max_attempts or prompt_logprobs (`_check_prompt_logprobs`).
    """
    messages = _check_input(prompt, tokens, messages, add_generation_prompt)
    if not 0 <= int(top_k) <= MAX_TOP_K:
        raise InvalidRequest(f"top_k must be in [0, {MAX_TOP_K}], got {top_k}")
    try:
        logits_mode = LogitsMode(logits)
    except ValueError as e:
        raise InvalidRequest(f"logits must be none, top_k or full, got {logits!r}") from e
    if chunk_tokens is not None and int(chunk_tokens) < 1:
        raise InvalidRequest(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    _check_prompt_logprobs(prompt_logprobs, session)
    if int(max_attempts) < 1:
        raise InvalidRequest(f"max_attempts must be >= 1, got {max_attempts}")
    return JobRecord(
        job_id=job_id,
        model=model,
        prompt=prompt,
        tokens=None if tokens is None else [int(t) for t in tokens],
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        top_k=int(top_k),
        logits_mode=logits_mode,
        parse_special=bool(parse_special),
        priority=int(priority),
        chunk_tokens=None if chunk_tokens is None else int(chunk_tokens),
        session=session,
        prompt_logprobs=prompt_logprobs,
        idempotency_key=idempotency_key,
        max_attempts=int(max_attempts),
        enqueued_at=enqueued_at,
    )


def _check_prompt_logprobs(k: object, session: str | None) -> None:
    """An int in ``[0, MAX_TOP_K]`` or None, and not with a `session` (its cached prefix has
    no per-position results). Raises InvalidRequest."""
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_K:
        raise InvalidRequest(f"prompt_logprobs must be an int in [0, {MAX_TOP_K}] or None, "
                             f"got {k!r}")
    if session is not None:
        raise InvalidRequest("prompt_logprobs cannot be used with a session: the session's "
                             "cached prefix has no per-position log-probabilities")


def check_against_model(record: JobRecord, info: ModelInfo) -> None:
    """Check a record's token ids (if it has ids, not text) against `info`'s limits.

    Raises:
        TokenOutOfRange, PromptTooLong: as `check_token_ids`.
    """
    if record.tokens is not None:
        check_token_ids(record.tokens, info.vocab_size, info.context_length)
