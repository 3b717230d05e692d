"""Continuations of one context: the context prefilled once, each continuation from its end.

A log-likelihood request of lm-eval is a (context, continuation) pair, answered with the
continuation's summed log-probability given the context and whether greedy decoding would
produce it (``TemplateLM._loglikelihood_tokens`` and ``HFLM._loglikelihood_tokens`` in
lm-evaluation-harness: ``logits.argmax(-1) == continuation`` over the continuation's
positions). A multiple-choice question asks it once per choice with the same context, and a
classifier once per label. Here the context's prefill runs once; each continuation then runs
from a fork of its cache (`ModelCache.fork`: the context's rows are shared, not copied or
recomputed), the continuations packed into forward passes of at most a chunk's tokens where
the model packs (`Prefill.launch_all`).

Continuation token j (``c_j``) is scored by the logits after ``context + c[:j]``: those of
the context's last position for ``c_0`` (the context's final logits), and the head on the
continuation's own positions for the others; the head on its last position gives the
logits after it (what a generation would add next).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .cache import CommittedCache
from .chunk import PrefillModel
from .logprobs import PromptLogprobs, TopToken, logprobs_of
from .logprobs import top_k as top
from .planner import DEFAULT_CHUNK_TOKENS, plan_chunks
from .prefill import Prefill


@dataclass(frozen=True)
class ContinuationScore:
    """One continuation's log-probabilities given the context.

    Attributes:
        token_ids: the continuation, ``m >= 1`` ids.
        token_logprobs: ``log p(c_j | context, c_<j)`` for each ``j`` (natural log).
        logprob: their sum (lm-eval's log-likelihood of the continuation).
        is_greedy: every ``c_j`` is the most likely token after what precedes it (of equal
            logits, the lowest id).
        top_ids, top_logprobs: the `k` likeliest ids at each continuation position and their
            logprobs, highest first (``m`` lists of ``k``; empty lists for ``k = 0``).
        top_k: the highest logits after the whole continuation (`model.logprobs.top_k` of
            its final logits), highest first.
        label_logprobs: the logprob of each of the label ids after the whole continuation.
    """

    token_ids: list[int]
    token_logprobs: list[float]
    logprob: float
    is_greedy: bool
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    top_k: list[TopToken]
    label_logprobs: list[float]


def fork_cache(model: PrefillModel, cache: CommittedCache) -> CommittedCache:
    """A second cache equal to `cache` at its committed position: `ModelCache.fork` (rows
    shared as values), else through its exact byte state (`CommittedCache.state`, as a KV
    checkpoint restores it: DeepSeek-V4's compressed cache).

    Raises:
        CachePoisoned, ChunkInFlight: `cache` holds a half-written or launched chunk.
    """
    fork = getattr(cache, "fork", None)
    return fork() if fork is not None else model.cache_from_state(cache.state())


def score_continuations(context: Prefill, logits: np.ndarray,
                        continuations: Sequence[Sequence[int]], *, k: int = 0,
                        top_k: int = 0, label_ids: Sequence[int] = (), vocab_size: int,
                        chunk_tokens: int | None = None) -> list[ContinuationScore]:
    """Score each of `continuations` after `context`'s prompt.

    Each continuation is prefilled from a fork of the context's cache (`fork_cache`), in
    chunks of at most `chunk_tokens` (default the planner's ``DEFAULT_CHUNK_TOKENS``); the
    continuations advance together, as many in one packed forward pass (where the model
    packs) as fit `chunk_tokens` tokens. The context's cache is left as it was.

    Args:
        context: a done prefill whose cache holds every row of its prompt
            (``keep_cache``: its last chunk wrote them).
        logits: float32 ``(vocab,)``, the context's final logits (`Prefill.logits`).
        continuations: token ids each (``m >= 1``, ids in ``[0, vocab_size)``); the context
            and each continuation together must fit the cache's context length.
        k: top alternatives reported per continuation position, ``0 <= k <= vocab_size``.
        top_k: the highest logits after each whole continuation to report (`top_k` of its
            final logits: the token a generation would add).
        label_ids: token ids whose logprobs after each whole continuation to report
            (generative scoring's label tokens: "yes" and "no", say).
        vocab_size: the model's vocabulary size.
    Returns:
        one `ContinuationScore` each, in order.
    Raises:
        ValueError: the context is not done or did not keep its cache, or a continuation is
            empty.
        ContextExhausted: a continuation runs past the cache's context length.
        Whatever a forward pass raises (the forks are dropped; the context's cache is
        untouched).
    """
    if not context.done or not context.keep_cache:
        raise ValueError("continuations need a done context prefill that kept its cache "
                         "(keep_cache=True)")
    n = context.n_tokens
    lanes = []
    for i, continuation in enumerate(continuations):
        ids = [int(t) for t in continuation]
        if not ids:
            raise ValueError(f"continuations[{i}] is empty")
        prompt = [*context.token_ids, *ids]
        logprobs = PromptLogprobs(prompt, max(k, 1), vocab_size)
        logprobs.start_at(n, logits)
        lanes.append(Prefill(
            model=context.model, token_ids=prompt, logprobs=logprobs, keep_cache=False,
            plan=plan_chunks(len(prompt), context.model.sliding_window,
                             chunk_tokens=chunk_tokens, cursor=n),
            cache=fork_cache(context.model, context.cache), cached_tokens=n))
    pending = lanes
    while pending:
        for group in _passes(pending, chunk_tokens or DEFAULT_CHUNK_TOKENS):
            Prefill.launch_all(group)
            for lane in group:
                lane.step()
        pending = [lane for lane in pending if not lane.done]
    after = Prefill.logits_of(lanes)  # each whole continuation's final logits
    return [_score(lane.logprobs, n, k, top(final, top_k), logprobs_of(final, label_ids))
            for lane, final in zip(lanes, after, strict=True)]


def _passes(lanes: list[Prefill], max_tokens: int) -> list[list[Prefill]]:
    """`lanes` in order, cut into forward passes of at most `max_tokens` next-chunk tokens
    (a lane alone may have up to a chunk)."""
    passes: list[list[Prefill]] = [[]]
    tokens = 0
    for lane in lanes:
        if passes[-1] and tokens + lane.next_chunk_tokens > max_tokens:
            passes.append([])
            tokens = 0
        passes[-1].append(lane)
        tokens += lane.next_chunk_tokens
    return passes


def _score(logprobs: PromptLogprobs, start: int, k: int, next_top: list[TopToken],
           labels: list[float]) -> ContinuationScore:
    """The continuation entries ``[start, n)`` of `logprobs` (top 1 at least) as a score."""
    rows = slice(start, len(logprobs.token_ids))
    ids = logprobs.token_ids[rows]
    token = [float(x) for x in logprobs.token_logprob[rows]]
    return ContinuationScore(
        token_ids=ids, token_logprobs=token, logprob=math.fsum(token),
        is_greedy=bool(np.array_equal(logprobs.top_ids[rows, 0], ids)),
        top_ids=logprobs.top_ids[rows, :k].tolist(),
        top_logprobs=logprobs.top_logprobs[rows, :k].tolist(), top_k=next_top,
        label_logprobs=labels)
