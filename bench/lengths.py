"""python -m bench.lengths [--model gemma3-tiny] [--lengths 20] [--json] [--out FILE]

What a prompt length seen for the first time costs in process, against one seen before:
served prompts have any length from 32 to 512 tokens, and a backend that builds or compiles
something per shape (cuDNN's attention graphs on a CUDA GPU) pays it once per new length.
Per-job milliseconds of ``Prefill.run`` for one length repeated, for `--lengths` lengths
never run before in this process, and for the same lengths again; and MLX's causal
``scaled_dot_product_attention`` alone at new and at seen shapes.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
import numpy as np

from .common import Recorder, bench_parser, load_or_exit, machine_context, refuse_existing

REPEATED = 300  # tokens of the repeated prompt: the mean of bench.serve's 32-512
WARMUP = 5
NEW_FROM = 33  # new lengths are NEW_FROM, NEW_FROM + 1, ...: none is REPEATED
HEADS, HEAD_DIM = 4, 16  # the attention-alone case by default: the tiny Gemma 3's heads
SHAPES = "gemma3-270m-shapes"


def _shapes():
    from .gpu_queue import random_gemma3

    return random_gemma3()


def ms_per_job(loaded, lengths: list[int], rng: np.random.Generator) -> float:
    """Mean milliseconds of ``start_prefill(ids).run()`` over prompts of `lengths` tokens
    (BOS 2 then random ids from 3 up to the vocabulary)."""
    t0 = time.perf_counter()
    for n in lengths:
        ids = [2, *rng.integers(3, loaded.vocab_size, size=n - 1).tolist()]
        loaded.start_prefill(ids).run()
    return (time.perf_counter() - t0) / len(lengths) * 1e3


def attention_ms(lengths: list[int], dtype: mx.Dtype, head_dim: int = HEAD_DIM) -> float:
    """Mean milliseconds of one causal ``mx.fast.scaled_dot_product_attention`` of `HEADS`
    query heads over one KV head of `head_dim` per length of `lengths`, inputs evaluated
    before the clock starts."""
    total = 0.0
    for n in lengths:
        q = mx.random.normal((1, HEADS, n, head_dim)).astype(dtype)
        kv = mx.random.normal((1, 1, n, head_dim)).astype(dtype)
        mx.eval(q, kv)
        t0 = time.perf_counter()
        mx.eval(mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.25, mask="causal"))
        total += time.perf_counter() - t0
    return total / len(lengths) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m bench.lengths", __doc__)
    parser.add_argument("--model", default="gemma3-tiny",
                        help=f"a registry name, or {SHAPES} (random bf16 weights, "
                             "bench.gpu_queue's) (default %(default)s)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[HEAD_DIM],
                        help="head dims of the attention-alone case (default %(default)s)")
    parser.add_argument("--lengths", type=int, default=20,
                        help="new prompt lengths, each run once (default %(default)s)")
    args = parser.parse_args(argv)
    refuse_existing(parser, args.out)
    loaded = load_or_exit(parser, args.model) if args.model != SHAPES else _shapes()
    rng = np.random.default_rng(0)
    new = list(range(NEW_FROM, NEW_FROM + args.lengths))
    ms_per_job(loaded, [REPEATED] * WARMUP, rng)
    repeated = ms_per_job(loaded, [REPEATED] * args.lengths, rng)
    first = ms_per_job(loaded, new, rng)
    again = ms_per_job(loaded, new, rng)
    context = {**machine_context("lengths"), "model": args.model,
               "device": str(mx.default_device()), "dtype": str(loaded.dtype),
               "repeated_tokens": REPEATED, "new_lengths": new}
    record = Recorder(args.json, context, args.out)
    record("prefill_ms_repeated_length", repeated, "ms/job", tokens=REPEATED)
    record("prefill_ms_new_length", first, "ms/job", how="each length's first prefill")
    record("prefill_ms_seen_length", again, "ms/job", how="the same lengths again")
    record("new_length_cost_ms", first - again, "ms/job")
    shapes = [n + 1000 for n in new]  # no prefill ran these; each head dim is a new shape
    for head_dim in args.head_dims:
        attention_ms([REPEATED], loaded.dtype, head_dim)
        first_ms = attention_ms(shapes, loaded.dtype, head_dim)
        seen_ms = attention_ms(shapes, loaded.dtype, head_dim)
        record("attention_ms_new_shape", first_ms, "ms", heads=HEADS, head_dim=head_dim,
               keys=f"{shapes[0]}-{shapes[-1]}")
        record("attention_ms_seen_shape", seen_ms, "ms", heads=HEADS, head_dim=head_dim)
    return 0


if __name__ == "__main__":
    sys.exit(main())
