"""`WorkerSettings`: everything a `PrefillWorker` is configured with, in one value."""

from __future__ import annotations

from dataclasses import dataclass, field

from jobs.defaults import (
    DEFAULT_HEARTBEAT_TTL_S,
    DEFAULT_LOGITS_TTL_S,
    DEFAULT_MAX_ACTIVE,
    DEFAULT_MAX_BATCH_JOBS,
    DEFAULT_RESULT_TTL_S,
    DEFAULT_SESSION_SLOTS,
)
from jobs.limits import Limits

from .checkpoints.policy import DEFAULT_CHECKPOINT_EVERY

# Default chunks' worth of tokens one step computes at most on a GPU (one on a CPU).
GPU_STEP_CHUNKS = 4
# The prefix cache is off unless a worker is given a budget (``--prefix-cache-bytes``).
DEFAULT_PREFIX_CACHE_BYTES = 0


def default_step_tokens() -> int:
    """Tokens one step computes at most by default (``prefillq worker --step-tokens``): one
    default chunk (`model.planner.DEFAULT_CHUNK_TOKENS`, 2,048) when MLX's default device is
    the CPU, `GPU_STEP_CHUNKS` of them on a GPU. On a CPU a step is bound by its arithmetic:
    one chunk's worth keeps a step as long as a one-job step of a long prompt, so a new job's
    wait does not grow, while short jobs still share a step. On a GPU a 2,048-token chunk of
    a small model is bound by the host building its graph (``bench.gpu_ablate``: 82% of a
    Gemma 3 270M chunk's wall time), so several share one pass."""
    import mlx.core as mx  # here: `WorkerSettings` is read by CLIs that load no model

    from model.planner import DEFAULT_CHUNK_TOKENS

    chunks = 1 if mx.default_device() == mx.cpu else GPU_STEP_CHUNKS
    return chunks * DEFAULT_CHUNK_TOKENS


@dataclass(frozen=True)
class WorkerSettings:
    """A worker's settings (``prefillq worker``'s flags; `worker.cli.work.settings_of`).

    Attributes:
        chunk_tokens: cap on chunk size in tokens when this worker plans a job (a job's own
            cap may be smaller; a job planned before keeps its recorded plan); None: the
            planner's default.
        max_active: jobs resident at once.
        max_batch_jobs: resident jobs one step advances at most, a chunk each
            (`worker.scheduler.Scheduler`).
        step_tokens: tokens one step computes at most over its jobs' chunks (default: the
            device's, `default_step_tokens`; None: only `max_batch_jobs` bounds a step; a
            step always takes its first job's chunk).
        kv_budget_bytes: no new job is admitted while resident KV bytes exceed this.
        result_ttl_s, logits_ttl_s: lifetime in seconds of a terminal job's record and of
            its full logits.
        heartbeat_ttl_s: the worker counts as dead this many seconds after its last beat.
        session_slots, session_bytes: bounds on the session slots kept between a session's
            jobs (`worker.sessions.SessionSlots`; least recently used evicted first).
        checkpoint_store: where KV checkpoints go (`worker.checkpoints.store.open_store`: None for
            this queue's Redis, ``redis://...``, ``file:///dir``).
        checkpoint_every: ``N`` chunks, ``Ns`` seconds or ``none`` (`CheckpointPolicy`).
        checkpoint_max_bytes: jobs whose cache is larger are not checkpointed.
        prefix_cache_bytes: bound on the prefix cache's blocks of KV rows kept across jobs
            (`worker.prefixes.PrefixBlocks`); 0 turns it off.
        prefix_store: with a prefix cache, the store its shared tier writes blocks to and
            fetches them from (`worker.shared_prefixes`; URLs as ``checkpoint_store``'s,
            ``redis`` for this queue's Redis); None: no shared tier.
        tenant_weights: tenant -> weight in the fair share between tenants
            (`worker.fair_share`), until ``keys.TENANT_WEIGHTS`` says otherwise; a tenant
            named in neither weighs 1.
        tenant_max_resident: jobs of one tenant resident at once at most (None: no quota).
        publish_tokenizers: publish each model's tokenizer for clients that tokenize
            (`worker.heartbeat.Heartbeat.publish_tokenizer`).
        limits: what a job may ask for (`jobs.limits.Limits`), checked again at its start
            whatever client enqueued it; a job over them fails with the typed error.
    """

    chunk_tokens: int | None = None
    max_active: int = DEFAULT_MAX_ACTIVE
    max_batch_jobs: int = DEFAULT_MAX_BATCH_JOBS
    step_tokens: int | None = field(default_factory=default_step_tokens)
    kv_budget_bytes: int | None = None
    result_ttl_s: int = DEFAULT_RESULT_TTL_S
    logits_ttl_s: int = DEFAULT_LOGITS_TTL_S
    heartbeat_ttl_s: int = DEFAULT_HEARTBEAT_TTL_S
    session_slots: int = DEFAULT_SESSION_SLOTS
    session_bytes: int | None = None
    checkpoint_store: str | None = None
    checkpoint_every: str | None = DEFAULT_CHECKPOINT_EVERY
    checkpoint_max_bytes: int | None = None
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    prefix_store: str | None = None
    tenant_weights: dict[str, float] = field(default_factory=dict)
    tenant_max_resident: int | None = None
    publish_tokenizers: bool = True
    limits: Limits = field(default_factory=Limits)
