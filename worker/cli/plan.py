"""``prefillq plan``: a model's KV cache plan from its config or GGUF metadata (no weights)."""

from __future__ import annotations

import argparse
import json

from jobs.cli import CLIError
from jobs.defaults import DEFAULT_MODEL

PLAN_FIELDS = ("n_layers", "context_length", "kv_dtype", "bytes_per_token", "fixed_bytes",
               "resident_bytes")
KV_DTYPES = ("bfloat16", "float16", "float32")


def cmd_plan(args: argparse.Namespace) -> int:
    """Print a model's cache plan, from its config or GGUF metadata (no weights loaded)."""
    import mlx.core as mx

    from model.registry import ModelNotFound, plan_for

    if args.context is not None and args.context < 1:
        raise CLIError(f"--context must be at least 1, got {args.context}")
    try:
        plan = plan_for(args.model, args.context, getattr(mx, args.kv_dtype))
    except ModelNotFound as e:
        raise CLIError(str(e.args[0])) from e
    record = {"model": args.model, **{k: getattr(plan, k) for k in PLAN_FIELDS}}
    record["kv_dtype"] = args.kv_dtype
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"{args.model}: {plan.n_layers} layers, context {plan.context_length} tokens, "
          f"{args.kv_dtype} KV rows")
    for line in plan.describe_layers():
        print(f"  {line}")
    print(f"bytes/token {plan.bytes_per_token}, fixed {plan.fixed_bytes:,} B, "
          f"resident {plan.resident_bytes:,} B ({plan.resident_bytes / 2**30:.3f} GiB)")
    return 0


def add_plan(sub) -> None:
    """Add ``plan`` to the subparsers `sub`."""
    plan = sub.add_parser("plan", help="print a model's KV cache plan (no weights needed)")
    plan.add_argument("--model", default=DEFAULT_MODEL,
                      help="registry name (deepseek4-flash: config only) or NAME=/path.gguf")
    plan.add_argument("--context", type=int, help="tokens to plan for (default: the model's)")
    plan.add_argument("--kv-dtype", choices=KV_DTYPES, default="bfloat16",
                      help="KV row dtype (default %(default)s; compressor state is float32)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)
