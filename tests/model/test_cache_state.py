"""Cache state: ``state()`` -> msgpack -> ``from_state()`` is exact for Gemma 3 and DeepSeek-V4.

A prefill continued from a restored cache gives bitwise the logits of continuing the
original (the same computation on the same bytes), and both keep the chunked-equals-one-pass
contract. Also: incremental states, bf16 bit patterns, and every malformed state raising
`CacheStateError` naming what is wrong.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import msgpack
import numpy as np
import pytest

from model.cache import CachePoisoned, CacheStateError
from model.cache_state import STATE_VERSION, CacheState
from model.chunk import prefill_chunk
from tests.exactness import assert_contract

N_TINY = 300  # both tiny models: 16-token windows wrap, 2 ratio-128 groups, 75 ratio-4 rows
# Restored-then-continued vs one pass, tiny models in float32 on CPU, as a fraction of
# max |logit|: measured 5.9e-7 to 6.8e-7 (gemma3-tiny) and 3.8e-7 to 4.7e-7
# (deepseek4-tiny) over the splits below.
TINY_BOUND = 3.5e-6


@functools.cache
def tiny(name: str):
    from model.registry import load_model

    return load_model(name, dtype=mx.float32).model


def ids_for(model, n: int, seed: int = 4) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, model.args.vocab_size, n)]


def pack(state: CacheState) -> bytes:
    return msgpack.packb({"meta": state.meta, "blobs": state.blobs})


def unpack(data: bytes) -> CacheState:
    return CacheState(**msgpack.unpackb(data))


def prefill(model, cache, ids: list[int], stop: int, chunk: int):
    hidden = None
    for start in range(cache.position, stop, chunk):
        hidden = prefill_chunk(model, cache, ids[start : min(start + chunk, stop)])
    return hidden


def logits_of(model, hidden) -> np.ndarray:
    return np.array(model.logits(hidden)[0])


def new_cache(model, ids, kv_dtype=mx.float32):
    return model.make_cache(kv_dtype, capacity=len(ids), context_length=len(ids) + 64)


def round_trip(model, cache):
    """A new cache from the msgpack bytes of `cache.state()`; the states agree exactly."""
    state = cache.state()
    restored = model.cache_from_state(unpack(pack(state)))
    again = restored.state()
    assert again.meta == state.meta
    assert again.blobs == state.blobs
    assert restored.position == cache.position and restored.capacity == cache.capacity
    return restored


@functools.cache
def one_pass(name: str) -> np.ndarray:
    model = tiny(name)
    ids = ids_for(model, N_TINY)
    return logits_of(model, prefill(model, new_cache(model, ids), ids, N_TINY, N_TINY))


# gemma3-tiny: window 16 (5 sliding layers, 1 global); deepseek4-tiny: window 16, ratios
# (0, 0, 4, 128, 4, 128). Splits: empty, one window exactly, a wrapped ring mid-window,
# inside a ratio-4 and a ratio-128 group (compressor state holds a partial window), and a
# ratio-128 group boundary.
SPLITS = [
    ("gemma3-tiny", 0, 7),
    ("gemma3-tiny", 16, 16),
    ("gemma3-tiny", 37, 10),
    ("gemma3-tiny", 200, 64),
    ("deepseek4-tiny", 0, 5),
    ("deepseek4-tiny", 16, 16),
    ("deepseek4-tiny", 130, 50),
    ("deepseek4-tiny", 203, 29),
    ("deepseek4-tiny", 256, 128),
]


@pytest.mark.parametrize("name,split,chunk", SPLITS)
def test_restored_cache_continues_bitwise(name, split, chunk):
    model = tiny(name)
    ids = ids_for(model, N_TINY)
    cache = new_cache(model, ids)
    prefill(model, cache, ids, split, chunk)
    restored = round_trip(model, cache)
    original = logits_of(model, prefill(model, cache, ids, N_TINY, 61))
    resumed = logits_of(model, prefill(model, restored, ids, N_TINY, 61))
    np.testing.assert_array_equal(resumed, original)
    assert_contract(resumed, one_pass(name), TINY_BOUND)


def test_mid_ratio_state_holds_a_partial_window():
    """At 130 tokens the ratio-4 and ratio-128 compressors each hold 2 remainder tokens."""
    model = tiny("deepseek4-tiny")
    ids = ids_for(model, N_TINY)
    cache = new_cache(model, ids)
    prefill(model, cache, ids, 130, 50)
    restored = round_trip(model, cache)
    for i in (2, 3):  # ratio 4 (overlapping: remainder after the previous window), ratio 128
        off = 4 if model.args.compress_ratios[i] == 4 else 0
        live = np.array(restored[i].main_score_state[off : off + 2])
        assert np.isfinite(live).all()
        np.testing.assert_array_equal(live, np.array(cache[i].main_score_state[off : off + 2]))
    blob = {e["name"]: e for e in cache.state().meta["blobs"]}
    assert blob["layers.2.compressed"]["shape"] == [130 // 4, model.args.head_dim]
    assert blob["layers.3.compressed"]["shape"] == [1, model.args.head_dim]
    assert not blob["layers.2.main_kv_state"]["append_only"]


@pytest.mark.parametrize("name", ["gemma3-tiny", "deepseek4-tiny"])
def test_bf16_round_trips_bit_exactly(name):
    model = tiny(name)
    ids = ids_for(model, 90)
    cache = new_cache(model, ids, mx.bfloat16)
    prefill(model, cache, ids, 45, 20)
    restored = round_trip(model, cache)
    for a, b in zip(cache.arrays(), restored.arrays(), strict=True):
        assert a.dtype == b.dtype
        bits = mx.uint16 if a.dtype == mx.bfloat16 else mx.uint32
        # append-only rows past the position are dead and not saved; compare the live prefix
        n = min(a.shape[0], b.shape[0])
        np.testing.assert_array_equal(np.array(a.view(bits))[:n], np.array(b.view(bits))[:n])
    original = logits_of(model, prefill(model, cache, ids, 90, 45))
    np.testing.assert_array_equal(logits_of(model, prefill(model, restored, ids, 90, 45)), original)


@pytest.mark.parametrize(
    "name,first,later", [("gemma3-tiny", 40, 150), ("deepseek4-tiny", 42, 203)]
)
def test_incremental_state_extends_a_complete_one(name, first, later):
    model = tiny(name)
    ids = ids_for(model, N_TINY)
    cache = new_cache(model, ids)
    prefill(model, cache, ids, first, 20)
    base = cache.state()
    prefill(model, cache, ids, later, 30)
    delta = cache.state(since=first)
    full = cache.state()
    assert delta.nbytes < full.nbytes
    extended = unpack(pack(base)).extend(unpack(pack(delta)))
    assert extended.meta == full.meta and extended.blobs == full.blobs
    with pytest.raises(CacheStateError, match="since"):
        model.cache_from_state(delta)
    with pytest.raises(ValueError, match="does not extend"):
        delta.extend(base)


def test_grown_gemma3_cache_round_trips():
    """Growth in 256-token steps leaves a capacity (512) past the context (300)."""
    model = tiny("gemma3-tiny")
    ids = ids_for(model, 290)
    cache = model.make_cache(mx.float32, capacity=0, context_length=300)
    prefill(model, cache, ids, 270, 90)
    assert cache.capacity == 512
    restored = round_trip(model, cache)
    original = logits_of(model, prefill(model, cache, ids, 290, 7))
    np.testing.assert_array_equal(logits_of(model, prefill(model, restored, ids, 290, 7)), original)


def test_poisoned_cache_has_no_state():
    model = tiny("gemma3-tiny")
    cache = new_cache(model, [1] * 10)
    cache.poison()
    with pytest.raises(CachePoisoned):
        cache.state()


def _state(name: str, n: int = 40) -> CacheState:
    model = tiny(name)
    ids = ids_for(model, n)
    cache = new_cache(model, ids)
    prefill(model, cache, ids, n, 13)
    return unpack(pack(cache.state()))


def _meta(**changes):
    return lambda s: s.meta.update(changes)


def _blob_entry(name: str, **changes):
    return lambda s: next(e for e in s.meta["blobs"] if e["name"] == name).update(changes)


def _truncate(name: str):
    return lambda s: s.blobs.update({name: s.blobs[name][:-2]})


def _drop(name: str):
    return lambda s: s.blobs.pop(name)


BAD_STATES = [
    ("version", _meta(version=STATE_VERSION + 1), "version"),
    ("dtype", _meta(kv_dtype="float16"), "dtype"),
    ("unknown dtype", _meta(kv_dtype="int8"), "kv_dtype"),
    ("architecture", _meta(architecture="llama"), "architecture"),
    ("past capacity", _meta(position=10**6), "position"),
    ("shape", _blob_entry("layers.0.keys", shape=[16, 1, 1, 8]), "shape"),
    ("truncated", _truncate("layers.5.values"), "bytes"),
    ("missing", _drop("layers.1.keys"), "missing"),
    ("layers", _meta(layers=[[1, 16, 16]] * 5), "layers"),
]
DS_BAD_STATES = [
    ("version", _meta(version=0), "version"),
    ("dtype", _meta(kv_dtype="bfloat16"), "dtype"),
    ("ratios", _meta(compress_ratios=[0, 0, 4, 4, 4, 128]), "compress_ratios"),
    ("capacity", _meta(capacity=0), "does not fit"),
    ("shape", _blob_entry("layers.2.compressed", shape=[9, 32]), "shape"),
    ("truncated", _truncate("layers.4.indexer_kv_state"), "bytes"),
    ("state dtype", _blob_entry("layers.3.main_kv_state", dtype="bfloat16"), "dtype"),
    ("missing", _drop("layers.0.window"), "missing"),
    ("wrong cache", _meta(cache="ModelCache"), "cache"),
]


@pytest.mark.parametrize(
    "name,case,change,match",
    [("gemma3-tiny", *c) for c in BAD_STATES] + [("deepseek4-tiny", *c) for c in DS_BAD_STATES],
    ids=[f"gemma3-{c[0]}" for c in BAD_STATES] + [f"deepseek4-{c[0]}" for c in DS_BAD_STATES],
)
def test_malformed_state_raises_a_typed_error(name, case, change, match):
    state = _state(name)
    tiny(name).cache_from_state(state)  # the unmodified state loads
    change(state)
    with pytest.raises(CacheStateError, match=match):
        tiny(name).cache_from_state(state)


def test_state_of_another_architecture_is_refused():
    with pytest.raises(CacheStateError, match="cache"):
        tiny("deepseek4-tiny").cache_from_state(_state("gemma3-tiny"))
    with pytest.raises(CacheStateError):
        tiny("gemma3-tiny").cache_from_state(_state("deepseek4-tiny"))


def test_state_is_json_able():
    import json

    meta = _state("deepseek4-tiny").meta
    assert json.loads(json.dumps(meta)) == meta


# --- the real Gemma 3 270M -------------------------------------------------------------

# Restored-then-continued vs one pass on the real Gemma 3 270M (float32, CPU), 600 tokens
# split at 520 (past one 512-token window): measured 2.2e-6 x max |logit|.
REAL_BOUND = 1e-5


@pytest.mark.slow
def test_real_gemma3_restored_past_a_window_continues_bitwise(gemma, reference_cases):
    ids = next(c for c in reference_cases if len(c["tokens"]) >= 600)["tokens"][:600]
    model = gemma.model
    cache = new_cache(model, ids)
    reference = logits_of(model, prefill(model, cache, ids, 600, 600))
    cache.reset()
    prefill(model, cache, ids, 520, 260)  # the sliding layers' 512-row rings have wrapped
    restored = round_trip(model, cache)
    original = logits_of(model, prefill(model, cache, ids, 600, 80))
    resumed = logits_of(model, prefill(model, restored, ids, 600, 80))
    np.testing.assert_array_equal(resumed, original)
    assert_contract(resumed, reference, REAL_BOUND)
