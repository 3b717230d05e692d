"""Fused causal flash attention on CUDA for head dims MLX leaves unfused (256).

MLX's CUDA `scaled_dot_product_attention` fuses only head dims up to 128 (cuDNN) or short
queries; Gemma 3's heads are 256 wide. ``flash_attention.cu`` is FlashAttention-2's forward
pass on mma.sync tensor cores (bf16 in, fp32 accumulation), compiled by NVRTC on first use.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from . import HEADER, ONE, PACKED, SPLIT, source_tag
from . import flash_attention_sm90 as sm90

SOURCE = (Path(__file__).with_name("flash_attention.cu")).read_text()
HEAD_DIMS = (256,)
ROWS_PER_WARP = 16  # an mma tile's rows
DEFAULT_WARPS = 4
QUERIES_PER_BLOCK = ROWS_PER_WARP * DEFAULT_WARPS  # flash_attention.cu's BLOCK_M
DEFAULT_BLOCK_N = 64
PAD = 8  # bf16 elements of shared-memory row padding: rows 4 banks apart, no conflicts

# "0" turns the kernel off (the unfused MLX path then runs on CUDA too), for side-by-side
# measurements and as an escape hatch.
ENV = "PREFILLQ_FUSED_ATTENTION"

# Blocks that keep every SM of a large GPU busy (an H200 has 132): a chunk of fewer query
# blocks than this splits its keys over more blocks (FlashDecoding's split-K).
TARGET_BLOCKS = 264
# A split gets at least this many key blocks (2,048 keys): the combine costs the host four
# more ops and the device an fp32 round trip of the output, which only long key ranges
# repay (on the H200, Gemma 3's sliding layers see 9 blocks: docs/benchmarks.md has the
# ablation).
MIN_KEY_BLOCKS_PER_SPLIT = 32

# The sm_90a path's block (`model.kernels.flash_attention_sm90`): warpgroups of 64 queries
# (4 warps' worth of rows each) over `sm90.BLOCK_N` keys a step; its default build.
SM90_BLOCK_N, SM90_WARPS = sm90.BLOCK_N, 4 * sm90.WARPGROUPS
# The sm_90a plan splits keys only for grids of fewer blocks than this whose blocks see
# more keys than that (`sm90_plan`).
SM90_SPLIT_BELOW_BLOCKS, SM90_SPLIT_ABOVE_KEYS = sm90.MULTIPROCESSORS // 4, 32_768

_kernels: dict[tuple[int, int, str, int], object] = {}
_DEFINES = {ONE: "", SPLIT: "#define PREFILLQ_SPLIT 1\n", PACKED: "#define PREFILLQ_PACKED 1\n"}


@cache
def available() -> bool:
    """True when MLX's default device is a CUDA GPU (the kernel's only target) and
    ``$PREFILLQ_FUSED_ATTENTION`` is not ``0``. Read once per process."""
    return (os.environ.get(ENV, "1") != "0" and mx.default_device() == mx.gpu
            and mx.cuda.is_available())


def applies(q: mx.array, keys: mx.array) -> bool:
    """Whether a model's attention runs through `flash_attention` (`available` and
    `supports`)."""
    return available() and supports(q, keys)


def supports(q: mx.array, keys: mx.array) -> bool:
    """Whether `flash_attention` takes these inputs: bf16, a supported head dim, and
    whole KV groups."""
    return (q.dtype == mx.bfloat16 and keys.dtype == mx.bfloat16 and q.shape[-1] in HEAD_DIMS
            and q.shape[1] % keys.shape[1] == 0)


def shared_bytes(head_dim: int, block_n: int, warps: int = DEFAULT_WARPS) -> int:
    """Dynamic shared memory of one block: the Q tile and a K and a V tile, padded rows."""
    return (ROWS_PER_WARP * warps + 2 * block_n) * (head_dim + PAD) * 2


def _kernel(head_dim: int, block_n: int, variant: str, warps: int):
    key = (head_dim, block_n, variant, warps)
    if key not in _kernels:
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"prefillq_flash_attention_{source_tag(HEADER, SOURCE)}_d{head_dim}"
                 f"_n{block_n}_w{warps}{'' if variant == ONE else '_' + variant}",
            input_names=["q", "k", "v", "params", "scale", *(["blocks"] * (variant == PACKED))],
            output_names=["out", "lse"] if variant == SPLIT else ["out"],
            source=SOURCE, header=_DEFINES[variant] + HEADER, ensure_row_contiguous=False,
            shared_memory=shared_bytes(head_dim, block_n, warps))
    return _kernels[key]


@lru_cache(maxsize=256)
def _int32s(*values: int) -> mx.array:
    """One int32 array per distinct tuple: a chunk's layers of a kind share their kernel
    parameters, so the host builds them once (MLX arrays are immutable)."""
    return mx.array(values, dtype=mx.int32)


@lru_cache(maxsize=16)
def _float32s(*values: float) -> mx.array:
    return mx.array(values, dtype=mx.float32)


class GridPlan(NamedTuple):
    """A launch's grid: query blocks per head, key splits, and warps per block (the sm_90a
    path's: 4 per warpgroup)."""

    q_blocks: int
    splits: int
    warps: int


def splits_for(q_blocks: int, key_blocks: int, target: int = TARGET_BLOCKS) -> int:
    """Key splits for a grid of `q_blocks` blocks over up to `key_blocks` key blocks each:
    enough to reach `target` blocks, each split `MIN_KEY_BLOCKS_PER_SPLIT` or more."""
    want = -(-target // max(q_blocks, 1))
    return max(1, min(want, key_blocks // MIN_KEY_BLOCKS_PER_SPLIT))


def block_keys(N: int, window: int | None, rows: int) -> int:
    """Keys a block of `rows` consecutive queries may see among `N`: every one, or under a
    sliding `window` at most ``window + rows``."""
    return min(N, window + rows) if window else N


def grid_plan(B: int, H: int, L: int, N: int, window: int | None, block_n: int = DEFAULT_BLOCK_N,
              warps: int = DEFAULT_WARPS, target: int = TARGET_BLOCKS) -> GridPlan:
    """The mma.sync kernel's grid for `L` queries of `H` heads (batch `B`) over `N` keys: a
    block sees at most ``window + rows`` keys; splits reach `target` blocks (`splits_for`)."""
    rows = ROWS_PER_WARP * warps
    q_blocks = -(-L // rows)
    visible = block_keys(N, window, rows)
    return GridPlan(q_blocks, splits_for(q_blocks * H * B, -(-visible // block_n), target),
                    warps)


def sm90_plan(B: int, H: int, L: int, N: int, window: int | None) -> GridPlan:
    """The sm_90a kernel's grid for `L` queries of `H` heads (batch `B`) over `N` keys.

    Two warpgroups (128 queries a block), and keys split only where the grid has fewer than
    `SM90_SPLIT_BELOW_BLOCKS` blocks and a block sees more than `SM90_SPLIT_ABOVE_KEYS`
    keys, then into as many splits as bring the grid to half the multiprocessors,
    `MIN_KEY_BLOCKS_PER_SPLIT` or more key blocks each. A split loads the block's Q again,
    writes fp32 partials and adds `_combine`'s pass. On an H100, each kernel timed on the
    device alone (``python -m bench.gpu_attention --sweep-plan``: docs/benchmarks.md, "The
    grid plan" under "The Hopper path"): at Gemma 3's chunks (64-256 blocks) and at short
    chunks after 16K keys (4-64 blocks), two warpgroups unsplit beat every split and every
    one-warpgroup grid (64 queries, twice the blocks); after 64K keys, grids of 16 and 32
    blocks ran fastest split to 64 blocks (1.08-1.35x unsplit), and more splits were slower.
    """
    sms, rows = sm90.MULTIPROCESSORS, ROWS_PER_WARP * SM90_WARPS
    visible = block_keys(N, window, rows)
    q_blocks = -(-L // rows)
    grid = q_blocks * H * B
    if grid >= SM90_SPLIT_BELOW_BLOCKS or visible <= SM90_SPLIT_ABOVE_KEYS:
        return GridPlan(q_blocks, 1, SM90_WARPS)
    key_blocks = -(-visible // SM90_BLOCK_N)
    splits = max(1, min(sms // 2 // grid, key_blocks // MIN_KEY_BLOCKS_PER_SPLIT))
    return GridPlan(q_blocks, splits, SM90_WARPS)


def _hopper(wanted: bool | None) -> bool:
    """Whether to take the sm_90a path: `wanted`, or where None whether it is available."""
    return sm90.available() if wanted is None else wanted


def plan(B: int, H: int, L: int, N: int, window: int | None, block_n: int = DEFAULT_BLOCK_N,
         warps: int = DEFAULT_WARPS, hopper: bool = False) -> GridPlan:
    """The grid of the path `flash_attention` takes: the mma.sync kernel's at `block_n` and
    `warps` (`grid_plan`), or with `hopper` the sm_90a kernel's (`sm90_plan`)."""
    if hopper:
        return sm90_plan(B, H, L, N, window)
    return grid_plan(B, H, L, N, window, block_n, warps)


def flash_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float,
                    position: int, window: int | None, block_n: int = DEFAULT_BLOCK_N,
                    warps: int = DEFAULT_WARPS, hopper: bool | None = None) -> mx.array:
    """Causal (optionally sliding-window) attention of a chunk, fused.

    Args:
        q: bf16 ``(B, H, L, D)``, queries at positions ``[position, position + L)``; D in
            `HEAD_DIMS`; its last dimension contiguous.
        keys, values: bf16 ``(B, KVH, N, D)``, the first key at position
            ``position - (N - L)`` (what `model.kv_cache`'s ``update`` returns); H a
            multiple of KVH.
        scale: the score scale.
        position: the chunk's first position.
        window: the sliding window (a query at p sees keys in ``(p - window, p]``), or None;
            key blocks wholly outside it are never loaded.
        block_n: keys per step (a multiple of 16; the mma.sync path's).
        warps: warps per block, 16 queries each (the mma.sync path's).
        hopper: True for the wgmma path (`model.kernels.flash_attention_sm90`: compute
            capability 9.0, 128 queries a block, 64 keys a step), False for mma.sync,
            None for the wgmma path where
            `flash_attention_sm90.available` (every H100/H200 unless
            ``$PREFILLQ_HOPPER_ATTENTION=0``).
    Returns:
        bf16 ``(B, H, L, D)``, equal to `model.archs._attention.blocked_attention` within bf16
        rounding (`bench.gpu_attention` checks it).
    Raises:
        ValueError: inputs `supports` refuses.
    """
    if not supports(q, keys):
        raise ValueError(f"flash_attention takes bf16, head dim in {HEAD_DIMS} and whole KV "
                         f"groups; got {q.dtype} q {q.shape}, keys {keys.dtype} {keys.shape}")
    B, H, L, D = q.shape
    KVH, N = keys.shape[1], keys.shape[2]
    hopper = _hopper(hopper)
    q_blocks, splits, warps = plan(B, H, L, N, window, block_n, warps, hopper)
    params = _int32s(position, position - (N - L), window or 0, L, N, splits)
    inputs = [q, keys, values, params, _float32s(scale)]
    if hopper:
        warpgroups = warps // 4
        if splits == 1:
            return sm90.launch(ONE, *inputs, q_blocks, 1, [(B, H, L, D)], [q.dtype],
                               warpgroups=warpgroups)[0]
        parts, lse = sm90.launch(SPLIT, *inputs, q_blocks, splits,
                                 [(B, H, splits, L, D), (B, H, splits, L)],
                                 [mx.float32, mx.float32], warpgroups=warpgroups)
        return _combine(parts, lse, q.dtype)
    template = [("D", D), ("BLOCK_N", block_n), ("GROUP", H // KVH), ("PAD", PAD),
                ("WARPS", warps)]
    threads = 32 * warps
    grid = (q_blocks * threads, H, B * splits)
    if splits == 1:
        (out,) = _kernel(D, block_n, ONE, warps)(
            inputs=inputs, template=template, grid=grid, threadgroup=(threads, 1, 1),
            output_shapes=[(B, H, L, D)], output_dtypes=[q.dtype])
        return out
    parts, lse = _kernel(D, block_n, SPLIT, warps)(
        inputs=inputs, template=template, grid=grid, threadgroup=(threads, 1, 1),
        output_shapes=[(B, H, splits, L, D), (B, H, splits, L)],
        output_dtypes=[mx.float32, mx.float32])
    return _combine(parts, lse, q.dtype)


def _combine(parts: mx.array, lse: mx.array, dtype: mx.Dtype) -> mx.array:
    """The key splits' float32 outputs ``(B, H, splits, L, D)``, each weighted by its share
    of the softmax's denominator (from the log-sum-exps ``(B, H, splits, L)``), summed in
    split order and cast to `dtype`: ``(B, H, L, D)`` (FlashDecoding's combine)."""
    return _weighted_sum(parts.shape[2], dtype)(parts, mx.softmax(lse, axis=2))


@cache
def _weighted_sum(splits: int, dtype: mx.Dtype):
    """``sum_s weights[:, :, s, :, None] * parts[:, :, s]`` as `dtype`, compiled: one fused
    pass over the parts, where a weighted product array and a reduction over it read and
    wrote every part three times (a split cost ~0.1 ms on an H100 at Gemma's chunk sizes:
    docs/benchmarks.md, "The grid plan")."""
    def weighted_sum(parts: mx.array, weights: mx.array) -> mx.array:
        out = parts[:, :, 0] * weights[:, :, 0, :, None]
        for s in range(1, splits):
            out = out + parts[:, :, s] * weights[:, :, s, :, None]
        return out.astype(dtype)

    return mx.compile(weighted_sum)


class PackedJob(NamedTuple):
    """One job's share of a `packed_flash_attention` launch: its chunk's `rows` queries
    attend to its `keys` keys, the last `rows` of which are the chunk's own; the chunk starts
    at `position`, so its first key is at ``position - (keys - rows)`` (what a cache's
    ``update`` returns). A job's first chunk is ``PackedJob(n, n, 0)``."""

    rows: int
    keys: int
    position: int


def fresh_jobs(lengths: Sequence[int]) -> tuple[PackedJob, ...]:
    """Jobs at position 0 attending to their own `lengths` rows only."""
    return tuple(PackedJob(n, n, 0) for n in lengths)


@lru_cache(maxsize=64)
def query_blocks(jobs: tuple[PackedJob, ...], rows: int) -> mx.array:
    """The table `packed_flash_attention` launches a block per row of: int32 ``(blocks,
    6)``, per block its job's first query row, its query rows, the block's index within the
    job, the job's first key row, its keys and its chunk's position, for `jobs` whose
    queries lie one after another and whose keys lie one after another, `rows` queries a
    block (a step's layers of one kind share it)."""
    table, q_row, k_row = [], 0, 0
    for job in jobs:
        table += [(q_row, job.rows, m, k_row, job.keys, job.position)
                  for m in range(-(-job.rows // rows))]
        q_row, k_row = q_row + job.rows, k_row + job.keys
    return mx.array(table, dtype=mx.int32)


def packed_flash_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float,
                           jobs: Sequence[PackedJob], window: int | None,
                           block_n: int = DEFAULT_BLOCK_N, warps: int = DEFAULT_WARPS,
                           hopper: bool | None = None) -> mx.array:
    """`flash_attention` of several jobs' chunks in one launch, each against its own keys
    (FlashAttention-2's variable-length layout, Dao 2023, with the per-block table on the
    host): jobs' first chunks, which see only their own rows, and later chunks, which see
    the keys their caches returned.

    Args:
        q: bf16 ``(1, H, T, D)``, the jobs' queries one after another along ``T``, the sum
            of their ``rows``; D in `HEAD_DIMS`; its last dimension contiguous.
        keys, values: bf16 ``(1, KVH, S, D)``, each job's keys and values one after another
            along ``S``, the sum of their ``keys`` (for first chunks, the same rows as `q`'s);
            H a multiple of KVH.
        scale: the score scale.
        jobs: each job's rows, keys and position (`PackedJob`; `fresh_jobs` for first
            chunks), in order.
        window: the sliding window, or None (as `flash_attention`).
        block_n, warps, hopper: as `flash_attention`'s.
    Returns:
        bf16 ``(1, H, T, D)``: each job's rows as `flash_attention` gives them for that job
        alone.
    Raises:
        ValueError: inputs `supports` refuses, more than one batch entry, jobs whose rows or
            keys do not sum to ``T`` and ``S``, or a job with fewer keys than rows or keys
            before position 0.
    """
    jobs = tuple(PackedJob(*job) for job in jobs)
    if (not supports(q, keys) or q.shape[0] != 1 or sum(j.rows for j in jobs) != q.shape[2]
            or sum(j.keys for j in jobs) != keys.shape[2]
            or any(j.rows < 1 or j.keys < j.rows or j.position < j.keys - j.rows
                   for j in jobs)):
        raise ValueError(f"packed_flash_attention takes bf16 (1, H, sum(rows), D) queries and "
                         f"(1, KVH, sum(keys), D) keys with D in {HEAD_DIMS}, whole KV groups "
                         f"and each job's keys ending at its rows; got {q.dtype} q {q.shape}, "
                         f"keys {keys.dtype} {keys.shape}, jobs {list(jobs)}")
    _, H, T, D = q.shape
    params = _int32s(0, 0, window or 0, 0, 0, 1)
    if _hopper(hopper):
        blocks = query_blocks(jobs, ROWS_PER_WARP * SM90_WARPS)
        return sm90.launch(PACKED, q, keys, values, params, _float32s(scale),
                           blocks.shape[0], 1, [(1, H, T, D)], [q.dtype], blocks=blocks)[0]
    rows = ROWS_PER_WARP * warps
    blocks = query_blocks(jobs, rows)
    threads = 32 * warps
    (out,) = _kernel(D, block_n, PACKED, warps)(
        inputs=[q, keys, values, params, _float32s(scale), blocks],
        template=[("D", D), ("BLOCK_N", block_n), ("GROUP", H // keys.shape[1]),
                  ("PAD", PAD), ("WARPS", warps)],
        grid=(blocks.shape[0] * threads, H, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(1, H, T, D)], output_dtypes=[q.dtype])
    return out
