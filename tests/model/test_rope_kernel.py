"""`model.kernels.rope` on the CPU: its dispatch rules and refusals, and the MLX-ops form it
replaces on a GPU (the kernel runs on a CUDA GPU only; `python -m bench.gpu --check` checks
it there against these ops)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.archs.deepseek4 import flash_args
from model.archs.deepseek4 import layers as ds_layers
from model.kernels import rope as fused_rope


def test_the_cpu_never_takes_the_fused_path():
    assert not fused_rope.applies(mx.zeros((1, 4, 2, 512), dtype=mx.bfloat16), 64)


def test_supports_bf16_rows_of_a_multiple_of_64():
    x = mx.zeros((1, 4, 2, 512), dtype=mx.bfloat16)
    assert fused_rope.supports(x, 64) and fused_rope.supports(x[..., :128], 64)
    assert not fused_rope.supports(x.astype(mx.float32), 64)
    assert not fused_rope.supports(x[..., :96], 64)  # 96 dims: not a multiple of 64
    assert not fused_rope.supports(x, 63) and not fused_rope.supports(x, 514)
    assert not fused_rope.supports(x[0], 64)  # (L, N, D): not 4-D


def test_rope_refuses_tables_of_the_wrong_shape():
    x = mx.zeros((1, 4, 2, 512), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="tables"):
        fused_rope.rope(x, mx.zeros((3, 32)), mx.zeros((3, 32)))
    with pytest.raises(ValueError, match="tables"):
        fused_rope.rope(x.astype(mx.float32), mx.zeros((4, 32)), mx.zeros((4, 32)))


def test_the_ops_form_norms_then_rotates_only_the_tail():
    """`layers.rope` with `norm_eps`: the row scaled to unit RMS, its first D - 64 dims kept,
    the last 64 rotated pair by pair (each pair's length kept); the inverse undoes it."""
    args = flash_args()
    inv_freq = ds_layers.rope_inv_freq(args, 4)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 3, 2, 512), dtype=np.float32) * 5)
    positions = np.array([0, 7, 100_000])
    eps = args.rms_norm_eps
    normed = np.array(x) / np.sqrt((np.array(x) ** 2).mean(-1, keepdims=True) + eps)
    out = np.array(ds_layers.rope(x, positions, inv_freq, norm_eps=eps))
    np.testing.assert_allclose(out[..., :448], normed[..., :448], rtol=1e-6)
    pair_norm = lambda a: np.hypot(a[..., 448::2], a[..., 449::2])  # noqa: E731
    np.testing.assert_allclose(pair_norm(out), pair_norm(normed), rtol=1e-5)
    assert np.abs(out[0, 0, ..., 448:] - normed[0, 0, ..., 448:]).max() < 1e-6  # position 0
    assert np.abs(out[0, 2, ..., 448:] - normed[0, 2, ..., 448:]).max() > 0.1
    back = np.array(ds_layers.rope(mx.array(out), positions, inv_freq, inverse=True))
    np.testing.assert_allclose(back, normed, atol=1e-5)
