"""Where a Gemma 3 GPU prefill's time goes, by taking parts away (bf16, random weights).

    python -m bench.gpu_ablate [--model gemma3-270m|gemma3-4b] [--tokens 8192 32768]
                               [--chunk 2048] [--variants ...] [--out FILE]

Each of `variants` runs the whole prefill with one part changed, alternating in one process.
"""

from __future__ import annotations

import datetime
import os
import time
from contextlib import ExitStack

import mlx.core as mx

from model.archs import gemma3
from model.chunk import finish_chunk, launch_chunk
from model.kernels import flash_attention as fa
from model.start import start_prefill

from .common import Recorder, bench_parser, interleaved, log, patched, refuse_existing
from .gpu import MODELS

REPEATS = 3


def _prefill(model, n: int, chunk: int, pipelined: bool = False) -> tuple[float, float]:
    """(wall seconds, host seconds building graphs) of one prefill of `n` random ids."""
    ids = mx.random.randint(0, model.args.vocab_size, (n,)).tolist()
    mx.synchronize()
    t0 = time.perf_counter()
    prefill = start_prefill(model, ids, vocab_size=model.args.vocab_size,
                            context_length=model.args.context_length, chunk_tokens=chunk,
                            kv_dtype=mx.bfloat16)
    cache, build = prefill.cache, 0.0
    pending = []
    for start, end in zip((0, *prefill.plan.boundaries[:-1]), prefill.plan.boundaries, strict=True):
        b0 = time.perf_counter()
        hidden, _ = launch_chunk(model, cache, ids[start:end])
        build += time.perf_counter() - b0
        if pipelined:
            cache.commit(end - start)  # position only; rows are written by the graph
            pending.append(hidden)
        else:
            finish_chunk(cache, hidden, end - start)
    if pending:
        mx.eval(pending, cache.arrays())
    mx.eval(model.logits(hidden))
    return time.perf_counter() - t0, build


def variants(model) -> dict:
    """The prefill variants, by name, each ``(n, chunk) -> run``, where ``run()`` returns the
    wall seconds of one prefill:

    - ``baseline``: the product's path (on CUDA, compiled layer graphs around the fused
      kernel: `model.archs._gemma3_graph`);
    - ``module_forward``: the module-by-module forward, still with the fused kernel;
    - ``unfused``: the module forward with MLX's attention instead of the kernel;
    - ``no_split``: the kernel without FlashDecoding's key splits (either path's plan);
    - ``split_min_4``: key splits down to 4 key blocks each (the rule before 32). Gemma's
      chunks never split on the sm_90a path, so on Hopper both equal the baseline;
    - ``no_attention``: the attention returns its queries (projections, norms, RoPE and the
      cache update stay), so the difference is what attention costs;
    - ``pipelined``: every chunk launched before waiting for the previous one (one wait at
      the end), which bounds what overlapping chunks could gain.

    `bench.gpu_profile` evaluates module by module, which breaks MLX's lazy graph; these run
    the whole prefill. `main` also records ``build_seconds``, the host time building the
    baseline's graphs. MLX reads its CUDA knobs once, so compare them across runs: the context
    line records every ``MLX_*`` variable set.
    """
    def run(n, chunk, **kw):
        return lambda: _prefill(model, n, chunk, **kw)[0]

    def under(patch, fn):
        def go():
            with patch():
                return fn()
        return go

    def no_attention():
        stack = ExitStack()
        stack.enter_context(patched(gemma3.Attention, "core", lambda self, q, *a: q))
        if model._graph is not None:
            stack.enter_context(patched(model._graph, "attend", lambda q, *a: q))
        return stack

    def no_split():   # either path's plan (mma.sync; sm_90a)
        stack = ExitStack()
        stack.enter_context(patched(fa, "TARGET_BLOCKS", 1))
        stack.enter_context(patched(fa, "SM90_SPLIT_BELOW_BLOCKS", 0))
        return stack

    module = lambda: patched(gemma3, "graph_applies", lambda m, c: False)  # noqa: E731
    return {
        "baseline": lambda n, c: run(n, c),
        "module_forward": lambda n, c: under(module, run(n, c)),
        "unfused": lambda n, c: under(
            lambda: patched(gemma3, "fused_attention_applies", lambda q, k: False),
            under(module, run(n, c))),
        "no_split": lambda n, c: under(no_split, run(n, c)),
        "split_min_4": lambda n, c: under(
            lambda: patched(fa, "MIN_KEY_BLOCKS_PER_SPLIT", 4), run(n, c)),
        "no_attention": lambda n, c: under(no_attention, run(n, c)),
        "pipelined": lambda n, c: run(n, c, pipelined=True),
    }


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.gpu_ablate", __doc__, json_lines=False)
    p.add_argument("--model", choices=["gemma3-270m", "gemma3-4b"], default="gemma3-270m",
                   help="the shapes (bench.gpu's MODELS; default %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32_768])
    p.add_argument("--chunk", type=int, nargs="+", default=[2048])
    p.add_argument("--variants", nargs="+", help="run only these (default: all)")
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    knobs = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    rec = Recorder(True, {"date": datetime.date.today().isoformat(),
                          "device": str(mx.default_device()), "mlx": mx.__version__,
                          "fused_attention": fa.available(), "mlx_env": knobs}, args.out)
    spec = MODELS[args.model]
    model = spec.build()
    table = variants(model)
    if args.variants:
        unknown = set(args.variants) - set(table)
        if unknown:
            p.error(f"unknown variants {sorted(unknown)}; known: {sorted(table)}")
        table = {name: make for name, make in table.items()
                 if name in args.variants or name == "baseline"}
    for n in args.tokens:
        for chunk in args.chunk:
            log(f"{spec.label}, {n} tokens in {chunk}-token chunks")
            fns = [make(n, chunk) for make in table.values()]
            for fn in fns:
                fn()  # compile and warm each variant once
            seconds = interleaved(*fns, repeats=REPEATS)
            base = seconds[0]
            for name, s in zip(table, seconds, strict=True):
                rec("gpu_ablation_tok_s", n / s, "tok/s", variant=name, model=spec.label,
                    n_tokens=n, chunk_tokens=chunk, seconds=round(s, 4),
                    over_baseline=round(base / s, 3))
            builds = [_prefill(model, n, chunk)[1] for _ in range(REPEATS)]
            rec("gpu_build_seconds", min(builds), "s", model=spec.label, n_tokens=n,
                chunk_tokens=chunk, share_of_baseline=round(min(builds) / base, 3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
