"""Every ``mx.fast.cuda_kernel`` body this package launches compiles for the H100/H200
(sm_90) as MLX's CUDA backend wraps it, in each variant and with the template arguments its
Python entry point passes (`tests.model.mlx_cuda_kernel`): a typo, an undeclared name or a
wrong type in a kernel's CUDA fails here, on a machine without a GPU, instead of on the first
GPU that runs it. What the kernels compute is checked on a GPU (``bench.gpu --check``)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from model.kernels import flash_attention as fa
from model.kernels import gelu, qk_norm_rope, sparse_attention
from tests.model.mlx_cuda_kernel import EmulatedKernels


def _forget_built_kernels() -> None:
    fa._kernels.clear()
    sparse_attention._kernels.clear()
    gelu._kernel.cache_clear()
    qk_norm_rope._kernel.cache_clear()


@pytest.fixture
def kernels(monkeypatch):
    """`EmulatedKernels` in place of ``mx.fast.cuda_kernel``, the modules' built kernels
    forgotten before and after."""
    emulated = EmulatedKernels()
    _forget_built_kernels()
    monkeypatch.setattr(mx.fast, "cuda_kernel", emulated.cuda_kernel)
    yield emulated
    _forget_built_kernels()


def _bf16(*shape: int) -> mx.array:
    return mx.zeros(shape, dtype=mx.bfloat16)


@pytest.mark.parametrize("warps", [4, 8])
def test_flash_attention_compiles_in_every_variant(kernels, warps):
    q, k = _bf16(1, 8, 64, 256), _bf16(1, 2, 64, 256)
    fa.flash_attention(q, k, k, 0.06, 0, None, warps=warps, hopper=False)
    long_keys = _bf16(1, 2, 8192, 256)  # a few query blocks over many keys: split
    fa.flash_attention(q, long_keys, long_keys, 0.06, 8192 - 64, None, warps=warps,
                       hopper=False)
    jobs = (*fa.fresh_jobs((30, 20)), fa.PackedJob(14, 14 + 500, 500))
    keys = _bf16(1, 2, 564, 256)
    fa.packed_flash_attention(q, keys, keys, 0.06, jobs, 512, warps=warps, hopper=False)
    names = [name for name, _ in kernels.compiled]
    assert [n.rsplit("_w", 1)[1] for n in names] == [f"{warps}", f"{warps}_split",
                                                     f"{warps}_packed"]


def test_the_gelu_gate_compiles(kernels, monkeypatch):
    monkeypatch.setattr(gelu, "available", lambda: True)
    gelu.fused_gelu_gate(_bf16(37, 2 * 2048))
    gelu.fused_gelu_gate(_bf16(2, 19, 2 * 2048))  # rows from the input's shape: one build
    assert kernels.compiled == [(kernels.compiled[0][0], (("I", 2048),))] * 2


def test_the_qk_norm_rope_kernel_compiles(kernels, monkeypatch):
    monkeypatch.setattr(qk_norm_rope, "available", lambda: True)
    heads, kv_heads = 8, 4
    qkv = _bf16(33, (heads + 2 * kv_heads) * 256)
    norm = mx.ones((256,), dtype=mx.bfloat16)
    q, k, v = qk_norm_rope.qk_norm_rope(qkv, mx.arange(33), norm, norm, heads=heads,
                                        kv_heads=kv_heads, base=1e6, scale=0.125, eps=1e-6)
    assert (q.shape, k.shape, v.shape) == ((1, 8, 33, 256), (1, 4, 33, 256), (1, 4, 33, 256))
    assert kernels.compiled[0][1] == (("H", 8), ("KV", 4))


@pytest.mark.parametrize("block_n", [16, 32])
def test_the_sparse_attention_kernel_compiles(kernels, block_n):
    q, kv = _bf16(1, 64, 5, 512), _bf16(40, 512)
    idx = mx.zeros((5, 24), dtype=mx.int32)
    sparse_attention.sparse_attention(q, kv, idx, mx.zeros((64,)), 0.04, block_n=block_n,
                                      hopper=False)
    assert kernels.compiled[0][1] == (("D", 512), ("BLOCK_N", block_n), ("PAD", 8))
