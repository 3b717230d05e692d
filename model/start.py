"""How a prefill starts: cold (`start_prefill`) or from a KV checkpoint (`resume_prefill`);
a session's next prompt starts from its retained cache in `model.session`.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .cache_state import CacheState, dtype_name
from .chunk import PrefillModel
from .logprobs import PromptLogprobs
from .planner import ChunkPlan, check_prompt, plan_chunks
from .prefill import Prefill


def start_prefill(
    model: PrefillModel,
    token_ids: Sequence[int],
    *,
    vocab_size: int,
    context_length: int,
    chunk_tokens: int | None = None,
    kv_dtype: mx.Dtype = mx.float32,
    plan: ChunkPlan | None = None,
    prompt_logprobs: int | None = None,
    keep_cache: bool = True,
) -> Prefill:
    """Plan the chunks of a cold prefill of `token_ids` and allocate its cache.

    Callers validate a prompt first (``jobs.requests.check_token_ids`` raises the typed
    errors a client sees); this function only guards its own preconditions.

    Args:
        token_ids: the prompt, BOS included when the model wants one.
        vocab_size: ids must be in ``[0, vocab_size)``.
        context_length: serving context in tokens; the prompt must fit in it.
        chunk_tokens: exact chunk size, or None for the window-aligned default.
        plan: chunks decided earlier (e.g. recorded on a job); overrides `chunk_tokens`.
            It must start at 0 and end at ``len(token_ids)``.
        prompt_logprobs: K, to keep every position's logprob and top K
            (`model.logprobs.PromptLogprobs`, as ``Prefill.logprobs``); None: off.
        keep_cache: False when nothing will read the cache once the prefill is done (a job
            no session keeps): its last chunk then need not write its rows
            (``Prefill.keep_cache``).
    Raises:
        ValueError: no ids, an id outside the vocabulary, more ids than `context_length`,
            or a `plan` for another prompt length or start.
    """
    ids = check_prompt(token_ids, vocab_size, context_length)
    if plan is None:
        plan = plan_chunks(len(ids), model.sliding_window, chunk_tokens=chunk_tokens)
    elif plan.n_tokens != len(ids) or plan.start != 0 or plan.boundaries[-1] != len(ids):
        raise ValueError(f"a plan for {plan.n_tokens} tokens from {plan.start} does not fit a "
                         f"cold prefill of {len(ids)} tokens")
    cache = model.make_cache(kv_dtype, capacity=len(ids), context_length=context_length)
    logprobs = None
    if prompt_logprobs is not None:
        logprobs = PromptLogprobs(ids, prompt_logprobs, vocab_size)
    return Prefill(model=model, token_ids=ids, plan=plan, cache=cache, logprobs=logprobs,
                   keep_cache=keep_cache)


def resume_prefill(
    model: PrefillModel,
    token_ids: Sequence[int],
    plan: ChunkPlan,
    state: CacheState,
    *,
    vocab_size: int,
    context_length: int,
    kv_dtype: mx.Dtype = mx.float32,
) -> Prefill:
    """A prefill of `token_ids` on `plan` whose cache is restored from a complete `state`
    (a checkpoint at position p): the cursor and ``resumed_from`` are p and ``chunks_done``
    counts from 0.

    Args:
        plan: the job's chunk plan from 0; p must be one of its chunk ends before the last
            (a state at the prompt's end has no hidden state to give logits from).
        state: ``cache.state()`` of a cache of this model at p (``since`` 0).
        kv_dtype: the dtype this model's caches use; the state must have it.
    Raises:
        ValueError: bad ids (`check_prompt`), a plan for another prompt, p not a chunk end
            of `plan` before the last, or a state of another dtype.
        CacheStateError (a ValueError): the state does not fit this model's cache.
    """
    ids = check_prompt(token_ids, vocab_size, context_length)
    if plan.n_tokens != len(ids) or plan.start != 0 or plan.boundaries[-1] != len(ids):
        raise ValueError(f"a plan for {plan.n_tokens} tokens from {plan.start} does not fit a "
                         f"prefill of {len(ids)} tokens")
    position = state.meta.get("position")
    if position not in plan.boundaries[:-1]:
        raise ValueError(f"state at position {position!r} is not a chunk end of "
                         f"{plan.boundaries[:-1]} before the prompt's end")
    if state.meta.get("kv_dtype") != dtype_name(kv_dtype):
        raise ValueError(f"state kv_dtype {state.meta.get('kv_dtype')!r} is not this model's "
                         f"{dtype_name(kv_dtype)}")
    cache = model.cache_from_state(state)
    return Prefill(model=model, token_ids=ids, plan=plan, cache=cache, resumed_from=position)
