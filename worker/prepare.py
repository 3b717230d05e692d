"""A job's first start on a worker: its token ids, their checks, its chunk plan and prefill.

A job's input becomes token ids once, here: given ids as they are, text through the model's
tokenizer. A job of a session starts from the session's slot when this worker keeps it
(`worker.sessions.SessionSlots`): `model.session.session_prefill` decides how much of the
slot's cache the prompt reuses and plans the rest with a chunk ending at the recovery
position, where the slot's turn anchor is snapshotted. Every other job runs on its recorded
chunk plan (or this worker's plan at its first start): from its latest usable KV checkpoint
when it has one (`worker.checkpoints.checkpointing`), else cold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jobs.continuations import check_continuation_tokens, check_continuations_against_model
from jobs.errors import InvalidRequest
from jobs.limits import Limits
from jobs.record import JobRecord
from jobs.requests import DEFAULT_LIMITS, check_record, check_token_ids
from model.planner import ChunkPlan, plan_chunks
from model.prefill import Prefill
from model.registry import LoadedModel
from model.tokenizer import TokenizerError

from .checkpoints.checkpointing import Checkpointing, JobCheckpoints
from .prefixes import PrefixBlocks
from .sessions import SessionSlots

log = logging.getLogger("prefillq.worker")

# error.type of a job whose recorded chunk plan does not fit its prompt
INVALID_CHUNK_PLAN = "InvalidChunkPlan"
# a job's own input is at fault: it fails with the error's type (InvalidRequest or a subclass:
# EmptyPrompt, TokenOutOfRange, PromptTooLong, PromptTooLarge; or a TokenizerError), the
# worker carries on
INPUT_ERRORS = (InvalidRequest, TokenizerError)


@dataclass
class Prepared:
    """What a job's first start here produced.

    Attributes:
        prefill: the job's prefill, or None when it fails (`error`).
        error: ``(error type, message)`` the job fails with, else None.
        slot: the session's slot, checked out of `SessionSlots` for the job (None for a job
            without a session, or when this worker keeps no sessions); it goes back with
            `SessionSlots.keep` however the job leaves.
        checkpoints: set when the prefill was restored from a KV checkpoint.
        prefix_keys: the keys of the prompt's blocks the prefix cache keeps once the job
            finishes (`worker.prefixes.PrefixBlocks`); empty: none.
        deferred: the job waits (untouched, back at the head of its queue) for a live job
            that is prefilling the block its prompt would reuse next.
        continuations: the job's continuations as token ids (`continuation_ids`), or None.
    """

    prefill: Prefill | None
    error: tuple[str, str] | None = None
    slot: Any = None
    checkpoints: JobCheckpoints | None = None  # a resumed job's checkpoint state
    prefix_keys: list[bytes] = field(default_factory=list)
    deferred: bool = False
    continuations: list[list[int]] | None = None


def prepare(loaded: LoadedModel, record: JobRecord, *, chunk_tokens: int | None,
            sessions: SessionSlots | None,
            checkpointing: Checkpointing | None = None,
            limits: Limits = DEFAULT_LIMITS, prefixes: PrefixBlocks | None = None,
            live: Callable[[str], bool] = lambda job_id: False) -> Prepared:
    """Check, tokenize and plan `record`'s job and allocate its cache, reuse its session's
    slot, restore it from the job's latest usable KV checkpoint, or, at its first start,
    start it from the longest prompt prefix `prefixes` holds.

    The record is checked as `submit` checks it (`jobs.requests.check_record`, against this
    worker's `limits`) before it is tokenized, so a job a foreign or older client enqueued
    that breaks them (a 10 MB prompt, a top_k over the limit, two inputs) fails with the
    same typed error without costing the tokenizer; its ids are then checked against the
    vocabulary and the smaller of the serving context and ``limits.max_prompt_tokens``.

    Args:
        chunk_tokens: this worker's cap on chunk size (the smaller of it and the job's own
            applies).
        sessions: this worker's session slots, or None.
        checkpointing: this worker's checkpoints, or None (a restarted job starts at 0).
        limits: this worker's limits.
        prefixes: this worker's prefix cache, or None (off).
        live: whether a job is resident here or starting with this one (a job defers to
            a live one prefilling its next block: `PrefixBlocks.prefill`).
    """
    try:
        check_record(record, limits)
        ids = token_ids(loaded, record)
        check_token_ids(ids, loaded.vocab_size, limits.prompt_tokens(loaded.context_length))
        continuations = continuation_ids(loaded, record, ids, limits)
    except INPUT_ERRORS as e:
        return Prepared(None, (type(e).__name__, str(e)))
    prepared = _prepare(loaded, record, ids, chunk_tokens, sessions, checkpointing,
                        prefixes, live, keep_cache=continuations is not None)
    prepared.continuations = continuations
    return prepared


def _prepare(loaded: LoadedModel, record: JobRecord, ids: list[int], chunk_tokens: int | None,
             sessions: SessionSlots | None, checkpointing: Checkpointing | None,
             prefixes: PrefixBlocks | None, live: Callable[[str], bool], *,
             keep_cache: bool) -> Prepared:
    """`prepare`'s prefill of the checked `ids`; `keep_cache`: its last chunk writes its
    rows (a job with continuations scores them from its cache)."""
    caps = [c for c in (chunk_tokens, record.chunk_tokens) if c is not None]
    cap = min(caps) if caps else None
    if record.session and sessions is not None and sessions.max_slots > 0:
        return _session_prefill(loaded, record, ids, cap, sessions)
    if prefixes is not None and record.chunk_plan is None:  # a later attempt keeps its plan
        return _prefix_prefill(loaded, record, ids, cap, prefixes, live, keep_cache)
    try:
        plan = recorded_plan(record, len(ids)) or plan_chunks(
            len(ids), loaded.sliding_window, chunk_tokens=cap)
    except ValueError as e:
        return Prepared(None, (INVALID_CHUNK_PLAN, str(e)))
    if checkpointing is not None:  # (a prompt_logprobs job never has a checkpoint)
        resumed = checkpointing.resume(loaded, record, ids, plan)
        if resumed is not None:
            return Prepared(resumed[0], checkpoints=resumed[1])
    try:
        # no session keeps the cache: the last chunk need not write its rows, unless
        # continuations are scored from it
        return Prepared(loaded.start_prefill(ids, plan=plan,
                                             prompt_logprobs=record.prompt_logprobs,
                                             keep_cache=keep_cache))
    except Exception as e:
        log.exception("job %s: could not start", record.job_id)
        return Prepared(None, ("ModelError", f"{type(e).__name__}: {e}"))


def _prefix_prefill(loaded: LoadedModel, record: JobRecord, ids: list[int],
                    chunk_tokens: int | None, prefixes: PrefixBlocks,
                    live: Callable[[str], bool], keep_cache: bool) -> Prepared:
    try:
        started = prefixes.prefill(loaded, ids, job_id=record.job_id, chunk_tokens=chunk_tokens,
                                   prompt_logprobs=record.prompt_logprobs, live=live,
                                   keep_cache=keep_cache, salt=record.cache_salt)
    except Exception as e:
        log.exception("job %s: could not start", record.job_id)
        return Prepared(None, ("ModelError", f"{type(e).__name__}: {e}"))
    if started is None:
        return Prepared(None, deferred=True)
    return Prepared(started[0], prefix_keys=started[1])


def _session_prefill(loaded: LoadedModel, record: JobRecord, ids: list[int],
                     chunk_tokens: int | None, sessions: SessionSlots) -> Prepared:
    # A session job plans afresh at every start: where its cursor starts depends on what
    # this worker's slot reuses, so a recorded plan (made against another slot) is not used.
    # Without a slot here, the session's checkpointed slot (its last finished turn) is used.
    slot = sessions.take_or_restore(record.session, loaded)
    try:
        prefill, slot = loaded.session_prefill(slot, ids, chunk_tokens=chunk_tokens)
    except Exception as e:  # the slot may be half applied: it is not kept
        log.exception("job %s: could not start from session %s", record.job_id,
                      record.session)
        sessions.release(record.session)
        return Prepared(None, ("ModelError", f"{type(e).__name__}: {e}"))
    return Prepared(prefill, slot=slot)


def recorded_plan(record: JobRecord, n_tokens: int) -> ChunkPlan | None:
    """The chunk plan recorded at the job's first start, or None.

    Raises:
        ValueError: the recorded boundaries do not fit a prompt of `n_tokens`.
    """
    if record.chunk_plan is None:
        return None
    return ChunkPlan.from_boundaries(n_tokens, record.chunk_plan)


def continuation_ids(loaded: LoadedModel, record: JobRecord, ids: list[int],
                     limits: Limits) -> list[list[int]] | None:
    """The job's continuations as token ids, checked, or None without any: given ids as
    they are; a text continuation as lm-eval splits a (context, continuation) pair
    (``_encode_pair``): the ids of prompt + continuation after the prompt's own `ids`.

    Raises:
        InvalidRequest: a continuation with no tokens of its own.
        PromptTooLong, TokenOutOfRange: as `jobs.continuations`' checks against `limits`
            and the model.
        TokenizerError: the text cannot be tokenized.
    """
    if record.continuations is None:
        return None
    if record.tokens is not None:
        out = record.continuations
    else:
        out = [loaded.tokenizer.encode((record.prompt or "") + text,
                                       parse_special=record.parse_special)[len(ids):]
               for text in record.continuations]
    check_continuation_tokens(out, limits)
    check_continuations_against_model(ids, out, loaded.vocab_size,
                                      limits.prompt_tokens(loaded.context_length))
    return out


def token_ids(loaded: LoadedModel, record: JobRecord) -> list[int]:
    """The job's prompt as token ids: given ids, text (BOS per the model), or chat
    messages rendered with the model's chat template (tokenized once, no extra BOS).

    Raises:
        TokenizerError: the text cannot be tokenized; ``ChatTemplateError`` (a subclass):
            the messages cannot be rendered.
    """
    if record.tokens is not None:
        return record.tokens
    if record.messages is not None:  # ChatTemplateError is a TokenizerError: input error
        return loaded.tokenizer.apply_chat_template(
            record.messages, add_generation_prompt=record.add_generation_prompt)
    return loaded.tokenizer.encode(record.prompt or "", parse_special=record.parse_special)
