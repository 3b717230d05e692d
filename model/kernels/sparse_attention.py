"""Fused attention over per-query key lists on CUDA: DeepSeek-V4's attention at head dim 512.

``sparse_attention.cu`` is FlashAttention-2's forward pass on mma.sync tensor cores (bf16 in,
fp32 accumulation) over index lists like the reference ``inference/kernel.py``
``sparse_attn``'s; `model.archs.deepseek4.sparse.gathered_attention` is its MLX reference.
``sparse_attention_sm90.cu`` computes the same with Hopper's warpgroup MMA (sm_90a, through
NVRTC as `model.kernels.flash_attention_sm90` is built), the path taken wherever
`flash_attention_sm90.available` (a compute capability 9.0 GPU, ``$PREFILLQ_HOPPER_ATTENTION``
not ``0``).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import mlx.core as mx

from . import HEADER, source_tag
from . import flash_attention_sm90 as sm90
from .flash_attention import PAD, _float32s, _hopper, available
from .nvrtc import compile_cubin

SOURCE = (Path(__file__).with_name("sparse_attention.cu")).read_text()
SM90_SOURCE = (Path(__file__).with_name("sparse_attention_sm90.cu")).read_text()
# the sm_90a build's sources' hash, in its name (computed once: names are built per launch)
SM90_TAG = source_tag(HEADER, sm90.WGMMA, SM90_SOURCE)
HEAD_DIMS = (512,)
HEADS_PER_BLOCK = 64  # both kernels' HEADS: the rows of one block's Q tile
WARPS = 8
DEFAULT_BLOCK_N = 32
SM90_BLOCK_N = 64     # key slots a step on sm_90a (S on wgmma m64n64k16; 32 builds too)
SM90_THREADS = 256    # two warpgroups, each half of the head dim

_kernels: dict[tuple[int, int], object] = {}


def supports(q: mx.array, kv: mx.array) -> bool:
    """Whether `sparse_attention` takes these inputs: bf16, a head dim in `HEAD_DIMS`, whole
    blocks of `HEADS_PER_BLOCK` heads, one batch."""
    return (q.dtype == mx.bfloat16 and kv.dtype == mx.bfloat16 and q.shape[0] == 1
            and q.shape[-1] in HEAD_DIMS and q.shape[1] % HEADS_PER_BLOCK == 0)


def applies(q: mx.array, kv: mx.array) -> bool:
    """`supports` on a CUDA GPU with fused attention on (`flash_attention.available`)."""
    return available() and supports(q, kv)


def shared_bytes(head_dim: int, block_n: int) -> int:
    """Dynamic shared memory of one block: the Q tile, two key tiles (padded rows), the
    S halves the warp pairs exchange (fp32) and two tiles' key indices (int32)."""
    rows = HEADS_PER_BLOCK + 2 * block_n
    return rows * (head_dim + PAD) * 2 + WARPS * 16 * block_n * 4 + 2 * block_n * 4


def sm90_shared_bytes(head_dim: int, block_n: int = SM90_BLOCK_N) -> int:
    """Dynamic shared memory of one sm_90a block: the Q tile, two key tiles, the two
    warpgroups' fp32 S halves, two tiles' key indices (int32), and 1 KB to align the tiles
    to the swizzle's 1,024-byte atoms."""
    return ((HEADS_PER_BLOCK + 2 * block_n) * head_dim * 2 + 2 * HEADS_PER_BLOCK * block_n * 4
            + 2 * block_n * 4 + 1024)


def sm90_kernel_name(head_dim: int, block_n: int) -> str:
    """The sm_90a build's ``extern "C"`` name, with a hash of its sources (MLX caches
    modules by name)."""
    return f"prefillq_sparse_sm90_{SM90_TAG}_d{head_dim}_n{block_n}"


@cache
def _sm90_cubin(head_dim: int, block_n: int) -> bytes:
    name = sm90_kernel_name(head_dim, block_n)
    options = (f"-DKERNEL_NAME={name}", f"-DD={head_dim}", f"-DBLOCK_N={block_n}",
               "--use_fast_math")
    return compile_cubin(sm90.PRELUDE + HEADER + sm90.WGMMA + SM90_SOURCE, name + ".cu",
                         sm90.ARCH, options)


def _kernel(head_dim: int, block_n: int):
    key = (head_dim, block_n)
    if key not in _kernels:
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"prefillq_sparse_attention_{source_tag(HEADER, SOURCE)}_d{head_dim}_n{block_n}",
            input_names=["q", "kv", "idx", "sinks", "scale"], output_names=["out"],
            source=SOURCE, header=HEADER, ensure_row_contiguous=False,
            shared_memory=shared_bytes(head_dim, block_n))
    return _kernels[key]


def sparse_attention(q: mx.array, kv: mx.array, idx: mx.array, sinks: mx.array, scale: float,
                     block_n: int | None = None, hopper: bool | None = None) -> mx.array:
    """Each query's attention over the key rows its index list names, with a sink, fused.

    ``out[i, h] = sum_s softmax_s(x_{i,h,s} ; sinks[h]) kv[idx[i, s]]`` with
    ``x_{i,h,s} = scale * q[0, h, i] . kv[idx[i, s]]`` over the slots ``idx[i, s] >= 0``,
    and the sink an extra logit in the softmax's denominator only (DeepSeek-V4 reference
    ``inference/model.py``, ``Attention``; MLX's ``scaled_dot_product_attention(sinks=)``).
    MLX has no fused attention above head dim 128 on CUDA, and a mask cannot express a
    per-query gather. A block runs `HEADS_PER_BLOCK` heads of one query, so the shared KV
    rows are read once per query, not once per head; `bench.gpu_check` compares it with
    `model.archs.deepseek4.sparse.gathered_attention` on the device.

    Args:
        q: bf16 ``(1, H, L, D)``, H a multiple of `HEADS_PER_BLOCK`, D in `HEAD_DIMS`, its
            last dimension contiguous and rows 16-byte aligned (the kernel loads 16 bytes
            at a time; MLX's allocations and slices along the other axes are).
        kv: bf16 ``(N, D)``, the shared key (= value) rows.
        idx: int32 ``(L, K)``, rows of `kv` for each query; -1 marks an empty slot. Rows
            must be below N: not checked here (it would cost a device sync), and the
            kernel would read past `kv`; `model.archs.deepseek4.sparse` builds them.
        sinks: ``(H,)``, the per-head sink logits (cast to float32).
        scale: the score scale.
        block_n: key slots per step: 16 or 32 (default `DEFAULT_BLOCK_N`), with `hopper`
            64 or 32 (default `SM90_BLOCK_N`).
        hopper: True for the sm_90a kernel (``sparse_attention_sm90.cu``: compute capability
            9.0; q, kv and idx are copied to row-contiguous first where they are not), False
            for the mma.sync one, None (default) for the first where
            `flash_attention_sm90.available`.
    Returns:
        bf16 ``(L, H, D)``, equal to `model.archs.deepseek4.sparse.gathered_attention`
        within bf16 rounding (`bench.gpu_check`). A query with no key gets zeros.
    Raises:
        ValueError: inputs `supports` refuses, `idx` not ``(L, K)``, or a `block_n` the
            path does not build.
    """
    hopper = _hopper(hopper)
    sizes = (64, 32) if hopper else (16, 32)
    block_n = block_n or (SM90_BLOCK_N if hopper else DEFAULT_BLOCK_N)
    if block_n not in sizes:
        raise ValueError(f"block_n must be {sizes[0]} or {sizes[1]} key slots per step; "
                         f"got {block_n}")
    if not supports(q, kv):
        raise ValueError(f"sparse_attention takes bf16, head dim in {HEAD_DIMS}, heads in "
                         f"multiples of {HEADS_PER_BLOCK} and one batch; got {q.dtype} q "
                         f"{q.shape}, kv {kv.dtype} {kv.shape}")
    _, H, L, D = q.shape
    if idx.ndim != 2 or idx.shape[0] != L or kv.ndim != 2 or kv.shape[1] != D:
        raise ValueError(f"idx must be (L={L}, K) and kv (N, {D}); got idx {idx.shape}, "
                         f"kv {kv.shape}")
    if hopper:
        return _sm90_launch(q, kv, idx, sinks, scale, block_n)
    (out,) = _kernel(D, block_n)(
        inputs=[q, mx.contiguous(kv), mx.contiguous(idx.astype(mx.int32)),
                sinks.astype(mx.float32), _float32s(scale)],
        template=[("D", D), ("BLOCK_N", block_n), ("PAD", PAD)],
        grid=(L * 32 * WARPS, H // HEADS_PER_BLOCK, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(L, H, D)], output_dtypes=[q.dtype])
    return out


def _sm90_launch(q: mx.array, kv: mx.array, idx: mx.array, sinks: mx.array, scale: float,
                 block_n: int) -> mx.array:
    """``sparse_attention_sm90.cu`` over one block per query and 64 heads (inputs checked by
    `sparse_attention`)."""
    _, H, L, D = q.shape
    return mx.fast.precompiled_cuda_kernel(
        name=sm90_kernel_name(D, block_n), compiled_source=_sm90_cubin(D, block_n),
        inputs=[q, kv, idx.astype(mx.int32), sinks.astype(mx.float32), _float32s(scale)],
        output_shapes=[(L, H, D)], output_dtypes=[q.dtype], scalars=[H, L, idx.shape[1]],
        grid=(L * SM90_THREADS, H // HEADS_PER_BLOCK, 1), threadgroup=(SM90_THREADS, 1, 1),
        shared_memory=sm90_shared_bytes(D, block_n), ensure_row_contiguous=True)[0]
