"""``prefillq serve``: run the gateway under uvicorn."""

from __future__ import annotations

import argparse
import os

# The gateway's bearer token, when --api-key is not given.
API_KEY_ENV = "PREFILLQ_API_KEY"
DEFAULT_PORT = 8000


def add_serve(sub) -> None:
    """Add ``serve`` to the subparsers `sub` (importing nothing of the gateway extra, so the
    command line works on a light install and only ``serve`` needs it)."""
    from ..cli import add_redis, positive_int
    from ..defaults import DEFAULT_MAX_BODY_BYTES

    p = sub.add_parser("serve", help="serve the HTTP gateway (native jobs API, OpenAI-style "
                       "scoring, tokenizer, /health, /metrics)")
    add_redis(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 serves every interface)")
    p.add_argument("--port", type=tcp_port, default=DEFAULT_PORT,
                   help="TCP port (default %(default)s)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default ${API_KEY_ENV}; "
                   "off when unset)")
    p.add_argument("--tenant-key", action="append", type=tenant_key, default=[],
                   metavar="KEY=TENANT",
                   help="also accept 'Authorization: Bearer KEY', and make its requests' "
                   "jobs TENANT's (repeat for each tenant)")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help="refuse larger request bodies with 413 (default %(default)s)")
    p.add_argument("--score-with-bos", action="store_true",
                   help="/v1/completions scores token-id prompts that do not start with the "
                   "model's BOS as if it preceded them (for lm-eval's remote tokenizer, which "
                   "tokenizes without BOS); the echo still covers only the client's tokens")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def tenant_key(text: str) -> tuple[str, str]:
    """An argparse type: ``KEY=TENANT``, both non-empty."""
    key, sep, tenant = text.partition("=")
    if not (sep and key and tenant):
        raise argparse.ArgumentTypeError("want KEY=TENANT")
    return key, tenant


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    from ..cli import int_at_least

    port = int_at_least(1)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"want a TCP port (1-65535), got {text!r}")
    return port


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..aio import AsyncPrefillClient
    from .app import create_app

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    app = create_app(AsyncPrefillClient.from_url(args.redis), api_key=api_key or None,
                     max_body_bytes=args.max_body_bytes, score_with_bos=args.score_with_bos,
                     tenant_keys=dict(args.tenant_key))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
