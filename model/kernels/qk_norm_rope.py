"""Gemma 3's per-head Q/K RMSNorm and RoPE, and the split into head-major Q, K and V, as one
CUDA kernel over the fused q/k/v projection.

In the compiled graph (`model.archs._gemma3_graph._heads_packed`) the fused projection
``(rows, (heads + 2 kv_heads) head_dim)`` is split, Q and K are normed per head, rotated
and transposed to head-major, and V is transposed: at Gemma 3 4B's shapes RoPE and the norms
took 10% of a layer and their transposes part of the 10.7% in copies (docs/benchmarks.md,
"The GELU gate as a kernel of its own"). Here one warp reads one head of one row (256 bf16,
16 bytes a lane), norms it in float32 (reduced across the warp), rounds it to bf16 as
MLX's CUDA ``rms_norm`` does (the normed value rounded, then times the weight rounded again:
``w * bf16(x * inv)`` in bf16), rotates it (the partner half lane ``^ 16`` away, RoPE's
frequencies and angle computed in float32 exactly as MLX's CUDA ``rope`` computes them) and
writes it head-major, once. Gemma 3's graph takes it unless ``PREFILLQ_QK_KERNEL=0``
(`enabled`).
"""

from __future__ import annotations

import os
from functools import cache

import mlx.core as mx
import numpy as np

from . import flash_attention, source_tag

# `PREFILLQ_QK_KERNEL=0` keeps Gemma 3's graph on MLX's ops. On an H100 the kernel equals
# MLX's compiled `_heads_packed` bit for bit (`bench.gpu --check --checks qk_norm`) and adds
# 2.9-3.3% to Gemma 3 4B's prefill (medians of five rounds at 32K and 8K; docs/benchmarks.md,
# "Q/K norm and RoPE as one kernel").
ENV = "PREFILLQ_QK_KERNEL"
HEAD_DIM = 256  # 32 lanes x 8 values
THREADS = 256  # 8 warps a block, a (row, head) each

SOURCE = """
    constexpr int S = H + 2 * KV;  // heads of a row: Q's, K's, V's
    const int lane = threadIdx.x & 31;
    const size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int rows = qkv_shape[0];
    if (warp >= (size_t)rows * S) return;
    const int row = (int)(warp / S), slot = (int)(warp % S);
    const uint4 raw = *reinterpret_cast<const uint4*>(qkv + (size_t)warp * 256 + lane * 8);
    const __nv_bfloat162* in2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
    float x[8];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        float2 f = __bfloat1622float2(in2[j]);
        x[2 * j] = f.x;
        x[2 * j + 1] = f.y;
    }
    __nv_bfloat16* dst;
    if (slot < H + KV) {
        float ss = 0.0f;
        #pragma unroll
        for (int j = 0; j < 8; ++j) ss += x[j] * x[j];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float inv = rsqrtf(ss / 256.0f + EPS);
        float y[8], p[8];
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float w = slot < H ? static_cast<float>(q_norm[lane * 8 + j])
                                     : static_cast<float>(k_norm[lane * 8 + j]);
            // as MLX's rms_norm: the normed value rounded, then times the weight in bf16
            y[j] = __bfloat162float(__float2bfloat16(
                __bfloat162float(__float2bfloat16(x[j] * inv)) * w));
        }
        #pragma unroll
        for (int j = 0; j < 8; ++j) p[j] = __shfl_xor_sync(0xffffffffu, y[j], 16);
        const float pos = SCALE * static_cast<float>(positions[row]);
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float d = static_cast<float>((lane & 15) * 8 + j) / 128.0f;
            const float theta = pos * exp2f(-d * LOG2_BASE);
            const float c = cosf(theta), s = sinf(theta);
            x[j] = lane < 16 ? y[j] * c - p[j] * s : p[j] * s + y[j] * c;
        }
        dst = slot < H ? q + ((size_t)slot * rows + row) * 256
                       : k + ((size_t)(slot - H) * rows + row) * 256;
    } else {
        dst = v + ((size_t)(slot - H - KV) * rows + row) * 256;
    }
    uint4 out;
    __nv_bfloat162* out2 = reinterpret_cast<__nv_bfloat162*>(&out);
    #pragma unroll
    for (int j = 0; j < 4; ++j) out2[j] = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);
    *reinterpret_cast<uint4*>(dst + lane * 8) = out;
"""
HEADER = "#include <cuda_bf16.h>\n"


def available() -> bool:
    """True where the kernel can run: a CUDA GPU (`flash_attention.available`, whose switch
    turns this kernel off too)."""
    return flash_attention.available()


def enabled() -> bool:
    """Whether Gemma 3's graph uses the kernel: `available` and ``$PREFILLQ_QK_KERNEL`` not
    ``0``."""
    return os.environ.get(ENV, "1") != "0" and available()


def qk_norm_rope(qkv: mx.array, positions: mx.array, q_norm: mx.array, k_norm: mx.array, *,
                 heads: int, kv_heads: int, base: float, scale: float, eps: float
                 ) -> tuple[mx.array, mx.array, mx.array]:
    """Split a fused q/k/v projection into head-major Q, K and V, Q and K each normed per
    head and rotated at its row's position.

    ``q_h = rope(rms_norm(qkv[:, h D:(h + 1) D], q_norm), positions)`` (and K with
    `k_norm`): RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` (Zhang and Sennrich,
    arXiv:1910.07467; Gemma 3's per-head Q/K norms), RoPE in its non-interleaved form, the
    halves ``(x1, x2)`` of a head rotated to ``(x1 cos - x2 sin, x1 sin + x2 cos)`` by
    ``scale * position * base^(-2i / D)`` (Su et al., arXiv:2104.09864; MLX's
    ``fast.rope`` with ``traditional=False``), which
    `model.archs._gemma3_graph._heads_packed` computes with MLX's ops
    (`bench.gpu_check.qk_norm_rope_kernel` checks the two agree).

    Args:
        qkv: bf16 ``(rows, (heads + 2 kv_heads) * 256)``, row-contiguous (made so if not).
        positions: int32 ``(rows,)``, each row's position in its sequence.
        q_norm, k_norm: the norms' weights, ``(256,)``.
        heads, kv_heads: query and key/value heads.
        base: RoPE's base (Gemma 3: 10,000 in sliding layers, 1,000,000 in global ones).
        scale: positions are multiplied by it (linear RoPE scaling, 1 / factor: Gemma 3
            4B and larger, global layers, 1/8).
        eps: the norms' epsilon.
    Returns:
        q, k, v: bf16 ``(1, heads, rows, 256)``, ``(1, kv_heads, rows, 256)`` twice.
    Raises:
        ValueError: not on a CUDA GPU, not bf16, or a head dim other than 256.
    """
    width = (heads + 2 * kv_heads) * HEAD_DIM
    if not available() or qkv.dtype != mx.bfloat16 or qkv.ndim != 2 or qkv.shape[1] != width:
        raise ValueError(f"qk_norm_rope takes bf16 (rows, {width}) on a CUDA GPU, not "
                         f"{qkv.dtype} {qkv.shape}")
    rows = qkv.shape[0]
    threads = rows * (heads + 2 * kv_heads) * 32
    q, k, v = _kernel(float(eps), float(np.float32(np.log2(np.float32(base)))),
                      float(np.float32(scale)))(
        inputs=[qkv, positions.astype(mx.int32), q_norm, k_norm],
        template=[("H", heads), ("KV", kv_heads)],
        grid=(-(-threads // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(heads, rows, HEAD_DIM), (kv_heads, rows, HEAD_DIM),
                       (kv_heads, rows, HEAD_DIM)],
        output_dtypes=[mx.bfloat16] * 3)
    return q[None], k[None], v[None]


@cache
def _kernel(eps: float, log2_base: float, scale: float):
    """The kernel for one (eps, log2(base), scale): constants of its source (and name)."""
    header = HEADER + (f"#define EPS {eps!r}f\n#define LOG2_BASE {log2_base!r}f\n"
                       f"#define SCALE {scale!r}f\n")
    return mx.fast.cuda_kernel(
        name=f"prefillq_qk_norm_rope_{source_tag(header, SOURCE)}",
        input_names=["qkv", "positions", "q_norm", "k_norm"], output_names=["q", "k", "v"],
        source=SOURCE, header=header)
