"""Where a GPU prefill's time goes, module by module (DeepSeek-V4 and Gemma 3 shapes).

    python -m bench.gpu_profile [--layers 4] [--tokens 8192 32768] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import mlx.core as mx

from .common import Recorder, log, patched
from .gpu import gemma3_model, one_prefill_seconds, prefill_seconds

EXPERT_PATHS = {"padded": "padded batched matmuls (host sync)", "gathered": "gather_mm",
                "grouped": "host-grouped matmuls (host sync)"}


def _outputs(value) -> list[mx.array]:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _outputs(item)]
    return []


@contextmanager
def module_timer(targets: dict[str, tuple[type, str]]):
    """Wrap ``cls.method`` for every ``name: (cls, method)``; yields ``{name: [s, calls]}``.

    Each wrapped ``__call__`` `mx.eval`s its output and adds the wall time to its total, so the
    lazily built graph runs module by module (a little slower than the unprofiled prefill,
    which `main`'s last row gives for comparison). Times are inclusive: the attention's
    includes its compressor and indexer.
    """
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    originals = []
    for name, (cls, method) in targets.items():
        original = getattr(cls, method)
        originals.append((cls, method, original))

        def timed_call(self, *args, _name=name, _original=original, **kwargs):
            t0 = time.perf_counter()
            out = _original(self, *args, **kwargs)
            mx.eval(_outputs(out))
            totals[_name][0] += time.perf_counter() - t0
            totals[_name][1] += 1
            return out

        setattr(cls, method, timed_call)
    try:
        yield totals
    finally:
        for cls, method, original in originals:
            setattr(cls, method, original)


def profile_case(rec: Recorder, label: str, model, targets, n: int, chunk: int) -> None:
    plain = prefill_seconds(model, n, chunk, repeats=1)
    with module_timer(targets) as totals:
        profiled = one_prefill_seconds(model, n, chunk)
    for name, (seconds, calls) in totals.items():
        rec("gpu_module_seconds", seconds, "s", model=label, module=name, calls=calls,
            share_of_profiled=round(seconds / profiled, 4), n_tokens=n, chunk_tokens=chunk)
    rec("gpu_prefill_seconds", plain, "s", model=label, profiled_s=round(profiled, 4),
        n_tokens=n, chunk_tokens=chunk)


def main(argv: list[str] | None = None) -> int:
    """One JSON line per module and case, plus the DeepSeek-V4 prefill timed with each
    routed-experts path (`MoE._padded`, `MoE._gathered`, `MoE._grouped`).
    """
    p = argparse.ArgumentParser(prog="python -m bench.gpu_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4,
                   help="DeepSeek-V4-Flash layers to build (default %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32_768],
                   help="prompt lengths (default %(default)s)")
    p.add_argument("--chunk", type=int, default=2048,
                   help="chunk size in tokens (default %(default)s)")
    p.add_argument("--no-gemma", action="store_true",
                   help="skip Gemma 3 (on CUDA its layers run as compiled graphs, which "
                        "module timers do not see: bench.gpu_ablate measures it)")
    args = p.parse_args(argv)
    rec = Recorder(True, {"device": str(mx.default_device()), "mlx": mx.__version__})
    from model.archs import deepseek4, gemma3

    gemma = None if args.no_gemma else gemma3_model()
    for n in args.tokens if gemma is not None else ():
        log(f"gemma3-270m shapes, {n} tokens")
        profile_case(rec, "gemma3-270m shapes", gemma, {
            "attention": (gemma3.Attention, "__call__"), "mlp": (gemma3.MLP, "__call__"),
        }, n, args.chunk)
    del gemma
    mx.clear_cache()

    ds = deepseek4.dummy_model(deepseek4.flash_args(), n_layers=args.layers, dtype=mx.bfloat16)
    targets = {
        "block": (deepseek4.Block, "__call__"),
        "attention": (deepseek4.Attention, "__call__"),
        "attention_core": (deepseek4.Attention, "_attend"),
        "attention_listed": (deepseek4.Attention, "_attend_listed"),
        "keys": (deepseek4.Attention, "_keys"),
        "compressor": (deepseek4.Compressor, "__call__"),
        "indexer_select": (deepseek4.Indexer, "select"),
        "moe": (deepseek4.MoE, "__call__"),
    }
    label = f"deepseek4-flash shapes, {args.layers} layers"
    for n in args.tokens:
        log(f"{label}, {n} tokens")
        profile_case(rec, label, ds, targets, n, args.chunk)
    # the routed experts each way, at the first case's length
    n = args.tokens[0]
    for path in ("padded", "gathered", "grouped"):
        log(f"{label}, {n} tokens, experts {path}")
        with patched(deepseek4.moe, "expert_path", lambda p=path: p):
            seconds = prefill_seconds(ds, n, args.chunk, repeats=2)
        rec("gpu_prefill_tok_s", n / seconds, "tok/s", model=label, n_tokens=n,
            chunk_tokens=args.chunk, experts=EXPERT_PATHS[path])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
