"""Exactness on the GPU (`python -m bench.gpu --check`): every check in `CHECKS` runs, each
records its JSON lines, and the run passes only if all do.

A check is a function of the run's `Recorder` returning whether it passed; add one by
appending it to `CHECKS`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import numpy as np

from model.archs._gemma3_graph import SHARED_KV_BYTES, _heads_packed
from model.kernels import flash_attention_sm90 as sm90
from model.kernels import gelu, qk_norm_rope
from model.kernels.flash_attention import available
from model.prefill import Prefill
from model.start import start_prefill

from . import gpu_deepseek4
from .common import Recorder, log
from .gpu import MODELS, gemma3_model
from .gpu_attention import check as kernel_check
from .gpu_attention import check_packed as packed_check

# Chunked vs one pass in bf16, as max |diff| / max |logit|. Both sides round every
# activation to bf16 (relative step 2^-8 ~ 3.9e-3) through 18 layers, and differ in the
# order of their sums (matmuls of 2,048 vs 8,192 rows, the kernel's key splits), so each
# layer's bf16 rounding lands differently and the residual stream carries it on; the fused
# kernel alone may differ from float32 by 2e-2 (`bench.gpu_attention.BF16_TOLERANCE`).
# 3e-2 is ~8 bf16 steps at the largest logit; a bug (a wrong offset, window or cache row)
# moves logits by O(1) of it. The top-1 token must also agree.
CHUNKED_TOLERANCE = 3e-2
CHUNKED_TOKENS = 8192
CHUNK_TOKENS = 2048
SEED = 0


def fused_kernel_4_warps(rec: Recorder) -> bool:
    """`bench.gpu_attention.check` at 4 warps per block (the default)."""
    return kernel_check(rec, warps=4)


def fused_kernel_8_warps(rec: Recorder) -> bool:
    """`bench.gpu_attention.check` at 8 warps per block."""
    return kernel_check(rec, warps=8)


def fused_kernel_sm90(rec: Recorder) -> bool:
    """`bench.gpu_attention.check` and `check_packed` on the sm_90a (wgmma) path: on a
    compute capability 9.0 GPU only (elsewhere recorded as skipped, and passing)."""
    if sm90.compute_capability() != (9, 0):
        rec("flash_attention_sm90_check_skipped", 1, "", reason="not a Hopper GPU")
        return True
    return kernel_check(rec, hopper=True) and packed_check(rec, hopper=True)


def _relative_diff(got: mx.array, ref: mx.array) -> float:
    """max |got - ref| / max |ref| in float32."""
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.abs(got - ref).max()) / float(mx.abs(ref).max())


# `gelu.fused_gelu_gate` against float32: it rounds once to bf16, half a step (2^-9
# relative), plus tanhf's own error; one step (2^-8) is the bound. Against MLX's compiled bf16
# `gelu_gate`, which rounds after each of its ops, two steps of the largest value.
GATE_F32_BOUND = 2.0 ** -8
GATE_MLX_BOUND = 2.0 ** -7


def gelu_gate_kernel(rec: Recorder) -> bool:
    """`gelu.fused_gelu_gate` on Gemma 3 4B's MLP shapes (2,048 rows of 2 x 10,240 bf16, and
    an odd 37 rows of 270M's 2 x 2,048): each value within `GATE_F32_BOUND` of the float32
    `gelu_gate` of the same bf16 inputs (relative, with 2^-20 absolute near 0), and within
    `GATE_MLX_BOUND` x max |value| of MLX's compiled bf16 `gelu_gate`."""
    ok = True
    for rows, inter in ((2048, 10240), (37, 2048)):
        mx.random.seed(SEED)
        gate_up = (mx.random.normal((1, rows, 2 * inter)) * 1.5).astype(mx.bfloat16)
        got = gelu.fused_gelu_gate(gate_up).astype(mx.float32)
        exact = gelu.gelu_gate(*mx.split(gate_up.astype(mx.float32), 2, axis=-1))
        mlx = mx.compile(gelu.gelu_gate)(*mx.split(gate_up, 2, axis=-1)).astype(mx.float32)
        over = mx.abs(got - exact) - (GATE_F32_BOUND * mx.abs(exact) + 2.0 ** -20)
        rel_f32 = float((mx.abs(got - exact) / mx.maximum(mx.abs(exact), 2.0 ** -12)).max())
        diff_mlx = _relative_diff(got, mlx)
        passed = float(over.max()) <= 0 and diff_mlx <= GATE_MLX_BOUND
        rec("gelu_gate_kernel_check", diff_mlx, "max|diff|/max|value| vs MLX bf16",
            ceiling=GATE_MLX_BOUND, passed=passed, rows=rows, intermediate=inter,
            max_rel_diff_f32=rel_f32, f32_bound=GATE_F32_BOUND)
        ok = ok and passed
    return ok


# `qk_norm_rope.qk_norm_rope` against MLX's compiled `_heads_packed`: the same float32
# formulas (norm, rounded to bf16 twice as MLX's rms_norm rounds, then RoPE as MLX's CUDA
# rope computes its angle) in another sum order, so a value may land one bf16 step off; two
# steps of the largest is the bound. V is copied, so equal. (On 2026-12-06 an H100 measured
# 0.0084-0.0096 at the large positions with the norm rounded once: MLX rounds twice.)
HEADS_BOUND = 2.0 ** -7


def _relative_diff_np(got: mx.array, exact: np.ndarray) -> float:
    """max |got - exact| / max |exact|, `got` (bf16, ``(1, n, rows, 256)``) against float64."""
    got = np.array(got[0].astype(mx.float32), dtype=np.float64)
    return float(np.abs(got - exact).max() / np.abs(exact).max())


def _bf16(x: np.ndarray) -> np.ndarray:
    """`x` rounded to bf16 (through float32), as float64."""
    return np.array(mx.array(x.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32),
                    dtype=np.float64)


def _heads_float64(qkv, positions, w_q, w_k, heads: int, kv: int, base: float, scale: float
                   ) -> list[np.ndarray]:
    """`_heads_packed`'s q and k in float64 from the same bf16 inputs, the normed heads
    rounded to bf16 as MLX's ``rms_norm`` rounds them (``bf16(w * bf16(x * inv))``), RoPE's
    angles exact: ``(n, rows, 256)`` each (HF's ``rotate_half`` form)."""
    x = np.array(qkv.astype(mx.float32), dtype=np.float64).reshape(qkv.shape[0], -1, 256)
    theta = (scale * np.array(positions, dtype=np.float64))[:, None] * base ** (
        -np.arange(128, dtype=np.float64) / 128)
    cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
    out = []
    for part, w in ((x[:, :heads], w_q), (x[:, heads:heads + kv], w_k)):
        y = _bf16(part / np.sqrt((part ** 2).mean(-1, keepdims=True) + 1e-6))
        y = _bf16(y * np.array(w.astype(mx.float32), dtype=np.float64))
        a, b = y[..., :128], y[..., 128:]
        out.append(np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
                   .transpose(1, 0, 2))
    return out


def qk_norm_rope_kernel(rec: Recorder) -> bool:
    """`qk_norm_rope.qk_norm_rope` against MLX's compiled `_heads_packed` on Gemma 3 4B's
    heads (8 over 4) at 2,048 rows past 30,000 (RoPE's large angles) and on 270M's (4 over
    1) at 37 rows from 0, both RoPE bases (the global one also at 4B's linear scale, 1/8):
    q and k within `HEADS_BOUND` x max |value|, v equal."""
    ok = True
    for heads, kv, rows, first in ((8, 4, 2048, 30_000), (4, 1, 37, 0)):
        for base, scale in ((10_000.0, 1.0), (1_000_000.0, 1.0), (1_000_000.0, 0.125)):
            mx.random.seed(SEED)
            qkv = (mx.random.normal((rows, (heads + 2 * kv) * 256)) * 2).astype(mx.bfloat16)
            w_q, w_k = (mx.random.uniform(0.5, 1.5, (256,)).astype(mx.bfloat16) for _ in "qk")
            positions = mx.arange(first, first + rows, dtype=mx.int32)
            try:
                got = qk_norm_rope.qk_norm_rope(qkv, positions, w_q, w_k, heads=heads,
                                                kv_heads=kv, base=base, scale=scale, eps=1e-6)
                mx.eval(got)
            except Exception as error:  # a kernel that does not build fails its check only
                rec("qk_norm_rope_kernel_check", float("nan"), "max|diff|/max|value| vs MLX",
                    ceiling=HEADS_BOUND, passed=False, heads=heads, kv_heads=kv, rows=rows,
                    base=base, scale=scale, error=f"{type(error).__name__}: {error}"[:400])
                return False
            ref = mx.compile(partial(_heads_packed, eps=1e-6, heads=heads, kv_heads=kv,
                                     head_dim=256, base=base, scale=scale))(
                qkv[None], positions, w_q, w_k)
            diffs = [_relative_diff(g, r) for g, r in zip(got, ref, strict=True)]
            passed = diffs[0] <= HEADS_BOUND and diffs[1] <= HEADS_BOUND and diffs[2] == 0
            exact = _heads_float64(qkv, positions, w_q, w_k, heads, kv, base, scale)
            rec("qk_norm_rope_kernel_check", max(diffs[:2]), "max|diff|/max|value| vs MLX",
                ceiling=HEADS_BOUND, passed=passed, heads=heads, kv_heads=kv, rows=rows,
                first_position=first, base=base, scale=scale, q_diff=diffs[0], k_diff=diffs[1],
                v_diff=diffs[2],
                kernel_vs_float64=[_relative_diff_np(g, e)
                                   for g, e in zip(got[:2], exact, strict=True)],
                mlx_vs_float64=[_relative_diff_np(r, e)
                                for r, e in zip(ref[:2], exact, strict=True)])
            ok = ok and passed
    return ok


def compare_logits(chunked: np.ndarray, whole: np.ndarray) -> dict:
    """How far `chunked` logits are from `whole` ones (float ``(vocab,)`` each).

    Returns:
        ``diff``: max |chunked - whole| / max |whole|; ``top1_agrees``; both top-1 ids;
        ``top2_margin``: `whole`'s top-1 minus top-2 logit over max |whole| (how close a
        flip of the top-1 was); ``finite``: no NaN or infinity in `chunked`.
    """
    scale = float(np.abs(whole).max())
    second, first = np.argsort(whole)[-2:]
    return {"diff": float(np.abs(chunked - whole).max()) / scale,
            "top1_agrees": int(chunked.argmax()) == int(whole.argmax()),
            "top1_chunked": int(chunked.argmax()), "top1_one_pass": int(whole.argmax()),
            "top2_margin": round(float(whole[first] - whole[second]) / scale, 5),
            "finite": bool(np.isfinite(chunked).all())}


def _logits(model, ids: list[int], chunk: int) -> tuple[np.ndarray, int]:
    prefill = start_prefill(model, ids, vocab_size=model.args.vocab_size,
                            context_length=model.args.context_length, chunk_tokens=chunk,
                            kv_dtype=mx.bfloat16)
    logits = prefill.run()
    return logits, prefill.chunks_done


def chunked_equals_one_pass(rec: Recorder, model=None, n: int = CHUNKED_TOKENS,
                            chunk: int = CHUNK_TOKENS) -> bool:
    """`n` random tokens prefilled in `chunk`-token chunks and in one `n`-token chunk give
    the same final logits within `CHUNKED_TOLERANCE`, and the same top-1 token.

    Args:
        model: a `model.archs.gemma3.Model` or `model.archs.llama.Model` (default
            `bench.gpu.gemma3_model()`: 270M shapes, bf16, random weights from seed `SEED`).
    """
    mx.random.seed(SEED)
    model = model if model is not None else gemma3_model()
    ids = mx.random.randint(0, model.args.vocab_size, (n,)).tolist()
    chunked, chunks = _logits(model, ids, chunk)
    whole, one_pass_chunks = _logits(model, ids, n)
    got = compare_logits(chunked, whole)
    ok = got["diff"] <= CHUNKED_TOLERANCE and got["top1_agrees"] and got["finite"]
    rec("chunked_over_one_pass_check", got.pop("diff"), "max|diff|/max|logit|",
        ceiling=CHUNKED_TOLERANCE, passed=ok, n_tokens=n, chunk_tokens=chunk, chunks=chunks,
        one_pass_chunks=one_pass_chunks, fused_attention=available(), **got)
    return ok


# Packed steps against each job alone: lengths that end in the same, in later and in a
# first step, in 256-token chunks, so that steps mix first and later chunks.
PACKED_JOBS, PACKED_CHUNK = (1500, 700, 300, 40, 513), 256


def packed_steps_equal_each_alone(rec: Recorder, model=None, lengths=PACKED_JOBS,
                                  chunk: int = PACKED_CHUNK) -> bool:
    """Jobs of `lengths` tokens prefilled in `chunk`-token chunks in packed steps
    (`Prefill.launch_all`, every live job a step) with the later chunks in the step's one
    attention launch (`GraphForward.shared_kv_bytes` at `SHARED_KV_BYTES`) give each job's
    logits alone within `CHUNKED_TOLERANCE`, the same top-1. Records how many later chunks
    shared a launch (0 fails: the path did not run).

    Args:
        model: a `model.archs.gemma3.Model` (default `bench.gpu.gemma3_model()`: 270M
            shapes, bf16, random weights from seed `SEED`) whose chunks take its compiled
            graphs.
    """
    mx.random.seed(SEED)
    model = model if model is not None else gemma3_model()
    forward = model._graph_forward()
    shared, attend_packed, kv_bytes = [], forward.attend_packed, forward.shared_kv_bytes

    def counting(q, keys, values, scale, jobs, window):
        shared.append(sum(1 for job in jobs if job.position > 0))
        return attend_packed(q, keys, values, scale, jobs, window)

    forward.attend_packed, forward.shared_kv_bytes = counting, SHARED_KV_BYTES
    try:
        jobs = [mx.random.randint(0, model.args.vocab_size, (n,)).tolist() for n in lengths]
        prefills = [start_prefill(model, ids, vocab_size=model.args.vocab_size,
                                  context_length=model.args.context_length,
                                  chunk_tokens=chunk, kv_dtype=mx.bfloat16)
                    for ids in jobs]
        while live := [p for p in prefills if not p.done]:
            Prefill.launch_all(live)
            for p in live:
                p.step()
        packed = [p.logits() for p in prefills]
    finally:
        forward.attend_packed, forward.shared_kv_bytes = attend_packed, kv_bytes
    ok = sum(shared) > 0
    for ids, got in zip(jobs, packed, strict=True):
        alone, _ = _logits(model, ids, chunk)
        cmp = compare_logits(got, alone)
        passed = cmp["diff"] <= CHUNKED_TOLERANCE and cmp["top1_agrees"] and cmp["finite"]
        rec("packed_over_alone_check", cmp.pop("diff"), "max|diff|/max|logit|",
            ceiling=CHUNKED_TOLERANCE, passed=passed, n_tokens=len(ids),
            chunk_tokens=chunk, later_chunks_shared=sum(shared), **cmp)
        ok = ok and passed
    return ok


# Layers of the Llama-family checks: enough for rounding to carry through the residual
# stream as it does in the full models, few enough to build in seconds.
LLAMA_CHECK_LAYERS = 8


def llama3_8b_chunked_equals_one_pass(rec: Recorder) -> bool:
    """`chunked_equals_one_pass` on the first `LLAMA_CHECK_LAYERS` layers at Llama 3 8B
    shapes (bf16, MLX's SDPA, Llama 3 RoPE scaling)."""
    mx.random.seed(SEED)
    return chunked_equals_one_pass(rec, MODELS["llama3-8b"].build(n_layers=LLAMA_CHECK_LAYERS))


def gemma3_4b_chunked_equals_one_pass(rec: Recorder) -> bool:
    """`chunked_equals_one_pass` on the first `LLAMA_CHECK_LAYERS` layers at Gemma 3 4B
    shapes (bf16, 8 query heads over 4 KV heads, five 1,024-token windows and a global
    layer in every six)."""
    mx.random.seed(SEED)
    return chunked_equals_one_pass(rec, MODELS["gemma3-4b"].build(n_layers=LLAMA_CHECK_LAYERS))


def qwen3_4b_chunked_equals_one_pass(rec: Recorder) -> bool:
    """`chunked_equals_one_pass` on the first `LLAMA_CHECK_LAYERS` layers at Qwen3 4B
    shapes (bf16, q/k norms, tied head)."""
    mx.random.seed(SEED)
    return chunked_equals_one_pass(rec, MODELS["qwen3-4b"].build(n_layers=LLAMA_CHECK_LAYERS))


CHECKS: list[Callable[[Recorder], bool]] = [
    fused_kernel_4_warps, fused_kernel_8_warps, fused_kernel_sm90, gelu_gate_kernel,
    qk_norm_rope_kernel, chunked_equals_one_pass, packed_steps_equal_each_alone,
    gemma3_4b_chunked_equals_one_pass, llama3_8b_chunked_equals_one_pass,
    qwen3_4b_chunked_equals_one_pass,
    gpu_deepseek4.check_sparse_kernel, gpu_deepseek4.check_gathered_layers,
    gpu_deepseek4.check_padded_experts]


def run_checks(rec: Recorder, checks: list[Callable[[Recorder], bool]] | None = None) -> bool:
    """Run every one of `checks` (default `CHECKS`), a failure not stopping the rest, and log
    each verdict; True if all passed."""
    ok = True
    for check in CHECKS if checks is None else checks:
        passed = bool(check(rec))
        log(f"{check.__name__}: {'ok' if passed else 'FAILED'}")
        ok = ok and passed
    return ok
