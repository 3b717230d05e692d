"""CPU streams (`model.runtime.streams`) change how ops are scheduled, never their values."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.gguf.synthetic import write_tiny_gemma3
from model.registry import load_model
from model.runtime import streams
from model.runtime.streams import cpu_streams, split_map


def test_split_map_equals_the_whole_op():
    x = mx.random.normal((2, 5, 7), key=mx.random.key(0))
    y = mx.random.normal((2, 5, 7), key=mx.random.key(1))

    def fn(a, b, scale):
        return mx.softmax(a * b * scale, axis=-1)

    whole = fn(x, y, 0.5)
    for parts in (1, 2, 3, 5, 9):  # 9 > 5 rows: clamped to one row per slice
        split = split_map(fn, [x, y], axis=1, shared=(0.5,), parts=parts)
        assert split.shape == whole.shape
        assert mx.array_equal(split, whole).item(), parts


def test_small_ops_run_whole_and_large_ones_in_slices(monkeypatch):
    monkeypatch.setenv("PREFILLQ_CPU_STREAMS", "2")
    calls = []

    def fn(a):
        calls.append(a.shape)
        return a * 2

    small = mx.zeros((1, 4, 16))
    big = mx.zeros((1, 4, streams.MIN_SPLIT_ELEMENTS // 4))
    assert mx.array_equal(split_map(fn, [small], axis=1), small * 2).item()
    assert calls == [(1, 4, 16)]  # whole: slicing costs more than it saves
    calls.clear()
    assert mx.array_equal(split_map(fn, [big], axis=1), big * 2).item()
    assert len(calls) == (2 if mx.default_device() == mx.cpu else 1)


def test_cpu_streams_reads_the_environment(monkeypatch):
    monkeypatch.setenv("PREFILLQ_CPU_STREAMS", "3")
    assert cpu_streams() == 3
    for bad in ("0", "-1", "two", ""):
        monkeypatch.setenv("PREFILLQ_CPU_STREAMS", bad)
        with pytest.raises(ValueError, match="PREFILLQ_CPU_STREAMS"):
            cpu_streams()
    monkeypatch.delenv("PREFILLQ_CPU_STREAMS")
    assert cpu_streams() >= 1


def test_a_bad_stream_count_fails_at_model_load(monkeypatch):
    monkeypatch.setenv("PREFILLQ_CPU_STREAMS", "0")
    with pytest.raises(ValueError, match="PREFILLQ_CPU_STREAMS='0'"):
        load_model("gemma3-tiny")


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gemma3_logits_do_not_depend_on_the_stream_count(tmp_path, monkeypatch, n_kv_heads):
    """One KV head: query heads are split; several: whole GQA groups with their KV heads.
    40 tokens in 24-token chunks cover both the blocked (chunk > window) and the plain
    masked attention paths."""
    monkeypatch.setattr(streams, "MIN_SPLIT_ELEMENTS", 0)  # the tiny model's ops are small
    path = write_tiny_gemma3(tmp_path / "tiny.gguf", n_heads=4, n_kv_heads=n_kv_heads)
    loaded = load_model(f"kv{n_kv_heads}={path}")
    ids = [(7 * i + 3) % loaded.vocab_size for i in range(40)]

    def logits(count: str) -> np.ndarray:
        monkeypatch.setenv("PREFILLQ_CPU_STREAMS", count)
        return loaded.start_prefill(ids, chunk_tokens=24).run()

    one = logits("1")
    for count in ("2", "4"):
        np.testing.assert_array_equal(logits(count), one)
