"""DeepSeek-V4's key-list kernel on sm_90a, its host side on the CPU: NVRTC builds it (no GPU
needed to compile), its products run on warpgroup MMA without spills, its block fits a
Hopper multiprocessor, and the path is taken only when asked. Its results are checked on
the GPU: `python -m bench.gpu --check` (``sparse_attention_check``, path ``sm90 wgmma``)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from model.kernels import sparse_attention as sa
from tests.model.sass import disassemble, hgmma_shapes, nvrtc_or_skip, spills

# Hopper's largest opt-in dynamic shared memory a block (H100/H200: 227 KB)
HOPPER_SHARED_BYTES = 227 * 1024


@pytest.mark.parametrize("block_n, hgmma", [
    # a step: S over one warpgroup's 256 dims is 16 k-steps (n = the step's key slots), and
    # O += P V over its 4 regions of 64 dims x block_n / 16 k-steps of m64n64k16
    (64, {"64x64x16": 16 + 16}),
    (32, {"64x32x16": 16, "64x64x16": 4 * 2}),
])
def test_the_products_run_on_warpgroup_mma_without_spills(block_n, hgmma, tmp_path):
    nvrtc_or_skip()
    cubin = sa._sm90_cubin(512, block_n)
    assert sa.sm90_kernel_name(512, block_n).encode() in cubin   # MLX looks it up by name
    sass = disassemble(cubin, tmp_path)
    assert hgmma_shapes(sass) == hgmma
    assert not spills(sass)


def test_a_block_fits_a_hopper_multiprocessor():
    # Q (64 heads x 512), two key tiles of 64 slots, two warpgroups' fp32 S halves (64 x 64
    # each), two tiles' indices, 1 KB of alignment: 225.5 KB of the 227
    assert sa.sm90_shared_bytes(512) == (64 + 2 * 64) * 512 * 2 + 2 * 64 * 64 * 4 + 512 + 1024
    assert sa.sm90_shared_bytes(512) <= HOPPER_SHARED_BYTES
    assert sa.sm90_shared_bytes(512, 32) < sa.sm90_shared_bytes(512)


def test_the_sm90_build_takes_its_own_step_sizes():
    q, kv = mx.zeros((1, 64, 4, 512), dtype=mx.bfloat16), mx.zeros((10, 512), dtype=mx.bfloat16)
    idx, sinks = mx.zeros((4, 2), mx.int32), mx.zeros((64,))
    with pytest.raises(ValueError, match="64 or 32"):
        sa.sparse_attention(q, kv, idx, sinks, 1.0, block_n=16, hopper=True)
    with pytest.raises(ValueError, match="16 or 32"):
        sa.sparse_attention(q, kv, idx, sinks, 1.0, block_n=64)
