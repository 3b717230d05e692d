"""Validation of a submitted prefill, shared by every client and by the worker.

Every error is an `InvalidRequest` (or a subclass) whose message starts with the offending
field's name; the checks of one value are `jobs.values`', of continuations
`jobs.continuations`'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .continuations import check_continuations_against_model, checked_continuations
from .defaults import DEFAULT_MAX_ATTEMPTS, DEFAULT_MODEL, DEFAULT_TOP_K, MAX_ATTEMPTS, MAX_PRIORITY
from .errors import EmptyPrompt, InvalidRequest, PromptTooLarge, PromptTooLong, TokenOutOfRange
from .limits import Limits
from .record import JobRecord
from .schema import LogitsMode
from .values import flag, int_in, name_of, shown, token_list, utf8_size

DEFAULT_LIMITS = Limits()
# chunk_tokens beyond this exceed every context (and stay a 32-bit integer everywhere)
MAX_CHUNK_TOKENS = 2**31 - 1


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

    Run at submit (for ``tokens=``) and in the worker (after tokenizing a text prompt).

    Args:
        context_length: the most tokens allowed (`Limits.prompt_tokens` of the model's).
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
            f"prompt has {len(ids)} tokens, more than the limit of {context_length} (the "
            "serving context, or a lower Limits.max_prompt_tokens)")


# the keys of one chat message: the template reads both, and nothing else is stored
MESSAGE_KEYS = frozenset({"role", "content"})


def check_messages(messages: Any, max_bytes: int | None = None) -> list[dict[str, str]]:
    """Copies of `messages` if they are a chat the worker can render, else raise.

    Args:
        max_bytes: the most UTF-8 bytes of all roles and contents together (None: no limit).
    Returns:
        ``[{"role": str, "content": str}, ...]`` in the given order.

    Raises:
        InvalidRequest: `messages` is not a non-empty list, or an entry is not a dict with
            exactly the keys ``role`` and ``content``, both strings, the role non-empty, or a
            string holds a lone surrogate (not encodable as UTF-8).
        PromptTooLarge: more than `max_bytes` bytes.
    """
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise InvalidRequest("messages must be a non-empty list of {role, content} dicts")
    out, size = [], 0
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or set(message) != MESSAGE_KEYS:
            keys = (sorted(map(str, message)) if isinstance(message, Mapping)
                    else type(message).__name__)
            raise InvalidRequest(f"messages[{i}] must be a dict with keys role and content, "
                                 f"got {keys}")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}]: role must be a non-empty string and content "
                                 f"a string, got {type(role).__name__} and "
                                 f"{type(content).__name__}")
        size += utf8_size(f"messages[{i}].role", role)
        size += utf8_size(f"messages[{i}].content", content)
        out.append({"role": role, "content": content})
    if max_bytes is not None and size > max_bytes:
        raise PromptTooLarge(f"messages have {size} UTF-8 bytes of text, more than the limit "
                             f"of {max_bytes} (Limits.max_prompt_bytes)")
    return out


def prompt_text(prompt: Any, limits: Limits) -> str:
    """`prompt` if it is non-blank text within ``limits.max_prompt_bytes``.

    Raises:
        InvalidRequest: not a str, blank, or holding a lone surrogate.
        PromptTooLarge: more UTF-8 bytes than the limit.
    """
    if not isinstance(prompt, str):
        raise InvalidRequest(f"prompt must be a string, got {type(prompt).__name__}")
    limit = limits.max_prompt_bytes
    if len(prompt) > limit:  # every character is a byte at least: no need to encode it
        raise PromptTooLarge(f"prompt has at least {len(prompt)} UTF-8 bytes, more than the "
                             f"limit of {limit} (Limits.max_prompt_bytes)")
    size = utf8_size("prompt", prompt)
    if size > limit:
        raise PromptTooLarge(f"prompt has {size} UTF-8 bytes, more than the limit of {limit} "
                             "(Limits.max_prompt_bytes)")
    if not prompt.strip():
        raise InvalidRequest("prompt is empty")
    return prompt


def _inputs(prompt: Any, tokens: Any, messages: Any, limits: Limits) -> dict[str, Any]:
    """The one input given, checked: ``prompt``, ``tokens`` and ``messages`` values."""
    given = [n for n, v in (("prompt", prompt), ("tokens", tokens), ("messages", messages))
             if v is not None]
    if len(given) != 1:
        raise InvalidRequest("give exactly one of prompt, tokens or messages"
                             + (f", got {' and '.join(given)}" if given else ""))
    return {
        "prompt": None if prompt is None else prompt_text(prompt, limits),
        "tokens": None if tokens is None else token_list(tokens),
        "messages": None if messages is None else check_messages(messages,
                                                                 limits.max_prompt_bytes),
    }


def _logits_mode(logits: Any) -> LogitsMode:
    try:
        return LogitsMode(logits)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"logits must be none, top_k or full, got {shown(logits)}") from e


def _prompt_logprobs(k: Any, session: str | None, limits: Limits) -> int | None:
    """An int in ``[0, limits.max_prompt_logprobs]`` or None, and not with a `session` (its
    cached prefix has no per-position results). Raises InvalidRequest."""
    if k is None:
        return None
    k = int_in("prompt_logprobs", k, 0, limits.max_prompt_logprobs)
    if session is not None:
        raise InvalidRequest("prompt_logprobs cannot be used with a session: the session's "
                             "cached prefix has no per-position log-probabilities")
    return k


def _labels(ids: Any, limits: Limits) -> list[int] | None:
    """`ids` as a new list of 1 to ``limits.max_top_k`` token ids, or None. Raises
    InvalidRequest naming ``label_token_ids``."""
    if ids is None:
        return None
    try:
        out = token_list(ids)
    except InvalidRequest as e:
        raise InvalidRequest(f"label_token_ids: {e}") from e
    if len(out) > limits.max_top_k:
        raise InvalidRequest(f"label_token_ids has {len(out)} ids, more than the "
                             f"{limits.max_top_k} of Limits.max_top_k (ask for logits='full')")
    return out


@dataclass(frozen=True)
class SubmitRequest:
    """One prefill as a client submits it: the fields of `PrefillClient.submit` (see it for
    their meaning), defined here once. Both clients' ``submit`` take these keywords
    (`submit_signature`), the gateway's ``POST /v1/prefill`` body holds them, and the job's
    record stores them (`record`, `of_record`; ``logits`` is the record's ``logits_mode``).

    A request as given may hold anything; `checked` is the one validation of it.
    """

    prompt: str | None = None
    tokens: Sequence[int] | None = None
    messages: Sequence[dict] | None = None
    add_generation_prompt: bool = True
    model: str = DEFAULT_MODEL
    top_k: int = DEFAULT_TOP_K
    logits: str | LogitsMode = LogitsMode.TOP_K
    parse_special: bool = True
    session: str | None = None
    priority: int = 0
    tenant: str | None = None
    prompt_logprobs: int | None = None
    continuations: Sequence[str] | Sequence[Sequence[int]] | None = None
    cache_salt: str | None = None
    label_token_ids: Sequence[int] | None = None
    chunk_tokens: int | None = None
    idempotency_key: str | None = None
    max_attempts: int = DEFAULT_MAX_ATTEMPTS

    def checked(self, limits: Limits = DEFAULT_LIMITS) -> SubmitRequest:
        """This request with every field checked against `limits`: ``logits`` a
        `LogitsMode`, sequences new lists of ints or ``{role, content}`` dicts.

        Token ids are not checked against the model here (`check_against_model` does
        that), nor messages against its chat template (the worker renders them).

        Raises:
            InvalidRequest: naming the field: no input or two; a prompt that is not a str,
                is blank or holds a lone surrogate; tokens that are not a non-empty list of
                ints (bools and floats refused); malformed messages (`check_messages`); a
                model, session, tenant, cache_salt or idempotency_key that is not a
                non-empty str of at most ``MAX_NAME_BYTES``; add_generation_prompt or
                parse_special not a bool;
                top_k outside [0, limits.max_top_k]; logits not none/top_k/full; priority
                outside [-MAX_PRIORITY, MAX_PRIORITY]; chunk_tokens < 1; max_attempts
                outside [1, MAX_ATTEMPTS]; prompt_logprobs outside [0,
                limits.max_prompt_logprobs] or with a session; label_token_ids that are not
                a list of 1 to ``limits.max_top_k`` token ids; continuations that are not
                1 to ``limits.max_continuations`` token-id lists after ``tokens`` or
                non-empty strings after ``prompt``, or come with messages or a session.
            PromptTooLarge: the prompt's (or messages') UTF-8 bytes, the continuations'
                included, exceed ``limits.max_prompt_bytes``.
            PromptTooLong: continuation ids over ``limits.max_continuation_tokens``.
        """
        session = name_of("session", self.session, optional=True)
        inputs = _inputs(self.prompt, self.tokens, self.messages, limits)
        return SubmitRequest(
            **inputs,
            continuations=checked_continuations(self.continuations, inputs, session, limits),
            cache_salt=name_of("cache_salt", self.cache_salt, optional=True),
            label_token_ids=_labels(self.label_token_ids, limits),
            model=name_of("model", self.model),
            add_generation_prompt=flag("add_generation_prompt", self.add_generation_prompt),
            top_k=int_in("top_k", self.top_k, 0, limits.max_top_k),
            logits=_logits_mode(self.logits),
            parse_special=flag("parse_special", self.parse_special),
            priority=int_in("priority", self.priority, -MAX_PRIORITY, MAX_PRIORITY),
            tenant=name_of("tenant", self.tenant, optional=True),
            chunk_tokens=None if self.chunk_tokens is None else int_in(
                "chunk_tokens", self.chunk_tokens, 1, MAX_CHUNK_TOKENS),
            session=session,
            prompt_logprobs=_prompt_logprobs(self.prompt_logprobs, session, limits),
            idempotency_key=name_of("idempotency_key", self.idempotency_key, optional=True),
            max_attempts=int_in("max_attempts", self.max_attempts, 1, MAX_ATTEMPTS),
        )

    def record(self, job_id: str, enqueued_at: float) -> JobRecord:
        """The queued record of this (`checked`) request as job `job_id`, enqueued at
        `enqueued_at` (UTC epoch seconds)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["logits_mode"] = fields.pop("logits")
        return JobRecord(job_id=job_id, enqueued_at=enqueued_at, **fields)

    @classmethod
    def of_record(cls, record: JobRecord) -> SubmitRequest:
        """The request a job's `record` was built from (`record`'s inverse)."""
        return cls(**{f.name: getattr(record, RECORD_FIELD.get(f.name, f.name))
                      for f in dataclasses.fields(cls)})


# the `JobRecord` field of a `SubmitRequest` field, where its name differs
RECORD_FIELD = {"logits": "logits_mode"}
SUBMIT_FIELDS = frozenset(f.name for f in dataclasses.fields(SubmitRequest))


def new_record(job_id: str, *, enqueued_at: float, limits: Limits = DEFAULT_LIMITS,
               **submit: Any) -> JobRecord:
    """The queued record of a submit of `submit`'s keywords (`SubmitRequest`'s fields),
    checked against `limits`.

    Raises:
        InvalidRequest, PromptTooLarge: as `SubmitRequest.checked`.
        TypeError: a keyword that is not a field.
    """
    return SubmitRequest(**submit).checked(limits).record(job_id, enqueued_at)


def check_record(record: JobRecord, limits: Limits = DEFAULT_LIMITS) -> None:
    """`SubmitRequest.checked` on a decoded record (the worker's, before it tokenizes),
    against the worker's own `limits`, so a job a foreign or older client enqueued fails
    with the same typed errors as a submit.

    Raises:
        InvalidRequest, PromptTooLarge: as `SubmitRequest.checked`.
    """
    SubmitRequest.of_record(record).checked(limits)


def check_against_model(record: JobRecord, info: ModelInfo,
                        limits: Limits = DEFAULT_LIMITS) -> None:
    """Check a record's token ids (if it has ids, not text) against `info`'s vocabulary and
    the smaller of its context and ``limits.max_prompt_tokens``.

    Raises:
        TokenOutOfRange, PromptTooLong: as `check_token_ids` and
            `check_continuations_against_model`; TokenOutOfRange for a label id too.
    """
    bad = next((t for t in record.label_token_ids or () if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise TokenOutOfRange(f"label_token_ids: token id {bad} is outside the vocabulary "
                              f"[0, {info.vocab_size})")
    if record.tokens is not None:
        context = limits.prompt_tokens(info.context_length)
        check_token_ids(record.tokens, info.vocab_size, context)
        if record.continuations is not None:
            check_continuations_against_model(record.tokens, record.continuations,
                                              info.vocab_size, context)
