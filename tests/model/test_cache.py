"""KV caches: byte plans, ring/global attention against a dense numpy reference, and the
ModelCache contract (commit, context limit, poison, snapshot/restore, growth).

Small random tensors only; no real model.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.cache import CachePoisoned, ContextExhausted
from model.cache_plan import LayerSpec, plan_cache
from model.kv_cache import ModelCache
from model.layer_cache import CAPACITY_STEP_TOKENS, GlobalKVCache, RingKVCache

W = 8  # test window
N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 16  # grouped-query: 2 query heads per KV head
SCALE = HEAD_DIM**-0.5
RTOL = ATOL = 2e-5


def gemma3_270m_specs() -> list[LayerSpec]:
    """Gemma 3 270M by hand: 18 layers, every 6th global, 1 KV head of 256, window 512."""
    return [LayerSpec(1, 256, None if (i + 1) % 6 == 0 else 512) for i in range(18)]


def qkv(T: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, N_HEADS, T, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((1, N_KV_HEADS, T, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((1, N_KV_HEADS, T, HEAD_DIM)).astype(np.float32)
    return q, k, v


def dense_attention(q, k, v, window: int | None) -> np.ndarray:
    """Causal (optionally sliding-window) attention over the whole sequence, float64 numpy.

    Query t attends to keys s with ``s <= t`` and, with a window, ``t - s < window``.
    """
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    T = q.shape[2]
    t = np.arange(T)[:, None]
    s = np.arange(T)[None, :]
    allowed = s <= t
    if window is not None:
        allowed &= t - s < window
    out = np.empty_like(q)
    group = N_HEADS // N_KV_HEADS
    for h in range(N_HEADS):
        scores = q[0, h] @ k[0, h // group].T * SCALE
        scores = np.where(allowed, scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[0, h] = p @ v[0, h // group]
    return out


def chunks_of(T: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Split [0, T) into chunks cycling through `sizes`."""
    out, start, i = [], 0, 0
    while start < T:
        end = min(T, start + sizes[i % len(sizes)])
        out.append((start, end))
        start, i = end, i + 1
    return out


def attend(layer, q, k, v, start: int, end: int) -> mx.array:
    """One chunk through a layer cache: update at `start`, then SDPA with its keys and mask."""
    sl = slice(start, end)
    keys, values, mask = layer.update(mx.array(k[:, :, sl]), mx.array(v[:, :, sl]), start)
    out = mx.fast.scaled_dot_product_attention(
        mx.array(q[:, :, sl]), keys, values, scale=SCALE, mask=mask
    )
    mx.eval(out, layer.arrays())
    return out


def chunked_attention(layer, q, k, v, sizes: list[int]) -> np.ndarray:
    outs = [attend(layer, q, k, v, a, b) for a, b in chunks_of(q.shape[2], sizes)]
    return np.array(mx.concatenate(outs, axis=2))


# --- plan_cache -----------------------------------------------------------------------


def test_gemma3_270m_bytes_per_token():
    specs = gemma3_270m_specs()
    f32 = plan_cache(specs, 4096, mx.float32)
    bf16 = plan_cache(specs, 4096, mx.bfloat16)
    f16 = plan_cache(specs, 4096, mx.float16)
    assert f32.bytes_per_token == 3 * 2 * 1 * 256 * 4 == 6144
    assert bf16.bytes_per_token == 3072
    assert f16.bytes_per_token == 3072
    # 15 window layers x 512 rows x (K + V) x 256 x 4 bytes
    assert f32.fixed_bytes == 15 * 512 * 2 * 256 * 4
    assert bf16.fixed_bytes == f32.fixed_bytes // 2
    assert f32.n_layers == 18
    assert "float32" in f32.kv_dtype and "bfloat16" in bf16.kv_dtype


def test_plan_layer_rows():
    specs = gemma3_270m_specs()
    plan = plan_cache(specs, 1000, mx.float32)
    for spec, layer in zip(specs, plan.layers, strict=True):
        assert layer.row_bytes == 2 * 256 * 4
        if spec.window is None:
            assert (layer.kind, layer.rows) == ("global", 1000)
        else:
            assert (layer.kind, layer.rows) == ("window", 512)
    short = plan_cache(specs, 100, mx.float32)  # a context shorter than the window
    assert {layer.rows for layer in short.layers} == {100}
    assert short.resident_bytes == 100 * 18 * 2 * 256 * 4


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_resident_bytes_exactly_linear_beyond_the_window(dtype):
    specs = gemma3_270m_specs()
    plans = {ctx: plan_cache(specs, ctx, dtype) for ctx in (512, 513, 1000, 4096, 32768)}
    for ctx, plan in plans.items():
        assert plan.resident_bytes == plan.fixed_bytes + ctx * plan.bytes_per_token
    per_token = plans[512].bytes_per_token
    assert plans[513].resident_bytes - plans[512].resident_bytes == per_token
    assert plans[32768].resident_bytes - plans[4096].resident_bytes == (32768 - 4096) * per_token
    # window layers are fixed: their bytes do not change with context
    window_bytes = {
        ctx: sum(layer.bytes for layer in plan.layers if layer.kind == "window")
        for ctx, plan in plans.items()
    }
    assert len(set(window_bytes.values())) == 1


def test_describe_layers():
    """What ``prefillq plan`` prints per layer (without its two-space indent)."""
    lines = plan_cache(gemma3_270m_specs(), 4096, mx.bfloat16).describe_layers()
    assert len(lines) == 18
    assert lines[0] == "layer  0: window 512 rows x 1024 B"
    assert lines[5] == "layer  5: global 4096 rows x 1024 B"
    assert lines[17] == "layer 17: global 4096 rows x 1024 B"


def test_plan_without_windows_has_no_fixed_bytes():
    plan = plan_cache([LayerSpec(2, 16), LayerSpec(2, 16)], 100, mx.float32)
    assert plan.fixed_bytes == 0
    assert plan.bytes_per_token == 2 * (2 * 2 * 16 * 4)
    assert plan.resident_bytes == 100 * plan.bytes_per_token


def test_allocated_bytes_match_the_plan():
    specs = [LayerSpec(N_KV_HEADS, HEAD_DIM, W), LayerSpec(N_KV_HEADS, HEAD_DIM)] * 2
    cache = ModelCache(specs, context_length=40, capacity=40)
    assert cache.nbytes == cache.plan().resident_bytes
    assert cache.plan().context_length == 40


# --- RingKVCache ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes",
    [[1], [3], [W - 1], [W], [W + 1], [2 * W + 3], [5 * W], [2, W + 1, 1, 2 * W + 3, W - 1, W]],
)
def test_ring_attention_equals_dense_sliding_window(sizes):
    T = 5 * W + 3
    q, k, v = qkv(T, seed=1)
    ring = RingKVCache(LayerSpec(N_KV_HEADS, HEAD_DIM, W), mx.float32)
    got = chunked_attention(ring, q, k, v, sizes)
    want = dense_attention(q, k, v, window=W)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_window_actually_binds_in_the_reference():
    # guards the test above: full causal attention differs from the windowed one
    q, k, v = qkv(3 * W, seed=1)
    assert np.abs(dense_attention(q, k, v, W) - dense_attention(q, k, v, None)).max() > 1e-2


def test_ring_returns_previous_window_minus_one_rows_in_order():
    ring = RingKVCache(LayerSpec(1, 1, W), mx.float32)
    position = 0
    for L in (3, 5, 7, 2):
        rows = np.arange(position, position + L, dtype=np.float32).reshape(1, 1, L, 1)
        keys, values, mask = ring.update(mx.array(rows), mx.array(-rows), position)
        n_prev = min(position, W - 1)
        want = np.arange(position - n_prev, position + L, dtype=np.float32)
        np.testing.assert_array_equal(np.array(keys).ravel(), want)
        np.testing.assert_array_equal(np.array(values).ravel(), -want)
        position += L
    # the ring holds the newest W positions, row p at slot p % W
    held = np.array(ring.keys).ravel()
    assert sorted(held.tolist()) == list(range(position - W, position))
    assert all(held[p % W] == p for p in range(position - W, position))


# --- GlobalKVCache --------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[1], [3], [W], [2 * W + 3], [7, 1, 13]])
def test_global_attention_equals_dense_causal(sizes):
    T = 5 * W + 3
    q, k, v = qkv(T, seed=2)
    layer = GlobalKVCache(LayerSpec(N_KV_HEADS, HEAD_DIM), mx.float32)
    got = chunked_attention(layer, q, k, v, sizes)
    np.testing.assert_allclose(got, dense_attention(q, k, v, None), rtol=RTOL, atol=ATOL)


def test_global_growth_keeps_the_live_prefix():
    T = 2 * CAPACITY_STEP_TOKENS + 10
    q, k, v = qkv(T, seed=3)
    layer = GlobalKVCache(LayerSpec(N_KV_HEADS, HEAD_DIM), mx.float32, capacity=5)
    assert layer.capacity == 5
    outs = []
    capacities = []
    for a, b in chunks_of(T, [100]):
        outs.append(attend(layer, q, k, v, a, b))
        capacities.append(layer.capacity)
    # grows in whole steps, only when needed
    assert capacities[0] == CAPACITY_STEP_TOKENS
    assert capacities[-1] == 3 * CAPACITY_STEP_TOKENS
    assert all(c % CAPACITY_STEP_TOKENS == 0 for c in capacities)
    np.testing.assert_array_equal(np.array(layer.keys[:, :, :T]), k)
    np.testing.assert_array_equal(np.array(layer.values[:, :, :T]), v)
    got = np.array(mx.concatenate(outs, axis=2))
    np.testing.assert_allclose(got, dense_attention(q, k, v, None), rtol=RTOL, atol=ATOL)


def test_reserved_capacity_does_not_grow():
    layer = GlobalKVCache(LayerSpec(N_KV_HEADS, HEAD_DIM), mx.float32, capacity=50)
    q, k, v = qkv(50, seed=4)
    attend(layer, q, k, v, 0, 50)
    assert layer.capacity == 50


# --- ModelCache -----------------------------------------------------------------------

SPECS = [
    LayerSpec(N_KV_HEADS, HEAD_DIM, W),
    LayerSpec(N_KV_HEADS, HEAD_DIM),
    LayerSpec(N_KV_HEADS, HEAD_DIM, W),
    LayerSpec(N_KV_HEADS, HEAD_DIM),
]


def layer_qkv(T: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [qkv(T, seed * 100 + i) for i in range(len(SPECS))]


def feed(cache: ModelCache, data, start: int, end: int) -> list[np.ndarray]:
    """Run tokens [start, end) of per-layer (q, k, v) through every layer, then commit."""
    assert cache.position == start
    cache.check_chunk(end - start)
    outs = [attend(cache[i], q, k, v, start, end) for i, (q, k, v) in enumerate(data)]
    cache.commit(end - start)
    return [np.array(o) for o in outs]


def feed_all(cache: ModelCache, data, start: int, end: int, size: int) -> list[np.ndarray]:
    per_chunk = [feed(cache, data, a + start, b + start) for a, b in chunks_of(end - start, [size])]
    return [np.concatenate([c[i] for c in per_chunk], axis=2) for i in range(len(SPECS))]


def test_model_cache_layer_kinds_and_capacity():
    cache = ModelCache(SPECS, context_length=100, capacity=1000)
    assert isinstance(cache[0], RingKVCache) and isinstance(cache[1], GlobalKVCache)
    assert len(cache) == 4
    assert cache.capacity == 100  # the reservation is clamped to the context
    grown = ModelCache(SPECS, context_length=1000)
    assert grown.capacity == 0
    data = layer_qkv(300, seed=5)
    feed(grown, data, 0, 300)
    assert grown.capacity == 2 * CAPACITY_STEP_TOKENS
    assert grown.position == 300


def test_layer_writes_do_not_move_the_position_until_commit():
    cache = ModelCache(SPECS, context_length=100)
    data = layer_qkv(10, seed=6)
    for i, (q, k, v) in enumerate(data):
        attend(cache[i], q, k, v, 0, 10)
    assert cache.position == 0
    before = [np.array(a) for a in cache.arrays()]
    cache.commit(10)
    assert cache.position == 10
    after = [np.array(a) for a in cache.arrays()]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_context_exhausted():
    cache = ModelCache(SPECS, context_length=10)
    cache.check_chunk(10)
    with pytest.raises(ContextExhausted):
        cache.check_chunk(11)
    feed(cache, layer_qkv(6, seed=7), 0, 6)
    cache.check_chunk(4)
    with pytest.raises(ContextExhausted):
        cache.check_chunk(5)
    with pytest.raises(ContextExhausted):
        cache.commit(5)
    assert cache.position == 6


def test_poisoned_until_reset():
    cache = ModelCache(SPECS, context_length=100)
    data = layer_qkv(20, seed=8)
    feed(cache, data, 0, 10)
    cache.poison()
    assert cache.is_poisoned
    with pytest.raises(CachePoisoned):
        cache.check_chunk(1)
    with pytest.raises(CachePoisoned):
        cache.snapshot()
    with pytest.raises(CachePoisoned):
        cache.commit(1)
    assert cache.position == 10
    cache.reset()
    assert not cache.is_poisoned and cache.position == 0
    for layer in cache.layers:
        if isinstance(layer, RingKVCache):
            assert not np.array(layer.keys).any() and not np.array(layer.values).any()
    # after reset the cache behaves like a fresh one, exactly
    again = feed_all(cache, data, 0, 20, 7)
    fresh = feed_all(ModelCache(SPECS, context_length=100), data, 0, 20, 7)
    for a, b in zip(again, fresh, strict=True):
        np.testing.assert_array_equal(a, b)


def test_snapshot_restore_gives_identical_outputs():
    T_prefix, T_suffix = 2 * W + 5, W + 3
    data = layer_qkv(T_prefix + 2 * T_suffix, seed=9)
    cache = ModelCache(SPECS, context_length=200)
    feed_all(cache, data, 0, T_prefix, 5)
    snap = cache.snapshot()
    assert snap.position == T_prefix
    first = feed_all(cache, data, T_prefix, T_prefix + T_suffix, 4)
    after_suffix = [np.array(a) for a in cache.arrays()]
    cache.restore(snap)
    assert cache.position == T_prefix
    second = feed_all(cache, data, T_prefix, T_prefix + T_suffix, 4)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    # and the restored cache equals one that never saw the suffix
    fresh = ModelCache(SPECS, context_length=200)
    feed_all(fresh, data, 0, T_prefix, 5)
    third = feed_all(fresh, data, T_prefix, T_prefix + T_suffix, 4)
    for a, b in zip(first, third, strict=True):
        np.testing.assert_array_equal(a, b)
    # replaying the same suffix leaves the same buffers behind
    for a, b in zip(after_suffix, cache.arrays(), strict=True):
        np.testing.assert_array_equal(a, np.array(b))


def test_restore_copies_ring_rows_and_only_hides_global_rows():
    T_prefix, T_suffix = 2 * W + 5, W + 3
    data = layer_qkv(T_prefix + T_suffix, seed=10)
    cache = ModelCache(SPECS, context_length=200, capacity=200)
    feed_all(cache, data, 0, T_prefix, 5)
    snap = cache.snapshot()
    ring_before = [np.array(a) for a in cache[0].arrays()]
    feed_all(cache, data, T_prefix, T_prefix + T_suffix, 4)
    assert not np.array_equal(np.array(cache[0].keys), ring_before[0])  # the suffix moved it
    cache.restore(snap)
    # ring layers: rows copied back exactly
    for i in (0, 2):
        np.testing.assert_array_equal(np.array(cache[i].keys), np.array(snap.layers[i][0]))
        np.testing.assert_array_equal(np.array(cache[i].values), np.array(snap.layers[i][1]))
    np.testing.assert_array_equal(np.array(cache[0].keys), ring_before[0])
    np.testing.assert_array_equal(np.array(cache[0].values), ring_before[1])
    # global layers: nothing copied; the suffix rows are still there, hidden by the position
    for i in (1, 3):
        assert snap.layers[i] is None
        _, k, v = data[i]
        end = T_prefix + T_suffix
        np.testing.assert_array_equal(
            np.array(cache[i].keys[:, :, T_prefix:end]), k[:, :, T_prefix:end]
        )
        np.testing.assert_array_equal(np.array(cache[i].values[:, :, :end]), v[:, :, :end])
    assert cache.position == T_prefix


def test_restore_after_a_failed_chunk_recovers_exactly():
    T_prefix, T_suffix = 2 * W + 5, W + 3
    data = layer_qkv(T_prefix + T_suffix, seed=11)
    garbage = layer_qkv(T_prefix + T_suffix, seed=12)
    cache = ModelCache(SPECS, context_length=200)
    feed_all(cache, data, 0, T_prefix, 5)
    snap = cache.snapshot()
    # a chunk that wrote two layers' rows and then failed
    for i in (0, 1):
        q, k, v = garbage[i]
        attend(cache[i], q, k, v, T_prefix, T_prefix + 6)
    cache.poison()
    cache.restore(snap)
    assert not cache.is_poisoned
    got = feed_all(cache, data, T_prefix, T_prefix + T_suffix, 4)
    fresh = ModelCache(SPECS, context_length=200)
    feed_all(fresh, data, 0, T_prefix, 5)
    want = feed_all(fresh, data, T_prefix, T_prefix + T_suffix, 4)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
