"""Shared by the reliability tests: the model, what each error is documented as, and the
good job every test runs beside the bad ones."""

from __future__ import annotations

import numpy as np

from jobs import (
    EmptyPrompt,
    InvalidRequest,
    JobState,
    PrefillClient,
    PromptTooLarge,
    PromptTooLong,
    TokenOutOfRange,
    UnknownModel,
)

MODEL = "gemma3-tiny"
CONTEXT = 64  # the serving context of `tiny64`, in tokens
VOCAB = 365  # gemma3-tiny's vocabulary
# What `submit` may raise for bad input (docs/client.md, "Errors"); all are InvalidRequests.
SUBMIT_ERRORS = (InvalidRequest, EmptyPrompt, PromptTooLong, PromptTooLarge, TokenOutOfRange,
                 UnknownModel)
# A failed job's ``error.type`` when its input is at fault (docs/architecture.md, "Job lifecycle").
JOB_INPUT_ERRORS = {"PromptTooLong", "PromptTooLarge", "EmptyPrompt", "TokenOutOfRange",
                    "InvalidRequest", "ChatTemplateMissing", "ChatTemplateError",
                    "CorruptJob"}
# How an InvalidRequest's message starts: the field it names.
FIELDS = ("prompt", "tokens", "messages", "add_generation_prompt", "model", "top_k",
          "logits", "parse_special", "session", "priority", "tenant", "prompt_logprobs",
          "chunk_tokens", "idempotency_key", "max_attempts", "give exactly one of")


def work(worker) -> None:
    """Run `worker` until its queues are empty (burst), in this thread."""
    worker.work(burst=True, logging_level="WARNING")


def ids(n: int, seed: int) -> list[int]:
    """`n` token ids: BOS, then random text-token ids of the tiny vocabulary."""
    rng = np.random.default_rng(seed)
    return [2, *rng.integers(260, VOCAB, size=n - 1).tolist()]


GOOD = ids(40, 7)


def submit_good(client: PrefillClient) -> str:
    return client.submit(tokens=GOOD, model=MODEL, top_k=5, chunk_tokens=16)


def assert_good(client: PrefillClient, job_id: str, tiny) -> None:
    """The good job finished with the logits of a fresh one-pass prefill of its ids."""
    assert client.status(job_id).state == JobState.FINISHED
    assert_logits(client.result(job_id, timeout=0), tiny, GOOD)


def assert_logits(result, tiny, token_ids: list[int]) -> None:
    expected = tiny.start_prefill(token_ids).run()
    top = np.argsort(-expected, kind="stable")[: len(result.top_k)]
    assert [t.id for t in result.top_k] == top.tolist()
    for t in result.top_k:
        assert abs(t.logit - expected[t.id]) <= 1e-3 * np.abs(expected).max()
