"""Every Redis key and channel prefillq uses, in one place.

Per-job keys carry the job id as a hash tag (``{id}``) so the scripts that decide a job's
fate touch one Redis Cluster slot. RQ's own keys (``rq:*``) are RQ's business.
"""

from __future__ import annotations

PREFIX = "prefillq"

# Our record of a job: the source of truth for its state (RQ's status is not).
JOB = PREFIX + ":{{{job_id}}}:job"
# Set by `cancel` on an in-flight job; checked by the worker between chunks.
CANCEL = PREFIX + ":{{{job_id}}}:cancel"
# Full float32 logits of a finished job, when requested.
LOGITS = PREFIX + ":{{{job_id}}}:logits"
# Per-position prompt log-probabilities of a finished job (``prompt_logprobs``), msgpack
# (`jobs.result.prompt_logprobs_of`), with the logits' TTL.
PROMPT_LOGPROBS = PREFIX + ":{{{job_id}}}:prompt-logprobs"
# Pub/sub channel: one message per chunk and one on the terminal state.
EVENTS = PREFIX + ":{{{job_id}}}:events"
# One part of a job's KV checkpoint number `seq` (1, 2, ...): its ``segment`` (append-only
# rows since the previous checkpoint), ``fixed`` (rings, compressor state) and ``record``.
CHECKPOINT = PREFIX + ":{{{job_id}}}:ckpt:{seq}:{part}"
CHECKPOINT_PARTS = ("segment", "fixed", "record")
# idempotency key -> job id
IDEMPOTENCY = PREFIX + ":idem:{key}"

# model name -> msgpack {vocab_size, context_length, architecture, sha256}
MODELS = PREFIX + ":models"
# model sha256 -> the model's tokenizer, published by its workers for clients that tokenize
# (`jobs.tokenizer`: msgpack with the zlib'd `tokenizers` JSON, ~5 MB for Gemma 3; no TTL)
TOKENIZER = PREFIX + ":tokenizer:{sha256}"
# names of registered workers
WORKERS = PREFIX + ":workers"
# worker liveness: exists while the worker is alive (TTL of a few chunk times)
WORKER_HEARTBEAT = PREFIX + ":worker:{worker}:heartbeat"
# ids of the jobs a worker holds in memory (for the dead-worker reaper)
WORKER_JOBS = PREFIX + ":worker:{worker}:jobs"
# ids of the RQ jobs a worker dequeued and has not yet started or skipped (a set, for the
# reaper: a job whose worker died in between goes back to intake, never lost)
WORKER_TAKING = PREFIX + ":worker:{worker}:taking"
# names of the models a worker serves (a set; written at registration, for live workers
# per model)
WORKER_MODELS = PREFIX + ":worker:{worker}:models"
# tenant -> the jobs of that tenant the worker holds (written while tenants are in play)
WORKER_TENANTS = PREFIX + ":worker:{worker}:tenants"

# the cluster's counters (jobs by outcome, tokens prefilled, the chunk-time histogram): one
# hash whose fields `jobs.stats` owns; never touched by a per-job script (another slot)
STATS = PREFIX + ":stats"

# session id -> name of the worker that keeps the session's slot (its KV cache, committed
# tokens and turn anchor); a session's next job is routed to that worker while it lives
SESSION_HOLDER = PREFIX + ":session:{session}:holder"
# the latest checkpoint of a session's slot (any worker restores it): the slot's bytes, then
# the record naming its model and checksum (written last)
SESSION_CHECKPOINT = PREFIX + ":session:{session}:ckpt:{part}"

# model name -> the root key (hex) of its prompts' prefix blocks, written by the workers that
# keep a prefix cache (`jobs.prefixes`); a hash
PREFIX_ROOTS = PREFIX + ":prefix-roots"
# worker name -> the bytes its prefix cache holds, written with each insert (``/metrics``)
PREFIX_BYTES = PREFIX + ":prefix-bytes"
# a prefix block's key (hex) -> the name of a worker that keeps the block; a few blocks of each
# kept prompt (`jobs.prefixes.route_blocks`), expiring (`jobs.prefixes.ROUTE_TTL_S`)
PREFIX_ROUTE = PREFIX + ":prefix:{key}"
# a prefix block's rows (msgpack, `model.prefix_state`) in the shared tier's store, written by
# the worker that kept it (``--prefix-store``); it expires (`worker.shared_prefixes`)
PREFIX_BLOCK = PREFIX + ":prefix-block:{key}"

# priorities that have an intake queue, per model (a set of ints)
PRIORITIES = PREFIX + ":priorities:{model}"
# the tenants' intake queues of a model, each as "{priority}:{tenant}" (a set)
TENANT_LEVELS = PREFIX + ":tenant-levels:{model}"
# tenant -> its weight in the fair share (a float > 0; unknown tenants weigh 1), edited by
# the operator (`prefillq worker --tenant-weights` writes it at start)
TENANT_WEIGHTS = PREFIX + ":tenant-weights"
# tenant -> the most jobs it may have waiting in one model's intake queues (a submit past
# it raises QueueFull for that tenant only); an operator edits it, no entry: no quota
TENANT_MAX_QUEUED = PREFIX + ":tenant-max-queued"
# tenant -> tokens its jobs prefilled (counted while tenants are in play; "": no tenant)
TENANT_TOKENS = PREFIX + ":tenant-tokens"
# tenant -> its virtual service: tokens prefilled over its weight, lifted when it comes
# back from idle (`worker.fair_share`; "" is the jobs submitted without a tenant)
TENANT_SERVICE = PREFIX + ":tenant-service"

# RQ queue names: one shared intake queue per model and priority (priority 0 has the plain
# name), and each worker's own queue (jobs routed to it).
INTAKE_QUEUE = "prefill:{model}"
PRIORITY_INTAKE_QUEUE = "prefill:{model}:p{priority}"
TENANT_INTAKE_QUEUE = "prefill:{model}:p{priority}:t:{tenant}"
OWN_QUEUE = "prefill:w:{worker}"


# One builder per key, as RQ names its keys: each call says which key it builds (a table).
def job(job_id: str) -> str:
    return JOB.format(job_id=job_id)


def cancel(job_id: str) -> str:
    return CANCEL.format(job_id=job_id)


def logits(job_id: str) -> str:
    return LOGITS.format(job_id=job_id)


def prompt_logprobs(job_id: str) -> str:
    return PROMPT_LOGPROBS.format(job_id=job_id)


def events(job_id: str) -> str:
    return EVENTS.format(job_id=job_id)


def checkpoint(job_id: str, seq: int, part: str) -> str:
    """Key of `part` (one of ``CHECKPOINT_PARTS``) of checkpoint `seq` of a job.

    Raises:
        ValueError: an unknown part or a `seq` < 1.
    """
    if part not in CHECKPOINT_PARTS or seq < 1:
        raise ValueError(f"no checkpoint part {part!r} of seq {seq}")
    return CHECKPOINT.format(job_id=job_id, seq=seq, part=part)


def parse_checkpoint(key: str) -> tuple[str, int, str]:
    """``(job_id, seq, part)`` of a `checkpoint` key.

    Raises:
        ValueError: `key` is not a checkpoint key.
    """
    head, sep, rest = key.partition(":{")
    job_id, sep2, tail = rest.partition("}:ckpt:")
    seq, _, part = tail.partition(":")
    if head != PREFIX or not (sep and sep2 and seq.isdigit()) or part not in CHECKPOINT_PARTS:
        raise ValueError(f"{key!r} is not a checkpoint key")
    if checkpoint(job_id, int(seq), part) != key:
        raise ValueError(f"{key!r} is not a checkpoint key")
    return job_id, int(seq), part


def idempotency(key: str) -> str:
    return IDEMPOTENCY.format(key=key)


def tokenizer(sha256: str) -> str:
    return TOKENIZER.format(sha256=sha256)


def worker_heartbeat(worker: str) -> str:
    return WORKER_HEARTBEAT.format(worker=worker)


def worker_jobs(worker: str) -> str:
    return WORKER_JOBS.format(worker=worker)


def worker_taking(worker: str) -> str:
    return WORKER_TAKING.format(worker=worker)


def worker_models(worker: str) -> str:
    return WORKER_MODELS.format(worker=worker)


def worker_tenants(worker: str) -> str:
    return WORKER_TENANTS.format(worker=worker)


def session_holder(session: str) -> str:
    return SESSION_HOLDER.format(session=session)


def prefix_block(key: bytes) -> str:
    """A prefix block's rows in the shared tier's store (`worker.shared_prefixes`)."""
    return PREFIX_BLOCK.format(key=key.hex())


def prefix_route(key: bytes) -> str:
    return PREFIX_ROUTE.format(key=key.hex())


def session_checkpoint(session: str, part: str) -> str:
    """Key of `part` (``blob`` or ``record``) of the checkpoint of `session`'s slot."""
    return SESSION_CHECKPOINT.format(session=session, part=part)


def priorities(model: str) -> str:
    return PRIORITIES.format(model=model)


def tenant_levels(model: str) -> str:
    return TENANT_LEVELS.format(model=model)


def intake_queue(model: str, priority: int = 0, tenant: str | None = None) -> str:
    """The intake queue of `model`'s jobs at `priority` of `tenant` (None: submitted
    without one, the plain queues)."""
    if tenant is not None:
        return TENANT_INTAKE_QUEUE.format(model=model, priority=priority, tenant=tenant)
    if priority == 0:
        return INTAKE_QUEUE.format(model=model)
    return PRIORITY_INTAKE_QUEUE.format(model=model, priority=priority)


def own_queue(worker: str) -> str:
    return OWN_QUEUE.format(worker=worker)
