"""Defaults and limits shared by the client, the worker and the reaper, each defined once."""

from __future__ import annotations

REDIS_URL_ENV = "PREFILLQ_REDIS_URL"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"

DEFAULT_MODEL = "gemma3-270m"
DEFAULT_TOP_K = 20
# top-k beyond this is a full-logits request in disguise: ask for logits="full" instead.
MAX_TOP_K = 1000
DEFAULT_MAX_ATTEMPTS = 3
# More restarts than this are a loop, not a recovery.
MAX_ATTEMPTS = 100
# Priorities are levels, each its own intake queue that every worker polls: a thousand each
# way is more levels than any scheduler needs, and keeps a client from minting queues.
MAX_PRIORITY = 1000
# Model names, session ids and idempotency keys become parts of Redis keys.
MAX_NAME_BYTES = 1024
# Prompt text per job: the largest serving context, DeepSeek-V4-Flash's 1M tokens, is ~4 MiB
# of typical text (~4 bytes/token), so twice that refuses only mistakes and abuse at submit,
# before a worker spends seconds tokenizing it (docs/client.md).
DEFAULT_MAX_PROMPT_BYTES = 8 * 1024 * 1024
# Per-position top-K of prompt_logprobs costs 8 bytes per prompt token per K in Redis
# (32K tokens at K=20: 5 MiB); vLLM's max_logprobs defaults to 20 too.
DEFAULT_MAX_PROMPT_LOGPROBS = 20
# Continuations of one context (`submit(continuations=...)`): lm-eval's multiple-choice tasks
# have 2-10 choices and a classifier a few labels; 256 is room for a label set. Their tokens
# together, scored in the step the context finishes: 8,192 is 4 chunks of the default size.
DEFAULT_MAX_CONTINUATIONS = 256
DEFAULT_MAX_CONTINUATION_TOKENS = 8192
# `submit` raises QueueFull past this many queued jobs per model (all priorities).
DEFAULT_MAX_QUEUE_DEPTH = 10_000

# Once terminal, a job's record (status + top-k result) lives this long; full logits less.
DEFAULT_RESULT_TTL_S = 24 * 3600
DEFAULT_LOGITS_TTL_S = 3600
# Jobs a worker keeps resident (KV caches in memory), advanced round-robin.
DEFAULT_MAX_ACTIVE = 8
# Resident jobs one step advances at most, a chunk each (1: one job's chunk per step), in one
# packed forward pass where the model packs; a step's tokens are bounded by device too
# (`worker.settings.default_step_tokens`).
DEFAULT_MAX_BATCH_JOBS = 8
# A worker counts as dead this long after its last heartbeat.
DEFAULT_HEARTBEAT_TTL_S = 30
# Error messages are capped so a pathological input cannot bloat Redis.
MAX_ERROR_CHARS = 2000
# Sessions: slots a worker keeps after their jobs finish (LRU), and how long the record of
# which worker keeps a session's slot outlives its last job.
DEFAULT_SESSION_SLOTS = 4
DEFAULT_SESSION_TTL_S = 24 * 3600
# The gateway's largest request body: a 128K-token prompt is ~0.5 MB of text or ~1 MB of
# JSON token ids, so 16 MiB leaves room with margin and refuses what only a mistake or an
# attack sends.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
