"""One chunk's forward pass against a job's KV cache: launch, then commit or poison.

`launch_chunk` builds a chunk's graph at the cache's committed position and starts it;
`finish_chunk` waits for it and commits. Whatever raises in between poisons the cache; a
chunk whose job ends first is abandoned (`model.cache.CommittedCache.abandon`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

from .cache_state import CacheState
from .kv_cache import ModelCache

if TYPE_CHECKING:
    from .logprobs import PromptLogprobs


class PrefillModel(Protocol):
    """What an architecture module's ``Model`` provides to the prefill loop."""

    sliding_window: int

    def __call__(self, inputs: mx.array, cache: ModelCache,
                 every_position: bool = ...) -> mx.array: ...

    def logits(self, hidden: mx.array) -> mx.array: ...

    def make_cache(
        self,
        kv_dtype: mx.Dtype = ...,
        capacity: int = ...,
        context_length: int = ...,
        capacity_step: int | None = ...,
    ) -> ModelCache: ...

    def cache_from_state(self, state: CacheState) -> ModelCache: ...


class PackingModel(PrefillModel, Protocol):
    """A model that also runs several jobs' chunks in one forward pass
    (`model.archs._packed.PackedModel`)."""

    def packs(self, caches: list[ModelCache]) -> bool: ...

    def packed(self, inputs: list[mx.array], caches: list[ModelCache],
               every_position: Sequence[bool] | None = ...,
               writes: Sequence[bool] | None = ...) -> list[mx.array]: ...


def prefill_chunk(model: PrefillModel, cache: ModelCache, token_ids: Sequence[int]) -> mx.array:
    """Run `token_ids` at ``cache.position``, evaluate, then commit them.

    Returns:
        float ``(1, hidden)``: the last position's final hidden state (evaluated).
    Raises:
        CachePoisoned: the cache was poisoned earlier. Anything the forward pass raises,
        after poisoning the cache (rows past its position may be half written).
    """
    hidden, _ = launch_chunk(model, cache, token_ids)
    return finish_chunk(cache, hidden, len(token_ids))


def launch_chunk(model: PrefillModel, cache: ModelCache, token_ids: Sequence[int],
                 logprobs: PromptLogprobs | None = None) -> tuple[mx.array, tuple]:
    """Build the forward pass of `token_ids` at ``cache.position`` and start evaluating it
    (``mx.async_eval``) without waiting; `finish_chunk` waits and commits. Nothing else may
    touch `cache` in between but building the next chunk ahead of it (`Prefill.run`).

    Args:
        logprobs: a job's prompt log-probabilities: the head also runs on every position.
    Returns:
        float ``(1, hidden)``: the last position's final hidden state, and the lazy
        ``logprobs.launch`` outputs (empty without `logprobs`), both being evaluated.
    Raises:
        CachePoisoned: the cache was poisoned earlier. Anything building the graph raises,
        after poisoning the cache.
    """
    cache.check_chunk(len(token_ids))
    start = cache.position
    cache.begin(len(token_ids))
    try:
        inputs = mx.array(token_ids, dtype=mx.int32)[None]
        out = (model(inputs, cache) if logprobs is None
               else model(inputs, cache, every_position=True))  # (1, L, hidden)
        hidden, head = with_head(model, out, logprobs, start)
        mx.async_eval(hidden, *head, cache.arrays())
    except BaseException:
        cache.poison()
        raise
    return hidden, head


def launch_packed(model: PackingModel, caches: Sequence[ModelCache],
                  chunks: Sequence[Sequence[int]],
                  logprobs: Sequence[PromptLogprobs | None] | None = None,
                  writes: Sequence[bool] | None = None) -> list[tuple[mx.array, tuple]]:
    """`launch_chunk` for several jobs' chunks in one forward pass (``model.packed``: the
    linear layers over every job's rows at once, attention per job against its own cache);
    each job's `finish_chunk` then waits and commits it.

    Args:
        model: a model whose ``packs(caches)`` holds.
        caches: each job's cache, at its committed position.
        chunks: each job's chunk of token ids (none empty).
        logprobs: each job's prompt log-probabilities or None (the default: None for all):
            the head also runs on every position of that job's chunk.
        writes: per job, whether its chunk's rows must reach its cache (default: all);
            False lets the model skip them (a job's last chunk when no one reads its cache
            again) and keeps that cache's arrays out of the evaluation.
    Returns:
        per job, as `launch_chunk`: float ``(1, hidden)``, its chunk's last hidden state,
        and its lazy ``logprobs.launch`` outputs (empty without logprobs), being evaluated.
    Raises:
        CachePoisoned: a cache was poisoned earlier. Anything building the graph raises,
        after poisoning every cache of the pass.
    """
    logprobs = list(logprobs or [None] * len(chunks))
    writes = list(writes or [True] * len(chunks))
    for cache, ids in zip(caches, chunks, strict=True):
        cache.check_chunk(len(ids))
    starts = [cache.position for cache in caches]
    try:
        for cache, ids in zip(caches, chunks, strict=True):
            cache.begin(len(ids))
        outs = model.packed([mx.array(ids, dtype=mx.int32) for ids in chunks], list(caches),
                            every_position=[lp is not None for lp in logprobs], writes=writes)
        launched = [with_head(model, out, lp, start)
                    for out, lp, start in zip(outs, logprobs, starts, strict=True)]
        mx.async_eval(*(a for hidden, head in launched for a in (hidden, *head)),
                      *(cache.arrays() for cache, w in zip(caches, writes, strict=True) if w))
    except BaseException:
        for cache in caches:
            cache.poison()
        raise
    return launched


def with_head(model: PrefillModel, out: mx.array, logprobs: PromptLogprobs | None,
              start: int) -> tuple[mx.array, tuple]:
    """A chunk's forward output at `start` as ``(hidden, head)``: without `logprobs`, `out`
    is the last position's hidden state ``(1, hidden)`` and the head is empty; with them,
    `out` is every position's ``(1, L, hidden)``, the hidden state its last, and the head
    ``logprobs.launch`` (lazy)."""
    if logprobs is None:
        return out, ()
    return out[:, -1], logprobs.launch(model, out, start)


def finish_chunk(cache: ModelCache, hidden: mx.array, n_tokens: int,
                 head: tuple = ()) -> mx.array:
    """Wait for a `launch_chunk` of `n_tokens` tokens (and its `head` outputs), then commit
    them.

    Returns:
        `hidden`, evaluated.
    Raises:
        Anything the forward pass raises, after poisoning the cache.
    """
    eval_or_poison(cache, hidden, *head, cache.arrays())
    cache.commit(n_tokens)
    return hidden


def final_logits(model: PrefillModel, hidden: Sequence[mx.array]) -> list[mx.array]:
    """Each job's final logits from its last hidden state (float ``(1, hidden)`` each), with
    one pass of the output head over them all, started on the device (``mx.async_eval``)
    without waiting: float32 ``(vocab,)`` each, lazy. The float32 cast is part of the pass,
    so that turning each job's row into NumPy later waits for it and copies, without a
    kernel and a wait of its own per job."""
    if not hidden:
        return []
    rows = model.logits(mx.concatenate(list(hidden))).astype(mx.float32)  # (jobs, vocab)
    mx.async_eval(rows)
    return [rows[i] for i in range(len(hidden))]


def eval_or_poison(cache: ModelCache, *arrays) -> None:
    """``mx.eval(*arrays)``; whatever it raises poisons `cache` first."""
    try:
        mx.eval(*arrays)
    except BaseException:
        cache.poison()
        raise
