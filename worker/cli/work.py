"""``prefillq worker``: serve prefill jobs from a Redis server until stopped."""

from __future__ import annotations

import argparse
import logging

from jobs.cli import add_redis, non_negative_int, positive_int
from jobs.defaults import (
    DEFAULT_HEARTBEAT_TTL_S,
    DEFAULT_LOGITS_TTL_S,
    DEFAULT_MAX_ACTIVE,
    DEFAULT_MAX_BATCH_JOBS,
    DEFAULT_MAX_CONTINUATION_TOKENS,
    DEFAULT_MAX_CONTINUATIONS,
    DEFAULT_MAX_PROMPT_BYTES,
    DEFAULT_MAX_PROMPT_LOGPROBS,
    DEFAULT_MODEL,
    DEFAULT_RESULT_TTL_S,
    DEFAULT_SESSION_SLOTS,
    MAX_TOP_K,
)
from jobs.limits import Limits

from ..checkpoints.policy import DEFAULT_CHECKPOINT_EVERY, CheckpointPolicy, check_store_url
from ..fair_share import parse_weights
from ..settings import WorkerSettings
from .loading import load_models

# the `WorkerSettings` fields that are ``prefillq worker`` flags of the same dest
CLI_SETTINGS = ("chunk_tokens", "max_active", "max_batch_jobs", "step_tokens", "kv_budget_bytes",
                "result_ttl_s", "logits_ttl_s", "heartbeat_ttl_s", "session_slots",
                "session_bytes", "checkpoint_store", "checkpoint_every", "checkpoint_max_bytes",
                "prefix_cache_bytes", "prefix_store", "tenant_weights", "tenant_max_resident")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.connection import worker_connection
    from worker.worker import PrefillWorker

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    models = load_models(args.model or [DEFAULT_MODEL], args.context)
    worker = PrefillWorker(models, worker_connection(args.redis), settings_of(args),
                           name=args.name)
    worker.work(burst=args.burst, logging_level="INFO")
    return 0


def settings_of(args: argparse.Namespace):
    """The `worker.settings.WorkerSettings` ``prefillq worker``'s flags ask for: each field
    from the flag of its name (``--result-ttl`` is ``result_ttl_s``; one left out without a
    default of its own, ``--step-tokens``, takes the settings' default), ``limits`` from
    `limits_of`; a worker run from the CLI publishes its tokenizers."""
    return WorkerSettings(**{name: getattr(args, name) for name in CLI_SETTINGS
                             if hasattr(args, name)}, limits=limits_of(args))


def limits_of(args: argparse.Namespace) -> Limits:
    """The worker's `Limits` from its flags (its token limit is ``--context``: the serving
    context)."""
    return Limits(max_prompt_bytes=args.max_prompt_bytes, max_top_k=args.max_top_k,
                  max_prompt_logprobs=args.max_prompt_logprobs,
                  max_continuations=args.max_continuations,
                  max_continuation_tokens=args.max_continuation_tokens)


def checkpoint_every(text: str) -> str:
    """argparse type for ``--checkpoint-every`` (checked before any model loads).

    Raises:
        argparse.ArgumentTypeError: not ``N``, ``Ns`` or ``none``.
    """
    try:
        CheckpointPolicy.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def checkpoint_store(text: str) -> str:
    """argparse type for ``--checkpoint-store`` (`check_store_url`)."""
    try:
        return check_store_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_worker(sub) -> None:
    """Add ``worker`` to the subparsers `sub`."""
    worker = sub.add_parser("worker", help="serve prefill jobs from Redis")
    add_redis(worker)
    worker.add_argument("--name")
    worker.add_argument("--model", action="append",
                        help="model to serve: a registry name or NAME=/path.gguf (repeatable; "
                             f"default {DEFAULT_MODEL})")
    worker.add_argument("--chunk-tokens", type=positive_int,
                        help="cap on chunk size in tokens (default: 2,048, window-aligned)")
    worker.add_argument("--max-active", type=positive_int, default=DEFAULT_MAX_ACTIVE,
                        help="jobs resident at once, advanced round-robin "
                             f"(default {DEFAULT_MAX_ACTIVE})")
    worker.add_argument("--max-batch-jobs", type=positive_int, default=DEFAULT_MAX_BATCH_JOBS,
                        help="resident jobs one step advances, a chunk each, in turn order "
                             "(default %(default)s)")
    worker.add_argument("--step-tokens", type=positive_int, default=argparse.SUPPRESS,
                        help="cap on the tokens of one step's chunks (a step always takes "
                             "its first job's chunk; default: 2,048 on a CPU, 8,192 on a "
                             "GPU)")
    worker.add_argument("--kv-budget-bytes", type=int,
                        help="admit no job whose KV cache would exceed this total")
    add_tenants(worker)
    add_kept_caches(worker)
    worker.add_argument("--context", type=positive_int,
                        help="cap the serving context (tokens): the most prompt tokens a job "
                             "may have")
    worker.add_argument("--max-prompt-bytes", type=positive_int, metavar="B",
                        default=DEFAULT_MAX_PROMPT_BYTES,
                        help="fail jobs with more UTF-8 bytes of prompt text, before "
                             "tokenizing (default: %(default)s)")
    worker.add_argument("--max-top-k", type=non_negative_int, metavar="K", default=MAX_TOP_K,
                        help="fail jobs asking for a larger top_k (default: %(default)s)")
    worker.add_argument("--max-prompt-logprobs", type=non_negative_int, metavar="K",
                        default=DEFAULT_MAX_PROMPT_LOGPROBS,
                        help="fail jobs asking for more prompt_logprobs (default: %(default)s)")
    worker.add_argument("--max-continuations", type=positive_int, metavar="N",
                        default=DEFAULT_MAX_CONTINUATIONS,
                        help="fail jobs with more continuations (default: %(default)s)")
    worker.add_argument("--max-continuation-tokens", type=positive_int, metavar="T",
                        default=DEFAULT_MAX_CONTINUATION_TOKENS,
                        help="fail jobs whose continuations have more tokens together "
                             "(default: %(default)s)")
    worker.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    worker.add_argument("--result-ttl", dest="result_ttl_s", type=int,
                        default=DEFAULT_RESULT_TTL_S,
                        help="seconds a terminal job's record lives (default: %(default)s)")
    worker.add_argument("--logits-ttl", dest="logits_ttl_s", type=int,
                        default=DEFAULT_LOGITS_TTL_S,
                        help="seconds full logits live (default: %(default)s)")
    worker.add_argument("--heartbeat-ttl", dest="heartbeat_ttl_s", type=positive_int,
                        default=DEFAULT_HEARTBEAT_TTL_S,
                        help="seconds without a heartbeat before a worker counts as dead "
                             "(default: %(default)s)")
    worker.set_defaults(func=cmd_worker)


def tenant_weights(text: str) -> dict[str, float]:
    """argparse type of ``--tenant-weights`` (`worker.fair_share.parse_weights`)."""
    try:
        return parse_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_tenants(worker) -> None:
    """Add the flags of the fair share between tenants (`worker.fair_share`)."""
    worker.add_argument("--tenant-weights", type=tenant_weights, default={},
                        metavar="NAME=W,...",
                        help="tenants' weights in the fair share of tokens prefilled (jobs "
                             "submitted with tenant=NAME); an unnamed tenant weighs 1, and "
                             "the Redis hash prefillq:tenant-weights overrides these")
    worker.add_argument("--tenant-max-resident", type=positive_int, metavar="M",
                        help="jobs of one tenant resident on this worker at most "
                             "(default: no quota)")


def add_kept_caches(worker) -> None:
    """Add the flags of what a worker keeps beside its resident jobs' caches: session slots,
    the prefix cache, KV checkpoints."""
    worker.add_argument("--session-slots", type=non_negative_int, default=DEFAULT_SESSION_SLOTS,
                        help="sessions whose KV cache is kept after their job, least recently "
                             "used evicted first; 0 keeps none (default: %(default)s)")
    worker.add_argument("--session-bytes", type=non_negative_int,
                        help="bound on the kept sessions' bytes (KV rows and turn anchors)")
    worker.add_argument("--prefix-cache-bytes", type=non_negative_int, default=0,
                        help="keep KV rows of finished prompts' 32-token blocks, within this "
                             "many bytes, for later jobs that share a prefix (no session "
                             "needed); 0 turns it off (default: %(default)s)")
    worker.add_argument("--prefix-store", metavar="URL", type=checkpoint_store,
                        help="with --prefix-cache-bytes, also write kept blocks to this store "
                             "(redis for this queue's Redis, redis://... or file:///dir) and "
                             "fetch other workers' blocks from it while a fetch is measured "
                             "cheaper than computing (default: off)")
    worker.add_argument("--checkpoint-store", metavar="URL", type=checkpoint_store,
                        help="where KV checkpoints go: redis://... or file:///shared/dir, "
                             "the same for every worker of a queue (default: this queue's "
                             "Redis)")
    worker.add_argument("--checkpoint-every", type=checkpoint_every,
                        default=DEFAULT_CHECKPOINT_EVERY, metavar="N|Ns|none",
                        help="checkpoint a resident job every N chunks or N seconds, or never "
                             "(default: %(default)s)")
    worker.add_argument("--checkpoint-max-bytes", type=positive_int, metavar="B",
                        help="do not checkpoint jobs whose KV cache is larger")
