"""Explicit cache growth (`ModelCache.grow`, the DeepSeek-V4 cache's capacity step): the live
prefix migrates, a snapshot taken before growing still restores exactly, bad growth raises."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.cache import CachePoisoned
from model.kv_cache import CAPACITY_STEP_TOKENS, CacheSnapshot, ModelCache
from tests.model.test_cache import SPECS, W, feed_all, layer_qkv


def test_grow_migrates_the_live_prefix_and_keeps_a_snapshot_valid():
    T_prefix, T_suffix = 3 * W + 5, 2 * W + 3
    data = layer_qkv(T_prefix + T_suffix + 10, seed=21)
    cache = ModelCache(SPECS, context_length=400, capacity=T_prefix, capacity_step=16)
    assert cache.capacity == T_prefix and cache.capacity_step == 16
    feed_all(cache, data, 0, T_prefix - 6, 5)
    snap = cache.snapshot()
    feed_all(cache, data, T_prefix - 6, T_prefix, 3)
    keys_before = [np.array(cache[i].keys[:, :, :T_prefix]) for i in (1, 3)]
    assert cache.grow(96, snap) is snap
    assert cache.capacity == 96 and cache.position == T_prefix
    for i, before in zip((1, 3), keys_before, strict=True):
        np.testing.assert_array_equal(np.array(cache[i].keys[:, :, :T_prefix]), before)
    # the grown cache continues exactly like one that was big from the start
    grown = feed_all(cache, data, T_prefix, T_prefix + T_suffix, 4)
    big = ModelCache(SPECS, context_length=400, capacity=96)
    feed_all(big, data, 0, T_prefix, 5)
    for a, b in zip(grown, feed_all(big, data, T_prefix, T_prefix + T_suffix, 4), strict=True):
        np.testing.assert_array_equal(a, b)
    # and the snapshot from before growing restores the grown cache exactly
    cache.restore(snap)
    again = feed_all(cache, data, T_prefix - 6, T_prefix + 10, 4)
    fresh = ModelCache(SPECS, context_length=400)
    feed_all(fresh, data, 0, T_prefix - 6, 5)
    for a, b in zip(again, feed_all(fresh, data, T_prefix - 6, T_prefix + 10, 4), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_growth_raises_and_changes_nothing():
    cache = ModelCache(SPECS, context_length=100, capacity=40)
    assert cache.capacity_step == CAPACITY_STEP_TOKENS
    data = layer_qkv(30, seed=22)
    feed_all(cache, data, 0, 20, 7)
    snap = cache.snapshot()
    with pytest.raises(ValueError):
        cache.grow(40)  # not larger
    with pytest.raises(ValueError):
        cache.grow(101)  # past the context
    feed_all(cache, data, 20, 30, 10)
    cache.restore(snap)
    with pytest.raises(ValueError):
        cache.grow(80, CacheSnapshot(25, snap.layers))  # ahead of the position
    cache.poison()
    with pytest.raises(CachePoisoned):
        cache.grow(80)
    assert cache.capacity == 40 and cache.position == 20


def test_deepseek4_cache_takes_a_capacity_step():
    from model.archs import deepseek4 as ds
    from model.gguf.reader import read_gguf
    from model.gguf.synthetic import tiny_deepseek4_path

    model = ds.load(read_gguf(tiny_deepseek4_path()[0]), mx.float32)
    default = model.make_cache(mx.float32, capacity=100)
    assert default.capacity == 4096  # the tiny model's whole context: one 131,072 step
    small = model.make_cache(mx.float32, capacity=100, capacity_step=64)
    assert (small.capacity, small.capacity_step) == (128, 64)
    small.check_chunk(200)  # a forward pass past the capacity grows it by that step
    assert small.capacity == 256
