"""Absolute prefill throughput on a GPU (bf16, random weights), model FLOPs utilisation,
and the same prefill in mlx-lm and HF transformers, measured in the same run.

    python -m bench.gpu [--quick] [--no-peers] [--no-eager] [--no-micro]
                        [--deepseek4-layers N] [--out FILE]
    python -m bench.gpu --check [--out FILE]

One JSON line per measurement on stdout (and in FILE with --out, after a context line).
Cases: Gemma 3 270M shapes at 8,192 and 32,768 tokens in 2,048- and 8,192-token chunks,
then DeepSeek-V4-Flash layers at 8,192 and 32,768 tokens in 2,048-token chunks; --quick
keeps the first of each. Each case is the fastest of 5 prefills after a warm-up one.

Peers (`bench.gpu_peers`; --no-peers skips them, and one not importable records a
``peer_skipped`` line), each in a fresh process of its own, run first, before this process
uses the GPU: mlx-lm's ``gemma3_text`` at each Gemma case with the same chunks (under MLX's
own CUDA graph knobs; prefillq's are set on importing `model`), HF transformers'
``Gemma3ForCausalLM`` in one pass over each prompt length without a KV cache (``sdpa``
under each SDPA backend, ``flex_attention``, ``eager``), all final-position logits only;
and, unless --no-micro, torch SDPA alone at `bench.gpu_attention.MICRO` under each
backend. prefillq's records carry ``over_mlx_lm`` (same prompt and chunk),
``over_hf_flex`` and ``over_hf_sdpa`` (HF sdpa's best backend; same prompt). Then the
attention micro-benchmarks (`bench.gpu_attention.micro`: the fused kernel and MLX SDPA,
each with ``over_torch_sdpa``, its ratio over torch SDPA's best backend;
`bench.gpu_deepseek4.micro`: a ratio-4 layer's chunk three ways), then the DeepSeek-V4
cases. Every line names the process it came
from (``pid``, ``process``) and, for a peer, its ``backend``.

--check runs only the exactness checks (`bench.gpu_check.CHECKS`: the Gemma kernel against
the unfused path at 13 shapes and 4 and 8 warps, chunked prefill against one pass, the
DeepSeek-V4 kernel against `gathered_attention` at 5 shapes, and each DeepSeek-V4 attention
layer kind against its masked dense form chunk by chunk) and exits 0 only if all pass; it
needs a CUDA GPU.

Throughput does not depend on weight values (routing aside), so the models are built at the
real shapes with random weights instead of loading a GGUF. MFU counts useful FLOPs only
(causal, windowed attention as the model defines it, not what a kernel computes under a
mask) against a bf16 matmul ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import mlx.core as mx

from model.archs import gemma3
from model.kernels.flash_attention import ENV as FUSED_ENV
from model.kernels.flash_attention import available as fused_available
from model.prefill import start_prefill

from . import gpu_deepseek4, gpu_peers
from .common import Recorder, git_commit, log, refuse_existing
from .gpu_attention import MICRO, micro

# Timed prefills per case after the warm-up one; the fastest is kept (a 2,048-token Gemma
# chunk takes ~15 ms, so host-side jitter of a few ms moves single runs by 20-30%).
REPEATS = 5

# The practical bf16 ceiling PyTorch reached on an H200 (torch.matmul, 8192^3, bf16),
# measured by the team before this benchmark existed; MLX's own is measured each run.
TORCH_BF16_CEILING_TFLOPS = 790.0

GEMMA3_270M = gemma3.ModelArgs(
    hidden_size=640, num_hidden_layers=18, intermediate_size=2048, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, vocab_size=262_144, rms_norm_eps=1e-6,
    sliding_window=512, rope_theta=1_000_000.0, context_length=32_768,
)
GEMMA3_LABEL = "gemma3-270m shapes"
# (prompt tokens, chunk tokens); --quick keeps the first
GEMMA3_CASES = ((8192, 2048), (8192, 8192), (32_768, 2048), (32_768, 8192))


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


def gemma3_flops(args: gemma3.ModelArgs, n: int) -> float:
    """Useful FLOPs of a prefill of `n` tokens: 2 x linear params per token, plus QK and PV
    over the keys each query may see (the window in sliding layers), plus the head once."""
    h, hd, nh, kv = args.hidden_size, args.head_dim, args.num_attention_heads, \
        args.num_key_value_heads
    linear = 2 * h * nh * hd + 2 * h * kv * hd + 3 * h * args.intermediate_size
    total = 2 * linear * args.num_hidden_layers * n
    for layer in range(args.num_hidden_layers):
        if args.is_sliding(layer):
            seen = sum(min(p + 1, args.sliding_window) for p in range(n))
        else:
            seen = n * (n + 1) // 2
        total += 2 * 2 * nh * hd * seen
    return total + 2 * h * args.vocab_size


def gemma3_model(dtype=mx.bfloat16) -> gemma3.Model:
    model = gemma3.Model(GEMMA3_270M)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


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


def gemma3_cases(rec: Recorder, ceiling: float, cases, peers: list[dict]) -> None:
    """prefillq at each ``(n_tokens, chunk_tokens)`` of `cases`, with its MFU against
    `ceiling` (TFLOP/s) and its ratios over the `peers`' records (`gpu_peers.ratios`)."""
    model = gemma3_model()
    for n, chunk in cases:
        log(f"gemma3-270m shapes, {n} tokens in {chunk}-token chunks")
        seconds = prefill_seconds(model, n, chunk, repeats=REPEATS)
        flops = gemma3_flops(GEMMA3_270M, n)
        rec("gpu_prefill_tok_s", n / seconds, "tok/s", impl="prefillq",
            model=GEMMA3_LABEL, dtype="bfloat16", n_tokens=n, chunk_tokens=chunk,
            tflops=round(flops / seconds / 1e12, 2),
            mfu_vs_mlx_matmul=round(flops / seconds / 1e12 / ceiling, 4),
            mfu_vs_torch_790=round(flops / seconds / 1e12 / TORCH_BF16_CEILING_TFLOPS, 4),
            **gpu_peers.ratios(n / seconds, n, chunk, peers))
    del model
    mx.clear_cache()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--deepseek4-layers", type=int, default=4, metavar="N",
                   help="layers of DeepSeek-V4-Flash to build (0: skip; default %(default)s)")
    p.add_argument("--out", type=Path, metavar="FILE",
                   help="also write the context and every record here")
    return p


def main(argv: list[str] | None = None) -> int:
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
        from .gpu_check import run_checks  # it imports this module

        ok = run_checks(rec)
        log(f"gpu checks: {'all passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    cases = GEMMA3_CASES[:1] if args.quick else GEMMA3_CASES
    micro_runs = not args.no_micro and fused_available()
    children = [] if args.no_peers else gpu_peers.plan(
        gpu_peers.shapes_of(GEMMA3_270M, GEMMA3_LABEL), cases, REPEATS, eager=not args.no_eager)
    peers = gpu_peers.run_all(
        rec, children + (gpu_peers.attention_plan(MICRO) if micro_runs else []))
    ceiling = matmul_tflops()
    rec("bf16_matmul", ceiling, "TFLOP/s", n=8192, device=str(mx.default_device()))
    gemma3_cases(rec, ceiling, cases, peers)
    if micro_runs:
        micro(rec, peers)
        gpu_deepseek4.micro(rec)
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
