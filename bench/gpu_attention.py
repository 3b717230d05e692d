"""python -m bench.gpu_attention [--check] [--out FILE]

The fused CUDA attention kernel (`model.kernels.flash_attention`) on the device:

- ``--check``: the kernel against the unfused MLX path (`model.archs.gemma3.blocked_attention`
  in float32 on the same bf16 inputs) at every supported shape: whole-prompt and
  chunk-at-an-offset causal attention, sliding windows, GQA groups of 1 and 4, lengths that
  are not block multiples; max |difference| over max |reference| within `BF16_TOLERANCE`.
- the micro-benchmark: one global layer's causal attention (4 query heads of 256, 1 KV head)
  at 8K and 32K queries, ours against MLX SDPA and torch SDPA (flash), fastest of 5 after
  a warm-up, as TFLOP/s of the causal work (2 * 2 * L^2 / 2 * D * heads).
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import mlx.core as mx

from model.archs.gemma3 import blocked_attention
from model.kernels.flash_attention import available, flash_attention, grid_plan

from .common import Recorder, git_commit, log, refuse_existing

# bf16 keeps 8 significant bits (relative step 2^-8 ~ 3.9e-3); P is rounded to bf16 before
# P V, as in FlashAttention-2, and the output once more.
BF16_TOLERANCE = 2e-2

CHECKS = [  # (H, KVH, L, position, window)
    (4, 1, 1000, 0, None), (4, 1, 2048, 0, None), (4, 1, 2048, 6144, None),
    (4, 1, 777, 3001, None), (4, 4, 513, 100, None), (4, 1, 2048, 0, 512),
    (4, 1, 2048, 8192, 512), (4, 1, 300, 5000, 512), (8, 2, 1024, 2048, 1024),
    (4, 1, 8192, 0, None), (4, 1, 8192, 0, 512),  # enough query blocks: no key split
    (4, 1, 64, 16_384, None), (4, 1, 1, 8191, None),  # short chunks, long keys: 8 splits
]


def _inputs(H: int, KVH: int, L: int, position: int, window: int | None, D: int = 256):
    n_prev = min(position, window - 1) if window else position
    key = mx.random.key(L * 7 + position)
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((1, H, L, D), key=kq).astype(mx.bfloat16)
    k = mx.random.normal((1, KVH, n_prev + L, D), key=kk).astype(mx.bfloat16)
    v = mx.random.normal((1, KVH, n_prev + L, D), key=kv).astype(mx.bfloat16)
    return q, k, v


def check(rec: Recorder, warps: int = 4) -> bool:
    ok = True
    for H, KVH, L, position, window in CHECKS:
        q, k, v = _inputs(H, KVH, L, position, window)
        scale = 256 ** -0.5
        ours = flash_attention(q, k, v, scale, position, window,
                               warps=warps).astype(mx.float32)
        grouped = [x.astype(mx.float32) for x in (q, k, v)]
        if KVH != H:
            grouped[1] = mx.repeat(grouped[1], H // KVH, axis=1)
            grouped[2] = mx.repeat(grouped[2], H // KVH, axis=1)
        ref = blocked_attention(*grouped, scale, position, window)
        diff = float(mx.abs(ours - ref).max() / mx.abs(ref).max())
        ok &= diff <= BF16_TOLERANCE and not mx.isnan(ours).any().item()
        rec("flash_attention_check", diff, "max|diff|/max|ref|", ceiling=BF16_TOLERANCE,
            heads=H, kv_heads=KVH, queries=L, position=position, window=window,
            warps=warps, splits=grid_plan(1, H, L, k.shape[2], window, warps=warps)[1])
    return ok


def _seconds(fn, repeats: int = 5) -> float:
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def micro(rec: Recorder, shapes=((32, 4), (64, 4), (64, 8))) -> None:
    """`shapes`: the kernel's (block_n, warps) to time."""
    for L in (8192, 32_768):
        _micro_at(rec, L, shapes)


def _micro_at(rec: Recorder, L: int, shapes) -> None:
    q, k, v = _inputs(4, 1, L, 0, None)
    flops = 2 * 2 * (L * L / 2) * 256 * 4
    for block_n, warps in shapes:
        s = _seconds(lambda b=block_n, w=warps: flash_attention(
            q, k, v, 256 ** -0.5, 0, None, b, w))
        rec("attention_tflops", flops / s / 1e12, "TFLOP/s", impl="prefillq fused",
            block_n=block_n, warps=warps, queries=L, seconds=round(s, 5))
    s = _seconds(lambda: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=256 ** -0.5, mask="causal"))
    rec("attention_tflops", flops / s / 1e12, "TFLOP/s", impl="mlx sdpa", queries=L,
        seconds=round(s, 5))
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return
    tq = torch.randn(1, 4, L, 256, device="cuda", dtype=torch.bfloat16)
    tk = torch.randn(1, 1, L, 256, device="cuda", dtype=torch.bfloat16)
    tv = torch.randn(1, 1, L, 256, device="cuda", dtype=torch.bfloat16)

    # with enable_gqa, and with the KV head expanded to every query head (flash's own path)
    tk4, tv4 = tk.expand(1, 4, L, 256).contiguous(), tv.expand(1, 4, L, 256).contiguous()
    for impl, run in (
            ("torch sdpa enable_gqa", lambda: F.scaled_dot_product_attention(
                tq, tk, tv, is_causal=True, enable_gqa=True)),
            ("torch sdpa expanded kv", lambda: F.scaled_dot_product_attention(
                tq, tk4, tv4, is_causal=True))):
        run()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        rec("attention_tflops", flops / best / 1e12, "TFLOP/s", impl=impl, queries=L,
            seconds=round(best, 5), torch=torch.__version__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only the exactness check")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not available():
        p.error(f"no CUDA GPU: MLX's default device is {mx.default_device()}")
    refuse_existing(p, args.out)
    rec = Recorder(True, {"date": datetime.date.today().isoformat(), "commit": git_commit(),
                          "device": str(mx.default_device()), "mlx": mx.__version__},
                   args.out)
    ok = check(rec) and check(rec, warps=8)
    log(f"flash attention check: {'ok' if ok else 'FAILED'}")
    if not args.check:
        micro(rec)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
