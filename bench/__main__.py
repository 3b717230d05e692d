"""python -m bench [--quick] [--json] [--plots DIR] [--out FILE] [--llama-python PY]
python -m bench --model smollm2-135m --ratios-only [--llama-python PY] [--out FILE]

Prefill benchmarks for prefillq on this machine's CPU: side-by-side ratios, a short job's
wait under a long prefill, memory and tokens/s curves. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

from .common import (
    REFERENCES,
    Recorder,
    bench_parser,
    git_commit,
    load_or_exit,
    log,
    refuse_existing,
)

QUICK_TOKENS = 4096
DEFAULT_MODEL = "gemma3-270m"
# Real models of the other families whose ratios over mlx-lm and llama.cpp the full suite
# records after the main model's (`family_ratios`).
FAMILY_MODELS = ("smollm2-135m",)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _context() -> dict:
    import mlx.core as mx

    from model.runtime.blas import blas_summary
    from model.runtime.streams import cpu_streams

    return {"date": datetime.date.today().isoformat(), "commit": git_commit(),
            "machine": f"{platform.machine()}, {_cpu_name()}, {os.cpu_count()} cores",
            "device": str(mx.default_device()), "mlx": mx.__version__,
            "blas": blas_summary(), "cpu_streams": cpu_streams()}


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("python -m bench", __doc__)
    p.add_argument("--quick", action="store_true",
                   help="5-6 minutes on 2 cores: a 4K-token prompt, no llama.cpp")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="registry name (default %(default)s; another real model, e.g. "
                   "smollm2-135m, with --ratios-only)")
    p.add_argument("--plots", type=Path, help="write PNG plots and results.json here")
    p.add_argument("--curves-only", action="store_true",
                   help="only the tokens/s curves (vs prompt length and vs chunk size)")
    p.add_argument("--curve-max", type=int, default=32_768,
                   help="longest prompt of the length curve (default %(default)s)")
    p.add_argument("--llama-python", type=Path,
                   help="the interpreter with llama-cpp-python (`make bench-llama` builds "
                   ".venv-llama); without it the full suite skips over_llama_cpp")
    p.add_argument("--ratios-only", action="store_true",
                   help="only the side-by-side ratios and, with --llama-python, over_llama_cpp, "
                   "for --model")
    p.add_argument("--chunk-curve-tokens", type=int, default=8192,
                   help="prompt length of the chunk-size curve (default %(default)s)")
    return p


def family_ratios(rec: Recorder, loaded, n: int, repeats: int, llama_python: Path | None
                  ) -> None:
    """`loaded`'s side-by-side ratios (`bench.ratios.side_by_side`: over one pass, over
    mlx-lm's own model of its family, the queue), the share of its time attention takes
    (`bench.prefill.attention_share`) and, given `llama_python`, over llama.cpp on the same
    GGUF and threads; every record names the model."""
    from . import llama_cpp, prefill, ratios

    ratios.side_by_side(rec, loaded, n, repeats)
    prefill.attention_share(rec, loaded, n // 2)
    if llama_python:
        llama_cpp.over_llama_cpp(rec, loaded, n, repeats, llama_python)
    else:
        log(f"over_llama_cpp skipped for {loaded.name}: no --llama-python")


def main(argv: list[str] | None = None) -> int:
    """The full suite also records `FAMILY_MODELS`' ratios; --ratios-only those of --model."""
    p = build_parser()
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    if args.model != DEFAULT_MODEL and not args.ratios_only:
        p.error(f"--model {args.model}: the suite's prompts are {DEFAULT_MODEL}'s token ids; "
                f"another model runs with --ratios-only ({', '.join(REFERENCES)})")
    if args.model not in REFERENCES:
        p.error(f"--model {args.model}: no llama.cpp reference prompt (one of "
                f"{', '.join(REFERENCES)})")

    from model.runtime.blas import ensure_blas

    ensure_blas()
    from . import checkpoint, llama_cpp, memory, prefill, queue, ratios, session

    t0 = time.perf_counter()
    loaded = load_or_exit(p, args.model)
    context = _context()
    rec = Recorder(args.json, context, args.out)
    log(f"bench: {json.dumps(context)}")
    rec("load_seconds", loaded.load_seconds, "s", model=loaded.name)

    n = QUICK_TOKENS
    repeats = 2 if args.quick else 3
    # warm up MLX and BLAS
    prefill.prefill_seconds(loaded, prefill.prompt_ids(256, args.model), None)
    if args.ratios_only:
        family_ratios(rec, loaded, n, repeats, args.llama_python)
    elif not args.curves_only:
        ratios.side_by_side(rec, loaded, n, repeats)
        queue.queue_overhead_per_chunk(rec)
        if not args.quick and args.llama_python:
            llama_cpp.over_llama_cpp(rec, loaded, n, repeats, args.llama_python)
        elif not args.quick:
            log("over_llama_cpp skipped: no --llama-python (run `make bench-llama`)")
        queue.short_wait_over_chunk_time(rec, loaded, n // 2 if args.quick else n)
        memory.rss_growth_over_plan(rec, args.model, n if args.quick else 16_384)
        session.session_turn_over_cold(rec, loaded)
        checkpoint.checkpoint_overhead(rec, loaded)
        checkpoint.resume_saving(rec, args.model)
    if not args.quick and not args.curves_only and not args.ratios_only:
        for name in FAMILY_MODELS:
            if name != args.model:
                family_ratios(rec, load_or_exit(p, name), n, repeats, args.llama_python)
    if (args.curves_only or not args.quick) and not args.ratios_only:
        lengths = [m for m in (1024, 2048, 4096, 8192, 16_384, 32_768) if m <= args.curve_max]
        prefill.curves(rec, loaded, lengths=lengths,
                       chunk_sizes=[128, 256, 512, 1024, 2048, 4096, 8192],
                       chunk_curve_n=args.chunk_curve_tokens)
    rec("bench_seconds", time.perf_counter() - t0, "s", quick=args.quick)
    if args.plots:
        from .plots import write_plots

        write_plots(rec.records, context, args.plots)
    for line in rec.bounds_report():
        log(f"bench: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
