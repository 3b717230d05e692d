"""`Limits`: the bounds a job's input must keep, enforced at `submit` and again by the worker.

A client refuses what breaks its limits before anything reaches Redis; a worker checks every
job against its own limits when it starts it (`jobs.requests.check_record`, before it
tokenizes), so a job that a foreign or older client enqueued fails with the same typed error
instead of costing the worker. Keep the two sides' limits equal, or the workers' tighter.
"""

from __future__ import annotations

from dataclasses import dataclass

from .defaults import (
    DEFAULT_MAX_CONTINUATION_TOKENS,
    DEFAULT_MAX_CONTINUATIONS,
    DEFAULT_MAX_PROMPT_BYTES,
    DEFAULT_MAX_PROMPT_LOGPROBS,
    MAX_TOP_K,
)


@dataclass(frozen=True)
class Limits:
    """Bounds on one job's input.

    Attributes:
        max_prompt_bytes: UTF-8 bytes of ``prompt`` text, or of the chat ``messages``' roles
            and contents together (default 8 MiB); over it: `PromptTooLarge`.
        max_prompt_tokens: prompt tokens, or None for the model's serving context (the
            smaller of the two applies); over it: `PromptTooLong`. Token ids are checked at
            submit, text after the worker tokenizes it.
        max_top_k: largest ``top_k`` (default 1000; `InvalidRequest` above).
        max_prompt_logprobs: largest ``prompt_logprobs`` K (default 20; `InvalidRequest`).
        max_continuations: most ``continuations`` of one job (default 256; `InvalidRequest`).
        max_continuation_tokens: their tokens together (default 8,192): ids at submit, text
            after the worker tokenizes it; over it: `PromptTooLong`.

    Raises:
        ValueError: a limit that is not a positive integer (``max_top_k`` and
            ``max_prompt_logprobs`` may be 0).
    """

    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_prompt_tokens: int | None = None
    max_top_k: int = MAX_TOP_K
    max_prompt_logprobs: int = DEFAULT_MAX_PROMPT_LOGPROBS
    max_continuations: int = DEFAULT_MAX_CONTINUATIONS
    max_continuation_tokens: int = DEFAULT_MAX_CONTINUATION_TOKENS

    def __post_init__(self) -> None:
        lowest = {"max_prompt_bytes": 1, "max_prompt_tokens": 1, "max_top_k": 0,
                  "max_prompt_logprobs": 0, "max_continuations": 1,
                  "max_continuation_tokens": 1}
        for name, low in lowest.items():
            value = getattr(self, name)
            if value is None and name == "max_prompt_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Limits.{name} must be an integer >= {low}, got {value!r}")

    def prompt_tokens(self, context_length: int) -> int:
        """The most prompt tokens a job may have on a model serving `context_length`."""
        if self.max_prompt_tokens is None:
            return context_length
        return min(context_length, self.max_prompt_tokens)
