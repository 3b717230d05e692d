"""DeepSeek-V4's rotary embedding (and its queries' weightless RMS norm) as one CUDA kernel.

In MLX ops the rotation of a row's last dims is a slice, a strided pair split, a stack and
a concatenation, and the queries' norm four more elementwise passes: about a dozen
kernels over a (2,048, 64, 512) chunk of queries, and as many again for the output's
inverse rotation, in each layer. ``rope.cu`` reads each row once and writes it once.
`model.archs.deepseek4.layers.rope` uses it where `applies`; its MLX-ops form is the
reference (`bench.gpu_check` compares them on the device) and the path elsewhere.
`bench.gpu_deepseek4.ablate` measures the prefill without it (``rope_ops``).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .flash_attention import _float32s, available

SOURCE = (Path(__file__).with_name("rope.cu")).read_text()
WARPS = 4  # rows per block

_kernels: dict[bool, object] = {}


def supports(x: mx.array, rope_dims: int) -> bool:
    """Whether `rope` takes `x`: bf16 ``(B, L, N, D)`` with D a multiple of 64 and an even
    `rope_dims` of at most D."""
    D = x.shape[-1]
    return (x.dtype == mx.bfloat16 and x.ndim == 4 and D % 64 == 0
            and rope_dims % 2 == 0 and 0 < rope_dims <= D)


def applies(x: mx.array, rope_dims: int) -> bool:
    """`supports` on a CUDA GPU with the fused kernels on (`flash_attention.available`)."""
    return available() and supports(x, rope_dims)


def _kernel(norm: bool):
    if norm not in _kernels:
        _kernels[norm] = mx.fast.cuda_kernel(
            name=f"prefillq_rope{'_norm' if norm else ''}",
            input_names=["x", "cosines", "sines", "eps"], output_names=["out"], source=SOURCE)
    return _kernels[norm]


def rope(x: mx.array, cos: mx.array, sin: mx.array, norm_eps: float | None = None
         ) -> mx.array:
    """Rotate interleaved pairs of the last ``2 * cos.shape[1]`` dims of every row of `x`.

    Pair ``(a, b)`` at dims ``D - R + 2i, D - R + 2i + 1`` of a row at position index ``l``
    becomes ``(a cos - b sin, a sin + b cos)`` with ``cos[l, i]``, ``sin[l, i]``; with
    `norm_eps` the row is first scaled by ``rsqrt(mean(row^2) + norm_eps)`` (DeepSeek-V4
    reference ``inference/model.py``: ``apply_rotary_emb`` and its queries' norm).

    Args:
        x: bf16 ``(B, L, N, D)``: `supports`.
        cos, sin: float32 ``(L, R/2)``, each position's angles' cosines and sines (negate
            `sin` for the inverse rotation).
        norm_eps: the RMS norm's epsilon, or None for no norm.
    Returns:
        bf16 ``(B, L, N, D)``, computed in float32 and rounded once.
    Raises:
        ValueError: `x` that `supports` refuses, or tables not ``(L, R/2)``.
    """
    R = 2 * cos.shape[-1]
    if not supports(x, R) or cos.shape != (x.shape[1], R // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope takes bf16 (B, L, N, D) with D % 64 == 0 and (L, R/2) "
                         f"tables, R even <= D; got {x.dtype} {x.shape}, cos {cos.shape}, "
                         f"sin {sin.shape}")
    B, L, N, D = x.shape
    rows = B * L * N
    (out,) = _kernel(norm_eps is not None)(
        inputs=[mx.contiguous(x).reshape(rows, D), cos.astype(mx.float32),
                sin.astype(mx.float32), _float32s(norm_eps or 0.0)],
        template=[("D", D), ("ROPE", R), ("HEADS", N), ("NORM", int(norm_eps is not None))],
        grid=(-(-rows // WARPS) * 32 * WARPS, 1, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(rows, D)], output_dtypes=[x.dtype])
    return out.reshape(B, L, N, D)
