"""DeepSeek-V4's RoPE angles (`layers.angle_table`): a chunk's and its compressed rows'
positions sliced from the device table equal the angles computed for the call, the table
grows past its first 4,096 positions, and other positions are computed directly; `rope`
rotates only the last dims, and its inverse undoes it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.archs.deepseek4 import flash_args
from model.archs.deepseek4 import layers as ds_layers

INV_FREQ = ds_layers.rope_inv_freq(flash_args(), 4)  # YaRN-scaled, 32 frequencies


def direct(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    angles = positions.astype(np.float64)[:, None] * INV_FREQ[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("positions", [
    np.arange(0, 2048),  # a first chunk
    np.arange(6144, 8192),  # a later one
    np.arange(1000, 1300) * 4,  # a ratio-4 compressor's rows: every 4th position
    np.arange(3, 5) * 128,  # a ratio-128 compressor's two rows
    np.array([70_000]),  # one position, past the first table: the table grows
    np.arange(4090, 4100),  # across the first table's end
    np.array([5, 3, 9]),  # not a progression: computed for the call
    np.array([9, 5, 1], dtype=np.uint64),  # unsigned, decreasing
    np.array([0.0, 1.5, 3.0]),  # not integers
])
def test_the_table_equals_the_angles_computed_for_the_call(positions):
    cos, sin = ds_layers.angle_table(INV_FREQ, positions)
    want_cos, want_sin = direct(positions)
    assert cos.shape == sin.shape == (len(positions), 32) and cos.dtype == mx.float32
    np.testing.assert_array_equal(np.array(cos), want_cos)
    np.testing.assert_array_equal(np.array(sin), want_sin)


def test_the_table_is_built_once_per_frequency_set_and_grows_in_place():
    ds_layers._tables.pop(INV_FREQ.tobytes(), None)
    for start in range(0, 4096, 512):
        ds_layers.angle_table(INV_FREQ, np.arange(start, start + 512))
    first = ds_layers._tables[INV_FREQ.tobytes()]
    assert first[0].shape == (4096, 32)
    ds_layers.angle_table(INV_FREQ, np.arange(0, 512))
    assert ds_layers._tables[INV_FREQ.tobytes()] is first  # reused, not rebuilt
    ds_layers.angle_table(INV_FREQ, np.arange(4096, 4608))  # past 4,096: one 8,192 table
    assert ds_layers._tables[INV_FREQ.tobytes()][0].shape == (8192, 32)


def test_rope_rotates_only_the_tail_and_its_inverse_undoes_it():
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 3, 2, 512), dtype=np.float32))
    positions = np.array([0, 7, 100_000])
    out = np.array(ds_layers.rope(x, positions, INV_FREQ))
    np.testing.assert_array_equal(out[..., :448], np.array(x)[..., :448])
    pair_norm = lambda a: np.hypot(a[..., 448::2], a[..., 449::2])  # noqa: E731
    np.testing.assert_allclose(pair_norm(out), pair_norm(np.array(x)), rtol=1e-5)
    assert np.abs(out[0, 0] - np.array(x)[0, 0]).max() < 1e-6  # position 0: no rotation
    assert np.abs(out[0, 2] - np.array(x)[0, 2]).max() > 0.1
    back = np.array(ds_layers.rope(mx.array(out), positions, INV_FREQ, inverse=True))
    np.testing.assert_allclose(back, np.array(x), atol=1e-5)


def test_float32_frequencies_give_their_own_angles_from_the_table():
    inv32 = INV_FREQ.astype(np.float32)
    positions = np.arange(8, dtype=np.uint64)  # unsigned, increasing: the table path
    cos, sin = ds_layers.angle_table(inv32, positions)
    angles = np.arange(8, dtype=np.float64)[:, None] * inv32.astype(np.float64)[None, :]
    assert cos.shape == (8, 32)
    np.testing.assert_array_equal(np.array(cos), np.cos(angles).astype(np.float32))
    np.testing.assert_array_equal(np.array(sin), np.sin(angles).astype(np.float32))
