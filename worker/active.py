"""A job resident on this worker (`ActiveJob`) and the result it publishes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jobs.result import ContinuationResult, TopLogit, prompt_logprobs_blob, result_blob
from jobs.schema import LogitsMode
from model.continuations import ContinuationScore, score_continuations
from model.logprobs import TopToken, logprobs_of, top_k
from model.prefill import Prefill
from model.registry import LoadedModel

from .checkpoints.checkpointing import JobCheckpoints


@dataclass
class ActiveJob:
    """A job whose KV cache this worker holds."""

    job_id: str
    attempt: int
    max_attempts: int
    model: LoadedModel
    prefill: Prefill
    top_k: int
    logits_mode: LogitsMode
    enqueued_at: float
    first_started_at: float
    started_at: float
    session: str | None = None  # the session whose slot `slot` is (checked out for the job)
    tenant: str | None = None  # whose job, for the fair share (`worker.fair_share`)
    slot: Any = None
    checkpoints: JobCheckpoints | None = None  # None: this job is not checkpointed
    # the keys of its prompt's blocks, kept in the worker's prefix cache once it finishes
    # (`worker.prefixes.PrefixBlocks`); empty: none are
    prefix_keys: list[bytes] = field(default_factory=list)
    # its continuations' token ids, scored from its cache once the prompt is prefilled
    # (`model.continuations`), and their scores then; None: it has none
    continuations: list[list[int]] | None = None
    scores: list[ContinuationScore] | None = None
    label_token_ids: list[int] | None = None  # their logprobs after the prompt (and each
    # continuation) are in the result


def result_of(active: ActiveJob, logits: np.ndarray, prefill_s: float) -> bytes:
    """The ``result`` field of a finished job (`jobs.result.result_blob`).

    Args:
        logits: float32 ``(vocab,)`` after the last position.
        prefill_s: seconds from the job's first start to its finish; ``tokens_per_s`` counts
            the tokens this job prefilled (not those reused from a session's slot).
    """
    p, loaded = active.prefill, active.model
    return result_blob(
        n_tokens=p.n_tokens, cached_tokens=p.cached_tokens, reuse=p.reuse,
        chunks_done=p.chunks_done,
        top_k=top_logits(top_k(logits, active.top_k), loaded),
        timings={
            "queue_wait_s": active.first_started_at - active.enqueued_at,
            "prefill_s": prefill_s,
            "compute_s": p.compute_seconds,
            "tokens_per_s": (p.n_tokens - p.cached_tokens) / prefill_s,
        },
        model_sha256=loaded.sha256,
        continuations=None if active.scores is None else [
            ContinuationResult(tokens=s.token_ids, logprob=s.logprob, is_greedy=s.is_greedy,
                               token_logprobs=s.token_logprobs,
                               top=[[{"id": i, "logprob": lp} for i, lp in zip(ids, lps,
                                                                                strict=True)]
                                    for ids, lps in zip(s.top_ids, s.top_logprobs,
                                                        strict=True)],
                               top_k=top_logits(s.top_k, loaded),
                               label_logprobs=s.label_logprobs)
            for s in active.scores],
        label_logprobs=None if active.label_token_ids is None else logprobs_of(
            logits, active.label_token_ids),
    )


def top_logits(top: list[TopToken], loaded: LoadedModel) -> list[TopLogit]:
    """`top` as a result's `TopLogit`s, each with its token's text."""
    return [TopLogit(id=t.id, logit=t.logit, logprob=t.logprob,
                     piece=loaded.tokenizer.piece(t.id)) for t in top]


def score(active: ActiveJob, logits: np.ndarray, chunk_tokens: int | None) -> None:
    """Score `active`'s continuations from its done prefill's cache into ``scores``
    (`model.continuations.score_continuations`, with the job's ``prompt_logprobs`` K as
    their positions' top K and its ``top_k`` after each, in passes of at most
    `chunk_tokens` tokens); nothing without any.

    Args:
        logits: float32 ``(vocab,)``, the prompt's final logits.
    Raises:
        whatever scoring raises (a forward pass's error); ``scores`` is left None then.
    """
    if active.continuations is None:
        return
    p = active.prefill
    active.scores = score_continuations(
        p, logits, active.continuations, k=0 if p.logprobs is None else p.logprobs.k,
        top_k=active.top_k, label_ids=active.label_token_ids or (),
        vocab_size=active.model.vocab_size, chunk_tokens=chunk_tokens)


def prompt_logprobs_of_prefill(prefill: Prefill) -> bytes:
    """A finished prefill's ``logprobs`` for its Redis key (`jobs.result.prompt_logprobs_blob`),
    or ``b""`` when the job asked for none."""
    lp = prefill.logprobs
    if lp is None:
        return b""
    return prompt_logprobs_blob(
        k=lp.k, ids=np.asarray(lp.token_ids, dtype="<i4").tobytes(),
        token_logprob=lp.token_logprob.astype("<f4").tobytes(),
        top_ids=lp.top_ids.astype("<i4").tobytes(),
        top_logprobs=lp.top_logprobs.astype("<f4").tobytes())
