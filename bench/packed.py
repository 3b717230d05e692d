"""python -m bench.packed [--model gemma3-tiny] [--jobs 16] [--batch 4] [--json] [--out FILE]

Short prompts prefilled in process, packed several to a forward pass (`Prefill.launch_all`)
against one at a time, alternating: the compute side of ``--max-batch-jobs`` without the
queue (`bench.serve` measures the queue).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from model.planner import plan_chunks
from model.prefill import Prefill

from .common import (
    Recorder,
    bench_parser,
    interleaved,
    load_or_exit,
    machine_context,
    refuse_existing,
)


def prompts(jobs: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`jobs` prompts of 32-512 tokens (lm-eval-like lengths), BOS then random text ids."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(32, 513, size=jobs)
    return [[2, *rng.integers(260, min(vocab, 20_000), size=n - 1).tolist()] for n in lengths]


def run_steps(loaded, token_ids: list[list[int]], batch: int, chunk_tokens: int) -> float:
    """Seconds to prefill every prompt to its end, `batch` jobs a step in turn order (1: one
    job's chunk per step), as a worker's steps run them."""
    jobs = [loaded.start_prefill(ids, plan=plan_chunks(len(ids), loaded.sliding_window,
                                                       chunk_tokens=chunk_tokens))
            for ids in token_ids]
    t0 = time.perf_counter()
    live = list(jobs)
    while live:
        step = live[:batch]
        Prefill.launch_all(step)
        for p in step:
            p.step()
        live = [p for p in live[batch:] + step if not p.done]
    for p in jobs:
        p.logits()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m bench.packed", __doc__)
    parser.add_argument("--model", default="gemma3-tiny")
    parser.add_argument("--jobs", type=int, default=16, help="prompts (default %(default)s)")
    parser.add_argument("--batch", type=int, default=4,
                        help="jobs per packed step (default %(default)s)")
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="fastest of (default %(default)s)")
    args = parser.parse_args(argv)
    refuse_existing(parser, args.out)
    loaded = load_or_exit(parser, args.model)
    token_ids = prompts(args.jobs, loaded.vocab_size)
    tokens = sum(map(len, token_ids))
    run_steps(loaded, token_ids, args.batch, args.chunk_tokens)  # warm-up: graphs, BLAS
    one, packed = interleaved(
        lambda: run_steps(loaded, token_ids, 1, args.chunk_tokens),
        lambda: run_steps(loaded, token_ids, args.batch, args.chunk_tokens),
        repeats=args.repeats)
    context = {**machine_context("packed"), "model": args.model, "jobs": args.jobs,
               "tokens": tokens, "batch": args.batch, "chunk_tokens": args.chunk_tokens,
               "repeats": args.repeats}
    record = Recorder(args.json, context, args.out)
    record("one_job_steps_tok_per_s", tokens / one, "tok/s", seconds=round(one, 4))
    record("packed_steps_tok_per_s", tokens / packed, "tok/s", seconds=round(packed, 4))
    record("packed_over_one_job", one / packed, "x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
