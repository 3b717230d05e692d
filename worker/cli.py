"""The ``prefillq`` command line.

``run`` prefills one prompt, by default on an embedded queue (an in-process fakeredis
server) with an in-process worker; ``worker`` serves a real Redis; ``submit``, ``status``,
``cancel`` and ``result`` are the client API. With ``--json`` the last stdout line is one
JSON object. Errors exit non-zero with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path

from jobs import JobCanceled, JobFailed, PrefillClient, PrefillQError, PrefillResult
from jobs.client import redis_url
from jobs.defaults import (
    DEFAULT_HEARTBEAT_TTL_S,
    DEFAULT_LOGITS_TTL_S,
    DEFAULT_MODEL,
    DEFAULT_RESULT_TTL_S,
    DEFAULT_TOP_K,
    REDIS_URL_ENV,
)
from jobs.schema import JobStatus

SAMPLE_PROMPT = "The capital of France is"

log = logging.getLogger("prefillq")


class CLIError(Exception):
    """A usage or input error: printed as one line, exit status 2."""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (so a bad size fails before the model loads).

    Raises:
        argparse.ArgumentTypeError: `text` is not such an integer.
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"want an integer >= 1, got {text!r}")
    return value


def _device_summary() -> str:
    """``gpu`` or ``cpu, N streams`` (`model.runtime.streams.cpu_streams`)."""
    import mlx.core as mx

    from model.runtime.streams import cpu_streams

    if mx.default_device() == mx.gpu:
        return "gpu"
    return f"cpu, {cpu_streams()} streams"


def _load_models(specs: list[str], context_length: int | None) -> dict:
    from model.registry import UnknownModel, load_model
    from model.runtime.blas import blas_summary

    print(f"BLAS: {blas_summary()}", file=sys.stderr, flush=True)
    models = {}
    for spec in specs:
        print(f"loading {spec} ...", file=sys.stderr, flush=True)
        try:
            loaded = load_model(spec, context_length=context_length)
        except UnknownModel as e:
            raise CLIError(str(e.args[0])) from e
        print(
            f"loaded {loaded.name} ({loaded.architecture}, {loaded.dtype}, "
            f"context {loaded.context_length}) in {loaded.load_seconds:.1f} s "
            f"on {_device_summary()}",
            file=sys.stderr,
            flush=True,
        )
        models[loaded.name] = loaded
    return models


def _prompt(args: argparse.Namespace, positional: str | None = None) -> dict:
    """The submit input from TEXT / --prompt / --prompt-file / --tokens-file."""
    given = {
        "text": positional,
        "prompt": getattr(args, "prompt", None),
        "prompt_file": getattr(args, "prompt_file", None),
        "tokens_file": getattr(args, "tokens_file", None),
    }
    chosen = {k: v for k, v in given.items() if v is not None}
    if len(chosen) > 1:
        raise CLIError(f"give one prompt source, got {', '.join(chosen)}")
    if "tokens_file" in chosen:
        try:
            tokens = json.loads(Path(chosen["tokens_file"]).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CLIError(f"--tokens-file: {e}") from e
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise CLIError("--tokens-file must hold a JSON array of integers")
        return {"tokens": tokens}
    if "prompt_file" in chosen:
        try:
            return {"prompt": Path(chosen["prompt_file"]).read_text()}
        except OSError as e:
            raise CLIError(f"--prompt-file: {e}") from e
    text = chosen.get("text", chosen.get("prompt"))
    return {"prompt": SAMPLE_PROMPT if text is None else text}


def _progress(client: PrefillClient, job_id: str, timeout: float | None, quiet: bool) -> None:
    """Follow the job on stderr (tokens done / total, tokens/s) until it is terminal."""
    from tqdm import tqdm

    bar = None
    try:
        for status in client.watch(job_id, timeout):
            if quiet or status.n_tokens is None:
                continue
            if bar is None:
                bar = tqdm(total=status.n_tokens, unit="tok", desc="prefill", file=sys.stderr,
                           dynamic_ncols=True)
            bar.update(status.cursor - bar.n)
    finally:
        if bar is not None:
            bar.close()


def _result_record(status: JobStatus, result: PrefillResult | None) -> dict:
    record = status.to_dict()
    if result is not None:
        record.update(result.to_dict())
        record["chunks"] = result.chunks_done
    else:
        record["chunks"] = status.chunks_done
    return record


def _print_result(record: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(record))
        return
    chunks = record["chunks"]
    print(f"job {record['job_id']}: {record['state']}, {record['n_tokens']} tokens "
          f"in {chunks} chunk{'' if chunks == 1 else 's'}")
    timings = record.get("timings")
    if timings:
        print(f"prefill {timings['prefill_s']:.2f} s ({timings['tokens_per_s']:.0f} tok/s), "
              f"queue wait {timings['queue_wait_s']:.2f} s")
    for rank, t in enumerate(record.get("top_k", []), 1):
        print(f"{rank:>3}  {t['id']:>7}  logit {t['logit']:8.3f}  logprob {t['logprob']:8.3f}  "
              f"{t['piece']!r}")


def _finish(client: PrefillClient, job_id: str, as_json: bool) -> int:
    status = client.status(job_id)
    try:
        result = client.result(job_id, timeout=0)
    except (JobFailed, JobCanceled) as e:
        if as_json:
            _print_result(_result_record(status, None), True)
        print(f"prefillq: error: {e}", file=sys.stderr)
        return 1
    _print_result(_result_record(client.status(job_id), result), as_json)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    submit_kwargs = dict(
        **_prompt(args, args.text),
        model=args.model,
        top_k=args.top_k,
        chunk_tokens=args.chunk_tokens,
    )
    if args.redis:
        client = PrefillClient.from_url(args.redis)
        job_id = client.submit(**submit_kwargs)
        print(f"submitted {job_id}; waiting for a worker", file=sys.stderr)
        _progress(client, job_id, args.wait, args.quiet)
        return _finish(client, job_id, args.json)

    import fakeredis

    from .worker import PrefillWorker

    server = fakeredis.FakeServer()
    models = _load_models([args.model], None)
    worker = PrefillWorker(models, fakeredis.FakeStrictRedis(server=server),
                           chunk_tokens=args.chunk_tokens, name="embedded")
    worker.register_models()
    client = PrefillClient(fakeredis.FakeStrictRedis(server=server))
    job_id = client.submit(**submit_kwargs)
    watcher = PrefillClient(fakeredis.FakeStrictRedis(server=server))
    follow = threading.Thread(target=_progress, args=(watcher, job_id, None, args.quiet),
                              daemon=True)
    follow.start()
    worker.work(burst=True, logging_level="WARNING")
    follow.join(timeout=5)
    return _finish(client, job_id, args.json)


def worker_connection(url: str | None):
    """A Redis connection that rides out outages: every command is retried with capped
    exponential backoff instead of raising, so the worker survives a Redis restart."""
    from redis import Redis
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError, TimeoutError
    from redis.retry import Retry

    return Redis.from_url(
        redis_url(url),
        retry=Retry(ExponentialBackoff(cap=10.0, base=0.1), retries=-1),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=30,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    from model.runtime.blas import blas_summary

    from .worker import PrefillWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("BLAS: %s", blas_summary())
    models = _load_models(args.model or [DEFAULT_MODEL], args.context)
    worker = PrefillWorker(
        models,
        worker_connection(args.redis),
        name=args.name,
        chunk_tokens=args.chunk_tokens,
        max_active=args.max_active,
        kv_budget_bytes=args.kv_budget_bytes,
        result_ttl_s=args.result_ttl,
        logits_ttl_s=args.logits_ttl,
        heartbeat_ttl_s=args.heartbeat_ttl,
    )
    worker.work(burst=args.burst, logging_level="INFO")
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    from redis import Redis

    from jobs.reaper import reap

    reaped = reap(Redis.from_url(redis_url(args.redis)))
    for r in reaped:
        print(f"{r.job_id}: {r.outcome} (worker {r.worker})")
    print(f"reaped {len(reaped)} jobs")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    client = PrefillClient.from_url(args.redis)
    job_id = client.submit(
        **_prompt(args),
        model=args.model,
        top_k=args.top_k,
        logits=args.logits,
        session=args.session,
        priority=args.priority,
        chunk_tokens=args.chunk_tokens,
    )
    print(job_id)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = PrefillClient.from_url(args.redis).status(args.job)
    if args.json:
        print(json.dumps(status.to_dict()))
    else:
        total = status.n_tokens if status.n_tokens is not None else "?"
        print(f"{status.job_id}: {status.state.value} {status.cursor}/{total} tokens, "
              f"{status.chunks_done} chunks, attempt {status.attempts}"
              + (" (cancel requested)" if status.cancel_requested else ""))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    changed = PrefillClient.from_url(args.redis).cancel(args.job)
    print("cancel requested" if changed else
          "nothing to cancel: the job already ended, or a cancel is already pending")
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    client = PrefillClient.from_url(args.redis)
    for _ in client.watch(args.job, args.wait):
        pass
    return _finish(client, args.job, args.json)


PLAN_FIELDS = ("n_layers", "context_length", "kv_dtype", "bytes_per_token", "fixed_bytes",
               "resident_bytes")
KV_DTYPES = ("bfloat16", "float16", "float32")


def cmd_plan(args: argparse.Namespace) -> int:
    """Print a model's cache plan, from its config or GGUF metadata (no weights loaded)."""
    import mlx.core as mx

    from model.registry import UnknownModel, plan_for

    if args.context is not None and args.context < 1:
        raise CLIError(f"--context must be at least 1, got {args.context}")
    try:
        plan = plan_for(args.model, args.context, getattr(mx, args.kv_dtype))
    except UnknownModel as e:
        raise CLIError(str(e.args[0])) from e
    record = {"model": args.model, **{k: getattr(plan, k) for k in PLAN_FIELDS}}
    record["kv_dtype"] = args.kv_dtype
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"{args.model}: {plan.n_layers} layers, context {plan.context_length} tokens, "
          f"{args.kv_dtype} KV rows")
    for i, layer in enumerate(plan.layers):
        buffers = getattr(layer, "buffers", None)
        detail = (", ".join(f"{b.kind} {list(b.shape)}" for b in buffers) if buffers
                  else f"{layer.kind} {layer.rows} rows x {layer.row_bytes} B")
        ratio = getattr(layer, "compress_ratio", None)
        label = f"layer {i:>2}" + (f" (ratio {ratio})" if ratio is not None else "")
        print(f"  {label}: {detail}")
    print(f"bytes/token {plan.bytes_per_token}, fixed {plan.fixed_bytes:,} B, "
          f"resident {plan.resident_bytes:,} B ({plan.resident_bytes / 2**30:.3f} GiB)")
    return 0


def _add_redis(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--redis", required=required, default=None,
                   help=f"Redis URL (default ${REDIS_URL_ENV} or redis://localhost:6379/0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefillq", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="prefill one prompt and print the top next tokens")
    run.add_argument("text", nargs="?", help=f"prompt text (default {SAMPLE_PROMPT!r})")
    run.add_argument("--prompt-file")
    run.add_argument("--model", default=DEFAULT_MODEL)
    run.add_argument("--top-k", type=int, default=10, help="tokens to print (default 10)")
    run.add_argument("--chunk-tokens", type=positive_int,
                     help="exact chunk size in tokens (default: 2,048, window-aligned)")
    run.add_argument("--json", action="store_true")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--wait", type=float, default=None, help="seconds to wait with --redis")
    _add_redis(run)
    run.set_defaults(func=cmd_run)

    worker = sub.add_parser("worker", help="serve prefill jobs from Redis")
    _add_redis(worker)
    worker.add_argument("--name")
    worker.add_argument("--model", action="append",
                        help="model to serve: a registry name or NAME=/path.gguf (repeatable)")
    worker.add_argument("--chunk-tokens", type=positive_int,
                        help="cap on chunk size in tokens (default: 2,048, window-aligned)")
    worker.add_argument("--max-active", type=int, default=4,
                        help="jobs resident at once, advanced round-robin (default 4)")
    worker.add_argument("--kv-budget-bytes", type=int,
                        help="admit no job whose KV cache would exceed this total")
    worker.add_argument("--context", type=int, help="cap the serving context (tokens)")
    worker.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    worker.add_argument("--result-ttl", type=int, default=DEFAULT_RESULT_TTL_S,
                        help="seconds a terminal job's record lives (default: %(default)s)")
    worker.add_argument("--logits-ttl", type=int, default=DEFAULT_LOGITS_TTL_S,
                        help="seconds full logits live (default: %(default)s)")
    worker.add_argument("--heartbeat-ttl", type=int, default=DEFAULT_HEARTBEAT_TTL_S,
                        help="seconds without a heartbeat before a worker counts as dead "
                             "(default: %(default)s)")
    worker.set_defaults(func=cmd_worker)

    submit = sub.add_parser("submit", help="enqueue a prompt; prints the job id")
    _add_redis(submit)
    src = submit.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    src.add_argument("--tokens-file", help="JSON array of token ids")
    submit.add_argument("--model", default=DEFAULT_MODEL)
    submit.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                        help=f"top next tokens to keep (default {DEFAULT_TOP_K})")
    submit.add_argument("--logits", choices=["none", "top_k", "full"], default="top_k")
    submit.add_argument("--session", help="session id (stored; prefix reuse comes later)")
    submit.add_argument("--priority", type=int, default=0,
                        help="higher is admitted first (default 0)")
    submit.add_argument("--chunk-tokens", type=positive_int, help="per-job cap on chunk size")
    submit.set_defaults(func=cmd_submit)

    plan = sub.add_parser("plan", help="print a model's KV cache plan (no weights needed)")
    plan.add_argument("--model", default=DEFAULT_MODEL,
                      help="registry name (deepseek4-flash: config only) or NAME=/path.gguf")
    plan.add_argument("--context", type=int, help="tokens to plan for (default: the model's)")
    plan.add_argument("--kv-dtype", choices=KV_DTYPES, default="bfloat16",
                      help="KV row dtype (default %(default)s; compressor state is float32)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)

    reaper = sub.add_parser("reap", help="one pass of the dead-worker reaper")
    _add_redis(reaper)
    reaper.set_defaults(func=cmd_reap)

    for name, func, text in (("status", cmd_status, "print a job's status"),
                             ("cancel", cmd_cancel, "cancel a job (idempotent)"),
                             ("result", cmd_result, "wait for and print a job's result")):
        p = sub.add_parser(name, help=text)
        _add_redis(p)
        p.add_argument("job")
        if name in ("status", "result"):
            p.add_argument("--json", action="store_true")
        if name == "result":
            p.add_argument("--wait", type=float, default=0.0, help="seconds to wait (default 0)")
        p.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runs_mlx = args.command == "worker" or (args.command == "run" and not args.redis)
    if argv is None and runs_mlx:
        from model.runtime.blas import ensure_blas

        ensure_blas()  # may re-exec this command with an optimized BLAS preloaded
    from redis.exceptions import ConnectionError as RedisConnectionError

    try:
        return args.func(args)
    except RedisConnectionError as e:
        print(f"prefillq: error: cannot reach Redis: {e}", file=sys.stderr)
        return 2
    except (CLIError, PrefillQError, ValueError, OSError) as e:
        print(f"prefillq: error: {e}", file=sys.stderr)
        return 2
