"""``prefillq run``: prefill one prompt and print the top next tokens.

Without ``--redis`` it runs on an embedded queue (`worker.embedded`: fakeredis and an
in-process worker); with ``--redis`` it submits there and waits for a worker.
"""

from __future__ import annotations

import argparse
import sys
import threading

from jobs import PrefillClient
from jobs.cli import (
    SAMPLE_PROMPT,
    add_messages_flags,
    add_redis,
    finish,
    non_negative_float,
    positive_int,
    prompt_input,
)
from jobs.defaults import DEFAULT_MODEL

from .loading import load_models


def follow_progress(client: PrefillClient, job_id: str, timeout: float | None,
                    quiet: bool) -> None:
    """Follow the job on stderr (tokens done / total, tokens/s) until it is terminal; with
    no tqdm installed (the light client), just wait."""
    try:
        from tqdm import tqdm
    except ImportError:
        quiet = True
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


def cmd_run(args: argparse.Namespace) -> int:
    submit_kwargs = dict(
        **prompt_input(args, args.text),
        model=args.model.partition("=")[0],  # a job names its model; NAME=/path.gguf loads it
        top_k=args.top_k,
        chunk_tokens=args.chunk_tokens,
    )
    if args.redis:
        client = PrefillClient.from_url(args.redis)
        job_id = client.submit(**submit_kwargs)
        print(f"submitted {job_id}; waiting for a worker", file=sys.stderr)
        follow_progress(client, job_id, args.wait, args.quiet)
        return finish(client, job_id, args.json)

    from worker.embedded import embedded_queue
    from worker.settings import WorkerSettings

    settings = WorkerSettings(chunk_tokens=args.chunk_tokens, publish_tokenizers=False)
    queue = embedded_queue(load_models([args.model], None), settings=settings)
    client = queue.client()
    job_id = client.submit(**submit_kwargs)
    follow = threading.Thread(target=follow_progress,
                              args=(queue.client(), job_id, None, args.quiet), daemon=True)
    follow.start()
    queue.drain()
    follow.join(timeout=5)
    return finish(client, job_id, args.json)


def add_run(sub) -> None:
    """Add ``run`` to the subparsers `sub`."""
    run = sub.add_parser("run", help="prefill one prompt and print the top next tokens")
    run.add_argument("text", nargs="?", help=f"prompt text (default {SAMPLE_PROMPT!r})")
    run.add_argument("--prompt-file")
    add_messages_flags(run)
    run.add_argument("--model", default=DEFAULT_MODEL)
    run.add_argument("--top-k", type=int, default=10, help="tokens to print (default 10)")
    run.add_argument("--chunk-tokens", type=positive_int,
                     help="exact chunk size in tokens (default: 2,048, window-aligned)")
    run.add_argument("--json", action="store_true")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--wait", type=non_negative_float, default=None,
                     help="seconds to wait with --redis")
    add_redis(run)
    run.set_defaults(func=cmd_run)
