"""Checks of a job's ``continuations``: at submit, on the worker's decoded record, and on
the ids the worker tokenizes text continuations into (`worker.prepare`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import InvalidRequest, PromptTooLarge, PromptTooLong, TokenOutOfRange
from .limits import Limits
from .values import shown, token_list, utf8_size


def checked_continuations(value: Any, inputs: dict[str, Any], session: str | None,
                   limits: Limits) -> list | None:
    """`value` as a new list of continuations, or None: 1 to ``limits.max_continuations``
    of them, token-id lists (`token_list`) after ``tokens``, non-empty strings after a
    ``prompt`` (their UTF-8 bytes and the prompt's within ``limits.max_prompt_bytes``).

    Raises:
        InvalidRequest: naming ``continuations`` or ``continuations[i]``: not a list, empty,
            too many, an entry of the wrong kind, with ``messages`` or a `session`.
        PromptTooLarge: the text is over ``limits.max_prompt_bytes``.
        PromptTooLong: ids over ``limits.max_continuation_tokens`` together.
    """
    if value is None:
        return None
    if session is not None or inputs["messages"] is not None:
        raise InvalidRequest("continuations need a prompt or tokens, without a session or "
                             "messages (each is scored from the end of that context)")
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= limits.max_continuations:
        raise InvalidRequest(f"continuations must be a list of 1 to {limits.max_continuations}"
                             f" continuations, got {shown(value)}")
    if inputs["tokens"] is not None:
        out = []
        for i, ids in enumerate(value):
            try:
                out.append(token_list(ids))
            except InvalidRequest as e:
                raise InvalidRequest(f"continuations[{i}]: {e}") from e
        check_continuation_tokens(out, limits)
        return out
    size = utf8_size("prompt", inputs["prompt"])
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text:
            raise InvalidRequest(f"continuations[{i}] must be a non-empty string after a text "
                                 f"prompt, got {shown(text)}")
        size += utf8_size(f"continuations[{i}]", text)
    if size > limits.max_prompt_bytes:
        raise PromptTooLarge(f"the prompt and its continuations have {size} UTF-8 bytes, more "
                             f"than the limit of {limits.max_prompt_bytes} "
                             "(Limits.max_prompt_bytes)")
    return list(value)


def check_continuation_tokens(continuations: Sequence[Sequence[int]], limits: Limits) -> None:
    """Raise PromptTooLong when `continuations` (token ids) have more than
    ``limits.max_continuation_tokens`` ids together, or InvalidRequest for an empty one."""
    for i, ids in enumerate(continuations):
        if len(ids) == 0:
            raise InvalidRequest(f"continuations[{i}] has no tokens")
    total = sum(len(ids) for ids in continuations)
    if total > limits.max_continuation_tokens:
        raise PromptTooLong(f"continuations have {total} tokens together, more than the limit "
                            f"of {limits.max_continuation_tokens} "
                            "(Limits.max_continuation_tokens)")


def check_continuations_against_model(ids: Sequence[int], continuations: Sequence[Sequence[int]],
                                      vocab_size: int, context_length: int) -> None:
    """Raise unless every continuation's ids are in the vocabulary and the context `ids`
    with the longest continuation fit `context_length` tokens.

    Raises:
        TokenOutOfRange: an id outside ``[0, vocab_size)``, naming its continuation.
        PromptTooLong: context and a continuation together over `context_length`.
    """
    for i, continuation in enumerate(continuations):
        bad = next((t for t in continuation if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise TokenOutOfRange(f"continuations[{i}]: token id {bad} is outside the "
                                  f"vocabulary [0, {vocab_size})")
    longest = max(len(c) for c in continuations)
    if len(ids) + longest > context_length:
        raise PromptTooLong(f"the prompt's {len(ids)} tokens and a continuation of {longest} "
                            f"are more than the limit of {context_length} (the serving "
                            "context, or a lower Limits.max_prompt_tokens)")
