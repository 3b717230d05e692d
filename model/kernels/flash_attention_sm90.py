"""The fused attention kernel's Hopper path: warpgroup MMA (`wgmma`) on sm_90a.

``flash_attention_sm90.cu`` computes what ``flash_attention.cu`` computes (the same
inputs, variants, masking and split plan) with FlashAttention-3's matrix products: 64 query
rows per warpgroup, S = Q K^T and O += P V as asynchronous warpgroup MMAs over swizzled
shared-memory tiles, P from registers. MLX's own JIT targets plain sm_90, where `wgmma` is
refused, so the source goes through NVRTC (`model.kernels.nvrtc`) for sm_90a and runs through
`mx.fast.precompiled_cuda_kernel`. `model.kernels.flash_attention` takes this path on a
compute capability 9.0 GPU unless ``$PREFILLQ_HOPPER_ATTENTION`` is ``0`` (then mma.sync, as
on other GPUs). The kernel is checked by ``python -m bench.gpu_attention`` and the models'
path with it by ``python -m bench.gpu --check`` (docs/benchmarks.md, "The Hopper path").
With ``$PREFILLQ_HOPPER_TMA=1`` a producer warpgroup brings Q, K and V through the bulk
tensor copy engine (`TMA`; the source's and tma.cuh's comments say how): checked on an H100
and no faster there than the consumers' own cp.async copies, so off by default.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

import mlx.core as mx

from . import HEADER, ONE, PACKED, SPLIT, source_tag
from .nvrtc import NvrtcError, compile_cubin

SOURCE = Path(__file__).with_name("flash_attention_sm90.cu").read_text()
# wgmma's swizzle, descriptors, products and fences: every sm_90a kernel's second header
WGMMA = Path(__file__).with_name("wgmma.cuh").read_text()
# the bulk tensor copy engine: tensor maps built on the device, copies, mbarriers
TMA_HEADER = Path(__file__).with_name("tma.cuh").read_text()
# NVRTC has no C library headers: the fixed-width types the kernels use
PRELUDE = ("typedef unsigned short uint16_t;\ntypedef unsigned int uint32_t;\n"
           "typedef unsigned long long uint64_t;\n")
ENV = "PREFILLQ_HOPPER_ATTENTION"
ARCH = "sm_90a"
BLOCK_N = 64          # keys a step: the n of S's wgmma (m64n64k16); 32 builds too
                      # (m64n32k16: half the K/V tiles, for `bench.gpu_attention --sweep`)
WARPGROUPS = 2        # 128 query rows a block, 64 a warpgroup (one builds too, for
                      # `bench.gpu_attention`'s sweeps)
STAGES = 2            # K/V buffers: the next tile loads while this one is used
PINGPONG = True       # two warpgroups take turns issuing S within a step (the source's
                      # TAKE_TURNS): 2-5% faster on an H100 (`bench.gpu_attention --sweep`)
# A producer warpgroup loads Q, K and V by the bulk tensor copy engine (the consumers copy
# them by cp.async without it): with $PREFILLQ_HOPPER_TMA=1, read once at import
TMA_ENV = "PREFILLQ_HOPPER_TMA"
TMA = os.environ.get(TMA_ENV) == "1"
MAP_BYTES = 384       # the TMA build's scratch output: three 128-byte tensor maps a block
# One block fills a multiprocessor (its shared memory), and an H100 SXM or H200 has 132:
# `flash_attention.sm90_plan` sizes its grids by them
MULTIPROCESSORS = 132
# the source's hash, in every variant's name (computed once: names are built per launch)
TAG = source_tag(HEADER, WGMMA, TMA_HEADER, SOURCE)
_DEFINES = {ONE: (), SPLIT: ("-DPREFILLQ_SPLIT=1",), PACKED: ("-DPREFILLQ_PACKED=1",)}


def compute_capability() -> tuple[int, int] | None:
    """``(major, minor)`` of MLX's default GPU from `mx.device_info`'s architecture (such
    as ``"sm_90"``), or None off CUDA or where it does not say."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return None
    arch = str(mx.device_info().get("architecture", ""))
    digits = re.search(r"(\d+)", arch)
    if not digits or len(digits.group(1)) < 2:
        return None
    return int(digits.group(1)[:-1]), int(digits.group(1)[-1])


@cache
def available() -> bool:
    """True on a compute capability 9.0 GPU (H100, H200) where a kernel NVRTC compiles,
    unless ``$PREFILLQ_HOPPER_ATTENTION`` is ``0``; read once per process."""
    if os.environ.get(ENV) == "0" or compute_capability() != (9, 0):
        return False
    try:
        _cubin(256, ONE, BLOCK_N, WARPGROUPS, STAGES)
    except NvrtcError:
        return False
    return True


def shared_bytes(head_dim: int, block_n: int = BLOCK_N, warpgroups: int = WARPGROUPS,
                 stages: int = STAGES, tma: bool = TMA) -> int:
    """Dynamic shared memory of one block: the Q tile, `stages` K and V tiles, 1 KB to
    align them to the swizzle's 1,024-byte atoms, and with `tma` 512 bytes for the
    barriers (128) and three tensor maps' staging (3 x 128)."""
    return (64 * warpgroups + 2 * stages * block_n) * head_dim * 2 + 1024 + (512 if tma else 0)


def threads(warpgroups: int = WARPGROUPS, tma: bool = TMA) -> int:
    """Threads of one block: 128 a consumer warpgroup, and with `tma` the producer's."""
    return 128 * (warpgroups + (1 if tma else 0))


def kernel_name(head_dim: int, variant: str, block_n: int, warpgroups: int, stages: int,
                pingpong: bool = PINGPONG, tma: bool = TMA) -> str:
    """The ``extern "C"`` name of one compiled variant (MLX caches modules by it, so it
    carries a hash of the source: `model.kernels.source_tag`)."""
    return (f"prefillq_fa_sm90_{TAG}_d{head_dim}_n{block_n}_wg{warpgroups}_s{stages}"
            f"{'_pp' if pingpong else ''}{'_tma' if tma else ''}_{variant}")


@cache
def _cubin(head_dim: int, variant: str, block_n: int, warpgroups: int, stages: int,
           pingpong: bool = PINGPONG, tma: bool = TMA) -> bytes:
    name = kernel_name(head_dim, variant, block_n, warpgroups, stages, pingpong, tma)
    options = (f"-DKERNEL_NAME={name}", f"-DD={head_dim}", f"-DBLOCK_N={block_n}",
               f"-DWARPGROUPS={warpgroups}", f"-DSTAGES={stages}",
               f"-DPINGPONG={int(pingpong)}", f"-DTMA={int(tma)}",
               "--use_fast_math", *_DEFINES[variant])
    return compile_cubin(PRELUDE + HEADER + WGMMA + TMA_HEADER + SOURCE, name + ".cu", ARCH,
                         options)


def launch(variant: str, q: mx.array, keys: mx.array, values: mx.array,
           params: mx.array, scale: mx.array, grid_x_blocks: int, splits: int,
           output_shapes: list[tuple[int, ...]], output_dtypes: list[mx.Dtype],
           blocks: mx.array | None = None, block_n: int = BLOCK_N,
           warpgroups: int = WARPGROUPS, stages: int = STAGES,
           pingpong: bool = PINGPONG, tma: bool = TMA) -> list[mx.array]:
    """Launch one variant over `grid_x_blocks` query blocks x H heads x (B x `splits`).

    Args:
        variant: `ONE`, `SPLIT` or `PACKED` (as ``flash_attention.cu``'s).
        q: bf16 ``(B, H, Lq, D)``; keys, values: bf16 ``(B, KVH, N, D)``; copied to
            row-contiguous first where they are not (MLX does it).
        params: int32 ``[position, k_start, window, L, N, splits]``; scale: float32 ``[1]``.
        blocks: the packed variant's int32 ``(blocks, 6)`` table (`query_blocks`).
        block_n, warpgroups, stages, pingpong, tma: the build (`BLOCK_N`, `WARPGROUPS`,
            `STAGES`, `PINGPONG`, `TMA`).
    Returns:
        The kernel's outputs, as `output_shapes` and `output_dtypes` say (with `tma`, the
        blocks' tensor maps, a scratch output, are dropped).
    """
    B, H, Lq, D = q.shape
    block = threads(warpgroups, tma)
    inputs = [q, keys, values, params, scale] + ([blocks] if blocks is not None else [])
    maps = [(grid_x_blocks * H * B * splits * MAP_BYTES,)] if tma else []
    outputs = mx.fast.precompiled_cuda_kernel(
        name=kernel_name(D, variant, block_n, warpgroups, stages, pingpong, tma),
        compiled_source=_cubin(D, variant, block_n, warpgroups, stages, pingpong, tma),
        inputs=inputs, output_shapes=list(output_shapes) + maps,
        output_dtypes=list(output_dtypes) + [mx.uint8] * len(maps),
        scalars=[H, keys.shape[1], Lq, keys.shape[2]],
        grid=(grid_x_blocks * block, H, B * splits), threadgroup=(block, 1, 1),
        shared_memory=shared_bytes(D, block_n, warpgroups, stages, tma),
        ensure_row_contiguous=True)
    return outputs[:len(output_shapes)]
