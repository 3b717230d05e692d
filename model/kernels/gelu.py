"""Gemma's GELU-gated product: MLX's ops (`gelu_gate`, the reference and every device's
path) and, for a fused gate/up projection on CUDA, one kernel (`fused_gelu_gate`).

Gemma's MLP multiplies ``gelu_tanh(gate)`` by ``up``, where ``gate`` and ``up`` are the
halves of one matmul's output (`model.archs._gemma3_graph`). MLX's compiled element-wise
kernel over the two strided halves moves 1.1-1.2 TB/s on an H100 at Gemma 3 4B's shapes
(2,048 rows of 2 x 10,240 bf16); this kernel reads eight values of each half and writes
eight with one 16-byte access each, 2.6-2.9 TB/s (48 vs 112 us at 2,048 rows, 172 vs 416 at
8,192; docs/benchmarks.md, "The GELU gate as a kernel of its own").
"""

from __future__ import annotations

import os
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from . import flash_attention, source_tag

# `PREFILLQ_GELU_KERNEL=0` keeps the gated product in MLX's compiled graph (an ablation)
ENV = "PREFILLQ_GELU_KERNEL"
# values a thread reads from each half and writes: one 16-byte access of bf16 each
VECTOR = 8
THREADS = 256

SOURCE = """
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)gate_up_shape[0] * (I / 8)) return;
    size_t row = t / (I / 8), col = (t % (I / 8)) * 8;
    const __nv_bfloat16* g = gate_up + row * 2 * I + col;
    const uint4 gv = *reinterpret_cast<const uint4*>(g);
    const uint4 uv = *reinterpret_cast<const uint4*>(g + I);
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv);
    uint4 ov;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&ov);
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        float2 x = __bfloat1622float2(g2[j]);
        float2 u = __bfloat1622float2(u2[j]);
        float a = 0.7978845608028654f * (x.x + 0.044715f * x.x * x.x * x.x);
        float b = 0.7978845608028654f * (x.y + 0.044715f * x.y * x.y * x.y);
        o2[j] = __floats2bfloat162_rn(0.5f * x.x * (1.0f + tanhf(a)) * u.x,
                                      0.5f * x.y * (1.0f + tanhf(b)) * u.y);
    }
    *reinterpret_cast<uint4*>(out + row * I + col) = ov;
"""
HEADER = "#include <cuda_bf16.h>\n"


def gelu_gate(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_tanh(gate) * up``, GELU's tanh approximation as Gemma and llama.cpp use it
    (MLX's ``nn.gelu_approx``; Hendrycks and Gimpel, arXiv:1606.08415). Any float dtype,
    ``gate`` and ``up`` of one shape."""
    return nn.gelu_approx(gate) * up


def available() -> bool:
    """True where the kernel runs: a CUDA GPU (`flash_attention.available`, whose switch
    turns this kernel off too) and ``$PREFILLQ_GELU_KERNEL`` not ``0``."""
    return os.environ.get(ENV, "1") != "0" and flash_attention.available()


def supports(gate_up: mx.array) -> bool:
    """Whether `fused_gelu_gate` takes `gate_up`: `available`, bf16, each half a whole
    number of 16-byte vectors."""
    half = gate_up.shape[-1] // 2
    return (available() and gate_up.dtype == mx.bfloat16 and gate_up.shape[-1] % 2 == 0
            and half % VECTOR == 0)


def fused_gelu_gate(gate_up: mx.array) -> mx.array:
    """`gelu_gate` of ``gate, up = split(gate_up, 2, axis=-1)`` in one CUDA kernel.

    ``gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` (Hendrycks and
    Gimpel, "Gaussian Error Linear Units", arXiv:1606.08415, eq. for the tanh
    approximation; MLX's ``nn.gelu_approx``, HF's ``gelu_pytorch_tanh``), in float32 per
    value, the product rounded to bf16 once (`bench.gpu_check.gelu_gate_kernel` checks it
    against float32 and against MLX's compiled `gelu_gate`).

    Args:
        gate_up: bf16 ``(..., 2 * I)``, row-contiguous (made so if it is not), with
            ``supports(gate_up)``.
    Returns:
        bf16 ``(..., I)``.
    Raises:
        ValueError: `gate_up` is not one `supports` takes.
    """
    if not supports(gate_up):
        raise ValueError(f"fused_gelu_gate takes bf16 (..., 2 * I) with I a multiple of {VECTOR} "
                         f"on a CUDA GPU, not {gate_up.dtype} {gate_up.shape}")
    *lead, width = gate_up.shape
    half, rows = width // 2, gate_up.size // width
    threads = rows * half // VECTOR
    # the row count is read from the input's shape, not a template constant: one compile
    # for every chunk length
    out = _kernel()(inputs=[gate_up.reshape(rows, width)], template=[("I", half)],
                    grid=(-(-threads // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                    output_shapes=[(rows, half)], output_dtypes=[mx.bfloat16])[0]
    return out.reshape(*lead, half)


@cache
def _kernel():
    return mx.fast.cuda_kernel(
        name=f"prefillq_gelu_gate_{source_tag(HEADER, SOURCE)}", input_names=["gate_up"],
        output_names=["out"], source=SOURCE, header=HEADER)
