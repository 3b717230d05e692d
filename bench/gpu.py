"""Absolute prefill throughput on a GPU (bf16, random weights), model FLOPs utilisation,
and the same prefill in mlx-lm and HF transformers, measured in the same run.

    python -m bench.gpu [--quick] [--models A,B] [--no-peers] [--no-eager] [--no-micro]
                        [--sdpa-backends A,B] [--deepseek4-layers N] [--out FILE]
    python -m bench.gpu --check [--checks TEXT] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from model.archs import gemma3, llama
from model.gguf.synthetic.llama import Llama3Scaling, llama3_rope_factors
from model.kernels.flash_attention import ENV as FUSED_ENV
from model.kernels.flash_attention import available as fused_available
from model.kernels.flash_attention_sm90 import compute_capability
from model.start import start_prefill

from . import gpu_deepseek4, gpu_peers
from .common import Recorder, bench_parser, git_commit, log, refuse_existing
from .gpu_attention import MICRO, micro
from .gpu_peers import DEFAULT_BACKEND, SDPA_BACKENDS

# Timed prefills per case after the warm-up one; the fastest is kept (a GPU chunk is short
# enough that host-side jitter of a few ms moves single runs; docs/benchmarks.md).
REPEATS = 5

# The practical bf16 ceiling PyTorch reached on an H200 (torch.matmul, 8192^3, bf16),
# measured by the team before this benchmark existed; MLX's own is measured each run.
TORCH_BF16_CEILING_TFLOPS = 790.0
SDPA_CHOICES = (DEFAULT_BACKEND, *SDPA_BACKENDS)

GEMMA3_270M = gemma3.ModelArgs(
    hidden_size=640, num_hidden_layers=18, intermediate_size=2048, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, vocab_size=262_144, rms_norm_eps=1e-6,
    sliding_window=512, rope_theta=1_000_000.0, context_length=32_768,
)
GEMMA3_LABEL = "gemma3-270m shapes"
# (prompt tokens, chunk tokens); --quick keeps the first
GEMMA3_CASES = ((8192, 2048), (8192, 8192), (32_768, 2048), (32_768, 8192))
LLAMA_CASES = ((8192, 2048), (32_768, 2048))

# Meta-Llama-3-8B's config.json (and 3.1's rope_scaling), as llama.cpp converts it: the
# llama architecture rotates adjacent pairs, Llama 3's scaling becomes rope_freqs divisors.
# The context is the longest case's: it sizes the KV cache, not the RoPE.
LLAMA3_SCALING = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_context=8192)
LLAMA3_8B = llama.ModelArgs(
    architecture="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14_336,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128_256,
    rms_norm_eps=1e-5, rope_theta=500_000.0, context_length=32_768, rope_traditional=True,
    rope_freqs=True, tie_word_embeddings=False, sliding_layers=(False,) * 32)
# Qwen3-4B's config.json: q/k RMSNorm per head, halves rotated, the head tied.
QWEN3_4B = llama.ModelArgs(
    architecture="qwen3", hidden_size=2560, num_hidden_layers=36, intermediate_size=9728,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151_936,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, context_length=32_768, rope_traditional=False,
    qk_norm=True, tie_word_embeddings=True, sliding_layers=(False,) * 36)


@dataclass(frozen=True)
class GpuModel:
    """A model `python -m bench.gpu` measures (``--models NAME``): its shapes, its records'
    ``model`` label, its ``(n_tokens, chunk_tokens)`` cases, and Llama 3's RoPE scaling
    where it has it (prefillq gets it as ``rope_freqs`` divisors, the peers in HF's form)."""

    name: str
    label: str
    args: gemma3.ModelArgs | llama.ModelArgs
    cases: tuple[tuple[int, int], ...]
    scaling: Llama3Scaling | None = None

    @property
    def family(self) -> str:
        """``gemma3``, ``llama`` or ``qwen3``: which module every side builds."""
        return getattr(self.args, "architecture", "gemma3")

    def rope_scaling(self) -> dict | None:
        """`scaling` as HF's ``rope_scaling`` (type llama3), or None."""
        s = self.scaling
        return None if s is None else {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_context}

    def shapes(self) -> dict:
        """The shapes the peers' processes take (`bench.gpu_peers.shapes_of`)."""
        return gpu_peers.shapes_of(self.args, self.label, rope_scaling=self.rope_scaling())

    def build(self, dtype=mx.bfloat16, n_layers: int | None = None):
        """prefillq's model at these shapes (the first `n_layers` layers, default all),
        random weights in `dtype`, evaluated."""
        args = self.args
        if n_layers is not None:
            args = _first_layers(args, n_layers)
        if self.family == "gemma3":
            model = gemma3.Model(args)
        else:
            factors = (None if self.scaling is None else
                       llama3_rope_factors(args.rope_theta, args.head_dim, self.scaling))
            model = llama.Model(args, factors)
        model.set_dtype(dtype)
        mx.eval(model.parameters())
        return model


def _first_layers(args, n_layers: int):
    from dataclasses import replace

    if isinstance(args, llama.ModelArgs):
        return replace(args, num_hidden_layers=n_layers,
                       sliding_layers=args.sliding_layers[:n_layers])
    return replace(args, num_hidden_layers=n_layers)


# Gemma 3 4B's config.json (google/gemma-3-4b-pt): 34 layers, 8 query heads over 4 KV
# heads of 256, a 1,024-token window in five of every six layers, the global layers' RoPE
# scaled linearly by 1/8 (its rope_scaling; the peers get it too). The context is the
# longest case's: it sizes the KV cache.
GEMMA3_4B = gemma3.ModelArgs(
    hidden_size=2560, num_hidden_layers=34, intermediate_size=10_240, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, vocab_size=262_208, rms_norm_eps=1e-6,
    sliding_window=1024, rope_theta=1_000_000.0, context_length=32_768, rope_scale=0.125,
)

MODELS = {m.name: m for m in (
    GpuModel("gemma3-270m", GEMMA3_LABEL, GEMMA3_270M, GEMMA3_CASES),
    GpuModel("gemma3-4b", "gemma3-4b shapes", GEMMA3_4B, LLAMA_CASES),
    GpuModel("llama3-8b", "llama-3-8b shapes", LLAMA3_8B, LLAMA_CASES, LLAMA3_SCALING),
    GpuModel("qwen3-4b", "qwen3-4b shapes", QWEN3_4B, LLAMA_CASES),
)}


def matmul_tflops(n: int = 8192, repeats: int = 20) -> float:
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a, b)
    for _ in range(3):
        mx.eval(a @ b)
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12


def decoder_flops(args: gemma3.ModelArgs | llama.ModelArgs, n: int) -> float:
    """Useful FLOPs of a prefill of `n` tokens: 2 x linear params per token, plus QK and PV
    over the keys each query may see (the window in sliding layers), plus the head once.
    Norms, RoPE and biases (under 0.1%) are left out."""
    h, hd, nh, kv = args.hidden_size, args.head_dim, args.num_attention_heads, \
        args.num_key_value_heads
    linear = 2 * h * nh * hd + 2 * h * kv * hd + 3 * h * args.intermediate_size
    total = 2 * linear * args.num_hidden_layers * n
    for spec in args.layer_specs():
        window = spec.window
        if window:
            seen = sum(min(p + 1, window) for p in range(n))
        else:
            seen = n * (n + 1) // 2
        total += 2 * 2 * nh * hd * seen
    return total + 2 * h * args.vocab_size


def gemma3_model(dtype=mx.bfloat16) -> gemma3.Model:
    """prefillq's Gemma 3 at the 270M shapes, random weights in `dtype`."""
    return MODELS["gemma3-270m"].build(dtype)


def one_prefill_seconds(model, n: int, chunk: int | None) -> float:
    """Wall seconds of one whole bf16 prefill of `n` random token ids."""
    ids = mx.random.randint(0, model.args.vocab_size, (n,)).tolist()
    t0 = time.perf_counter()
    prefill = start_prefill(model, ids, vocab_size=model.args.vocab_size,
                            context_length=model.args.context_length, chunk_tokens=chunk,
                            kv_dtype=mx.bfloat16)
    prefill.run()
    return time.perf_counter() - t0


def prefill_seconds(model, n: int, chunk: int | None, repeats: int) -> float:
    """Fastest of `repeats` prefills, after one that compiles kernels and warms the
    allocator."""
    one_prefill_seconds(model, n, chunk)
    return min(one_prefill_seconds(model, n, chunk) for _ in range(repeats))


def deepseek4_flops(args, n: int) -> float:
    """Useful FLOPs of a DeepSeek-V4 prefill of `n` tokens, counted from the DeepSeek-V4
    reference ``inference/model.py`` (`Attention`, `Compressor`, `Indexer`, `MoE`): every
    projection once per token (routed experts: the `num_experts_per_tok` chosen), attention
    over the window plus the compressed rows a query may see (top-k of them on ratio-4
    layers), the indexer's scores over all visible ratio-4 rows, and the head once."""
    h, nh, hd, qr = args.hidden_size, args.num_attention_heads, args.head_dim, args.q_lora_rank
    hc = args.hc_mult
    mix = 2 * hc * h * (2 + hc) * hc  # both mHC sub-layers' mixes
    dense = (h * qr + qr * nh * hd + h * hd + args.o_groups * args.o_lora_rank * nh * hd
             // args.o_groups + h * args.o_groups * args.o_lora_rank)
    moe = h * args.n_routed_experts + 3 * h * args.moe_intermediate_size * (
        args.num_experts_per_tok + args.n_shared_experts)
    total = 0.0
    for ratio in args.compress_ratios[: args.num_hidden_layers]:
        linear = dense + moe
        seen = sum(min(p + 1, args.sliding_window) for p in range(n))
        index = 0
        if ratio:
            coff = 2 if ratio == 4 else 1
            linear += 2 * h * coff * hd
            rows = [(p + 1) // ratio for p in range(n)]
            if ratio == 4:
                linear += qr * args.index_n_heads * args.index_head_dim + h * args.index_n_heads
                linear += 2 * h * 2 * args.index_head_dim
                index = 2 * args.index_n_heads * args.index_head_dim * sum(rows)
                seen += sum(min(r, args.index_topk) for r in rows)
            else:
                seen += sum(rows)
        total += 2 * linear * n + mix * n + 2 * 2 * nh * hd * seen + index
    return total + 2 * hc * h * hc + 2 * h * args.vocab_size


def deepseek4_case(rec: Recorder, ceiling: float, n_layers: int, n: int, chunk: int) -> None:
    from model.archs import deepseek4

    args = deepseek4.flash_args()
    log(f"deepseek4-flash shapes, {n_layers} layers (random weights, bf16)")
    t0 = time.perf_counter()
    model = deepseek4.dummy_model(args, n_layers=n_layers, dtype=mx.bfloat16)
    build_s = time.perf_counter() - t0
    seconds = prefill_seconds(model, n, chunk, repeats=REPEATS)
    flops = deepseek4_flops(model.args, n)
    rec("gpu_prefill_tok_s", n / seconds, "tok/s", model="deepseek4-flash shapes",
        layers=n_layers, ratios=list(model.args.compress_ratios), dtype="bfloat16",
        n_tokens=n, chunk_tokens=chunk, build_s=round(build_s, 1),
        tflops=round(flops / seconds / 1e12, 2),
        mfu_vs_mlx_matmul=round(flops / seconds / 1e12 / ceiling, 4),
        mfu_vs_torch_790=round(flops / seconds / 1e12 / TORCH_BF16_CEILING_TFLOPS, 4))
    del model
    mx.clear_cache()  # four Flash layers hold ~52 GB: the next case builds its own


def model_cases(rec: Recorder, ceiling: float, spec: GpuModel, cases,
                peers: list[dict]) -> None:
    """prefillq at each ``(n_tokens, chunk_tokens)`` of `cases` at `spec`'s shapes, with
    its MFU against `ceiling` (TFLOP/s) and its ratios over the `peers`' records
    (`gpu_peers.ratios`)."""
    log(f"{spec.label}: building (random weights, bf16)")
    model = spec.build()
    for n, chunk in cases:
        log(f"{spec.label}, {n} tokens in {chunk}-token chunks")
        seconds = prefill_seconds(model, n, chunk, repeats=REPEATS)
        flops = decoder_flops(spec.args, n)
        rec("gpu_prefill_tok_s", n / seconds, "tok/s", impl="prefillq",
            model=spec.label, dtype="bfloat16", n_tokens=n, chunk_tokens=chunk,
            tflops=round(flops / seconds / 1e12, 2),
            mfu_vs_mlx_matmul=round(flops / seconds / 1e12 / ceiling, 4),
            mfu_vs_torch_790=round(flops / seconds / 1e12 / TORCH_BF16_CEILING_TFLOPS, 4),
            **gpu_peers.ratios(n / seconds, n, chunk, peers, model=spec.label,
                               family=spec.family))
    del model
    mx.clear_cache()


def _names(choices) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [t for t in text.split(",") if t]
        unknown = [t for t in names if t not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{','.join(unknown) or 'nothing'} is not among {', '.join(choices)}")
        return names
    return parse


def parser() -> argparse.ArgumentParser:
    p = bench_parser("python -m bench.gpu", __doc__, json_lines=False)
    p.add_argument("--quick", action="store_true",
                   help="one case per model (8,192 tokens in 2,048-token chunks)")
    p.add_argument("--check", action="store_true",
                   help="only the exactness checks (bench.gpu_check); exit 0 if all pass")
    p.add_argument("--no-peers", action="store_true",
                   help="skip mlx-lm and HF transformers (bench.gpu_peers)")
    p.add_argument("--no-eager", action="store_true",
                   help="skip HF transformers' eager attention among the peers")
    p.add_argument("--no-micro", action="store_true",
                   help="skip the attention micro-benchmarks (bench.gpu_attention.micro) "
                        "and torch SDPA's processes")
    p.add_argument("--models", type=_names(MODELS), default=["gemma3-270m"], metavar="A,B",
                   help=f"the dense models to measure, of {', '.join(MODELS)} "
                        "(default %(default)s)")
    p.add_argument("--sdpa-backends", type=_names(SDPA_CHOICES), default=list(SDPA_CHOICES),
                   metavar="A,B", help="the SDPA backends HF sdpa runs under, one process "
                   f"each, of {', '.join(SDPA_CHOICES)} (default all)")
    p.add_argument("--checks", metavar="TEXT",
                   help="with --check: only the checks whose name holds TEXT")
    p.add_argument("--deepseek4-layers", type=int, default=4, metavar="N",
                   help="layers of DeepSeek-V4-Flash to build (0: skip; default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    """One JSON line per measurement on stdout (and in FILE with --out, after a context line).

    The peers (`bench.gpu_peers`: mlx-lm's model of the family at each case with the same
    chunks; HF transformers in one pass, ``sdpa`` under each of --sdpa-backends,
    ``flex_attention``, ``eager``; torch SDPA alone unless --no-micro) run first, each in a
    fresh process, before this one uses the GPU. Then each case of --models (`MODELS`), the
    fastest of `REPEATS` after a warm-up, with its MFU (useful FLOPs: `decoder_flops`,
    `deepseek4_flops`, over a bf16 matmul ceiling measured in the run) and ratios over the
    peers; the attention micro-benchmarks; the DeepSeek-V4-Flash cases. --check runs only
    `bench.gpu_check.CHECKS` (a CUDA GPU needed) and exits 0 only if all pass.
    """
    p = parser()
    args = p.parse_args(argv)
    if args.check and not fused_available():
        why = (f"${FUSED_ENV}=0 turns the kernels off" if os.environ.get(FUSED_ENV) == "0"
               else f"MLX's default device is {mx.default_device()}; install mlx[cuda13] on "
                    "an NVIDIA GPU")
        p.exit(2, f"{p.prog}: error: --check needs the fused CUDA kernels: {why}\n")
    if mx.default_device() != mx.gpu:
        p.error(f"no GPU: MLX's default device is {mx.default_device()} (install mlx[cuda13] "
                "on NVIDIA, or run on Apple silicon)")
    refuse_existing(p, args.out)
    context = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
               "mlx_env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
               "device": str(mx.default_device()), "mlx": mx.__version__}
    rec = Recorder(True, context, args.out, tags={"pid": os.getpid(), "process": p.prog})
    log(f"device {mx.default_device()}, mlx {mx.__version__}")
    if args.check:
        from .gpu_check import CHECKS, run_checks  # it imports this module

        ok = run_checks(rec, [c for c in CHECKS if (args.checks or "") in c.__name__])
        log(f"gpu checks: {'all passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    specs = [MODELS[name] for name in args.models]
    cases = {s.name: s.cases[:1] if args.quick else s.cases for s in specs}
    micro_runs = not args.no_micro and fused_available()
    children = [] if args.no_peers else [
        child for s in specs for child in gpu_peers.plan(
            s.shapes(), cases[s.name], REPEATS, eager=not args.no_eager,
            backends=args.sdpa_backends)]
    peers = gpu_peers.run_all(
        rec, children + (gpu_peers.attention_plan(MICRO) if micro_runs else []))
    ceiling = matmul_tflops()
    rec("bf16_matmul", ceiling, "TFLOP/s", n=8192, device=str(mx.default_device()))
    for spec in specs:
        model_cases(rec, ceiling, spec, cases[spec.name], peers)
    if micro_runs:
        micro(rec, peers, hopper=compute_capability() == (9, 0))
        gpu_deepseek4.micro(rec)
        gpu_deepseek4.slots_sweep(rec)
        gpu_deepseek4.experts_micro(rec)
    elif not args.no_micro:
        log("the attention micro-benchmark needs the fused kernel (a CUDA GPU): skipped")
    if args.deepseek4_layers:
        for n, chunk in ((8192, 2048),) if args.quick else ((8192, 2048), (32_768, 2048)):
            deepseek4_case(rec, ceiling, args.deepseek4_layers, n, chunk)
        if not args.quick:
            gpu_deepseek4.ablate(rec, n_layers=args.deepseek4_layers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
