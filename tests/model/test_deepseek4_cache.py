"""DeepSeek-V4 cache: plan arithmetic (Flash config), typed errors, snapshot/restore and growth
at the buffer level (the cases of hf2q's ``Deepseek4Cache`` tests,
github.com/robertelee78/hf2q). No weights: buffers are filled with random values."""

from __future__ import annotations

import functools
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from model import cache as base
from model.archs.deepseek4 import ModelArgs, flash_args
from model.archs.deepseek4 import cache as dc
from model.archs.deepseek4 import planning as dp
from model.gguf.reader import read_gguf
from model.gguf.synthetic import tiny_deepseek4_path

# 21 ratio-4 layers (a 512-wide compressed and a 128-wide indexer row per 4 tokens, bf16)
# and 20 ratio-128 layers (a 512-wide row per 128 tokens): 6,880 bytes per token.
FLASH_BYTES_PER_TOKEN = 21 * (256 + 64) + 20 * 8


@functools.cache
def _tiny_gguf_args() -> ModelArgs:
    return ModelArgs.from_gguf(read_gguf(tiny_deepseek4_path()[0]))


def tiny_args(**overrides) -> ModelArgs:
    """The `deepseek4-tiny` config, read from its GGUF (docs/deepseek4-tiny.md)."""
    return replace(_tiny_gguf_args(), **overrides)


def test_flash_plan_bf16_bytes_per_token():
    plan = dp.plan(flash_args(), 131_072)
    assert FLASH_BYTES_PER_TOKEN == 6_880
    assert plan.bytes_per_token == FLASH_BYTES_PER_TOKEN
    assert plan.kv_dtype == "mlx.core.bfloat16"
    assert plan.n_layers == 43 and plan.window == 128


def test_flash_plan_layer_buffers():
    plan = dp.plan(flash_args(), 1024)
    shapes = {b.kind: (b.shape, b.dtype.split(".")[-1]) for b in plan.layers[2].buffers}
    assert shapes == {
        "window": ((128, 512), "bfloat16"),
        "compressed": ((256, 512), "bfloat16"),
        "indexer": ((256, 128), "bfloat16"),
        "main_kv_state": ((8, 1024), "float32"),
        "main_score_state": ((8, 1024), "float32"),
        "indexer_kv_state": ((8, 256), "float32"),
        "indexer_score_state": ((8, 256), "float32"),
    }
    shapes = {b.kind: b.shape for b in plan.layers[3].buffers}
    assert shapes == {
        "window": (128, 512),
        "compressed": (8, 512),
        "main_kv_state": (128, 512),
        "main_score_state": (128, 512),
    }
    assert [b.kind for b in plan.layers[0].buffers] == ["window"]
    assert [layer.compress_ratio for layer in plan.layers] == [0, 0] + [4, 128] * 20 + [4]


def test_flash_plan_resident_bytes_linear_in_context():
    window = 43 * 128 * 512 * 2
    states = 21 * (2 * 8 * 1024 * 4 + 2 * 8 * 256 * 4) + 20 * 2 * 128 * 512 * 4
    for ctx in (128, 1024, 4096, 131_072, 262_144, 1_048_576):
        plan = dp.plan(flash_args(), ctx)
        assert plan.fixed_bytes == window + states == 17_842_176
        assert plan.resident_bytes == plan.fixed_bytes + FLASH_BYTES_PER_TOKEN * ctx, ctx
        summary = plan.summary()
        assert summary["resident_bytes"] == plan.resident_bytes
        assert summary["n_layers"] == 43 and summary["context_length"] == ctx


def test_describe_layers():
    """What ``prefillq plan`` prints per layer (without its two-space indent)."""
    lines = dp.plan(flash_args(), 1024).describe_layers()
    assert len(lines) == 43
    assert lines[0] == "layer  0 (ratio 0): window [128, 512]"
    assert lines[2] == (
        "layer  2 (ratio 4): window [128, 512], compressed [256, 512], indexer [256, 128], "
        "main_kv_state [8, 1024], main_score_state [8, 1024], indexer_kv_state [8, 256], "
        "indexer_score_state [8, 256]"
    )
    assert lines[3] == (
        "layer  3 (ratio 128): window [128, 512], compressed [8, 512], "
        "main_kv_state [128, 512], main_score_state [128, 512]"
    )


def test_plan_says_f32_rows():
    plan = dp.plan(flash_args(), 1024, mx.float32)
    assert plan.kv_dtype == "mlx.core.float32"
    assert plan.bytes_per_token == 2 * FLASH_BYTES_PER_TOKEN
    assert all(b.dtype == "mlx.core.float32" for layer in plan.layers for b in layer.buffers)


def test_allocation_matches_plan():
    args = tiny_args()
    for dtype in (mx.float32, mx.bfloat16):
        plan = dp.plan(args, 512, dtype)
        cache = dc.Deepseek4Cache(args, plan)
        assert cache.nbytes == plan.resident_bytes
        assert cache.capacity == 512 and cache.position == 0
        assert cache[2].compressed.dtype == dtype and cache[2].main_kv_state.dtype == mx.float32
        assert np.all(np.array(cache[2].main_score_state) == -np.inf)
        assert np.all(np.array(cache[2].indexer_kv_state) == 0)


def test_plan_errors():
    with pytest.raises(dp.EmptyContext):
        dp.plan(flash_args(), 0)
    with pytest.raises(dp.ContextBound):
        dp.plan(flash_args(), 1_048_577)
    with pytest.raises(dp.SlidingWindow):
        dp.plan(flash_args(sliding_window=0), 1024)
    with pytest.raises(dp.CompressionRatio, match="layer 3"):
        dp.plan(tiny_args(compress_ratios=(0, 0, 4, 8, 4, 128)), 1024)
    with pytest.raises(dp.LayerCount):
        dp.plan(tiny_args(compress_ratios=(0, 4, 128)), 1024)


def test_window_mismatch():
    """A plan for another window (hf2q's 128-token check) is refused by the model's cache."""
    plan = dp.plan(tiny_args(sliding_window=128), 512)
    with pytest.raises(dp.SlidingWindow):
        dc.Deepseek4Cache(tiny_args(), plan)
    with pytest.raises(dp.CompressionRatio):
        dc.Deepseek4Cache(tiny_args(compress_ratios=(0, 0, 4, 128, 4, 4)), dp.plan(tiny_args(), 64))


def test_exhausted_and_poisoned():
    cache = dc.Deepseek4Cache(tiny_args(), dp.plan(tiny_args(), 64))
    cache.check_chunk(64)
    with pytest.raises(base.ContextExhausted):
        cache.check_chunk(65)
    cache.commit(60)
    with pytest.raises(base.ContextExhausted):  # the generic type the prefill loop knows
        cache.commit(5)
    cache.poison()
    assert cache.is_poisoned
    for call in (lambda: cache.check_chunk(1), lambda: cache.commit(1), cache.snapshot):
        with pytest.raises(base.CachePoisoned):
            call()
    cache.reset()
    assert not cache.is_poisoned and cache.position == 0
    cache.check_chunk(1)


def fill(cache: dc.Deepseek4Cache, seed: int) -> None:
    """Random values in every buffer (stand-ins for rows a forward pass would write)."""
    rng = np.random.default_rng(seed)
    for layer in cache.layers:
        for b in layer.plan.buffers:
            old = getattr(layer, b.kind)
            setattr(layer, b.kind, mx.array(rng.standard_normal(b.shape), dtype=old.dtype))


def arrays(cache: dc.Deepseek4Cache) -> list[dict[str, np.ndarray]]:
    return [
        {b.kind: np.array(getattr(layer, b.kind).astype(mx.float32)) for b in layer.plan.buffers}
        for layer in cache.layers
    ]


def test_snapshot_restore_exact():
    args = tiny_args()
    cache = dc.Deepseek4Cache(args, dp.plan(args, 256))
    fill(cache, 0)
    cache.commit(37)
    saved, snap = arrays(cache), cache.snapshot()
    assert snap.position == 37
    # append-only rows are not copied: only rings and compressor state
    assert set(snap.layers[2]) == {"window", *dp.STATE_KINDS}
    assert set(snap.layers[3]) == {"window", "main_kv_state", "main_score_state"}
    assert snap.nbytes < cache.nbytes
    fill(cache, 1)  # a later chunk overwrites ring, state and rows past 37
    cache.commit(100)
    cache.poison()
    cache.restore(snap)
    assert cache.position == 37 and not cache.is_poisoned
    now = arrays(cache)
    for layer, (before, after) in enumerate(zip(saved, now, strict=True)):
        for kind in snap.layers[layer]:
            np.testing.assert_array_equal(after[kind], before[kind], err_msg=f"{layer} {kind}")
    # restoring is repeatable (the snapshot does not alias the live buffers)
    fill(cache, 2)
    cache.restore(snap)
    np.testing.assert_array_equal(np.array(cache[2].window.astype(mx.float32)), saved[2]["window"])
    other = dc.Deepseek4Cache(args, dp.plan(args, 512))
    with pytest.raises(dc.SnapshotPlanMismatch):
        other.restore(snap)


def test_reset_reinitializes_compressor_state():
    args = tiny_args()
    cache = dc.Deepseek4Cache(args, dp.plan(args, 64))
    fill(cache, 0)
    cache.commit(10)
    cache.reset()
    for layer in cache.layers[2:]:
        assert np.all(np.array(layer.main_score_state) == -np.inf)
        assert np.all(np.array(layer.main_kv_state) == 0)
    assert cache.position == 0


def test_migrate_keeps_live_prefix_and_source():
    args = tiny_args()
    source = dc.Deepseek4Cache(args, dp.plan(args, 128))
    fill(source, 0)
    source.commit(101)
    before = arrays(source)
    snap = source.snapshot()
    target = dc.Deepseek4Cache(args, dp.plan(args, 512))
    fill(target, 1)  # garbage past the live prefix must not matter
    rebound = target.migrate_from(source, snap)
    assert target.position == 101 and target.capacity == 512
    for layer, (src, dst) in enumerate(zip(before, arrays(target), strict=True)):
        ratio = args.compress_ratios[layer]
        np.testing.assert_array_equal(dst["window"], src["window"])  # ring: 16 of 16 slots
        if ratio:
            n = 101 // ratio
            np.testing.assert_array_equal(dst["compressed"][:n], src["compressed"][:n])
            np.testing.assert_array_equal(dst["main_score_state"], src["main_score_state"])
        if ratio == 4:
            np.testing.assert_array_equal(dst["indexer"][:25], src["indexer"][:25])
            np.testing.assert_array_equal(dst["indexer_kv_state"], src["indexer_kv_state"])
    for src, again in zip(before, arrays(source), strict=True):  # source untouched
        for kind in src:
            np.testing.assert_array_equal(again[kind], src[kind])
    # the turn anchor survives growth: it restores on the grown cache, not the old one
    fill(target, 2)
    target.restore(rebound)
    assert target.position == 101
    np.testing.assert_array_equal(
        np.array(target[4].indexer_kv_state), before[4]["indexer_kv_state"]
    )


def test_migrate_short_window_prefix():
    """A source smaller than one window keeps rows at slot == position in the larger ring."""
    args = tiny_args()
    source = dc.Deepseek4Cache(args, dp.plan(args, 8))
    fill(source, 0)
    source.commit(6)
    target = dc.Deepseek4Cache(args, dp.plan(args, 64))
    target.migrate_from(source)
    np.testing.assert_array_equal(arrays(target)[0]["window"][:6], arrays(source)[0]["window"][:6])


def test_failed_migration_leaves_source_usable():
    args = tiny_args()
    source = dc.Deepseek4Cache(args, dp.plan(args, 256))
    fill(source, 0)
    source.commit(50)
    before = arrays(source)
    target = dc.Deepseek4Cache(args, dp.plan(args, 128))
    target_before = arrays(target)
    with pytest.raises(dc.MigrationContext):
        target.migrate_from(source)
    other_window = replace(args, sliding_window=32)
    with pytest.raises(dc.MigrationPlanMismatch):
        dc.Deepseek4Cache(other_window, dp.plan(other_window, 512)).migrate_from(source)
    fewer = replace(args, num_hidden_layers=4, compress_ratios=(0, 0, 4, 128))
    with pytest.raises(dc.MigrationLayerCount):
        dc.Deepseek4Cache(fewer, dp.plan(fewer, 512)).migrate_from(source)
    bigger = dc.Deepseek4Cache(args, dp.plan(args, 512))
    stale = dc.Deepseek4Cache(args, dp.plan(args, 64)).snapshot()
    with pytest.raises(dc.MigrationSnapshotPlanMismatch):
        bigger.migrate_from(source, stale)
    ahead = source.snapshot()
    source.restore(dc.Deepseek4CacheSnapshot(ahead.plan, 10, ahead.layers))
    with pytest.raises(dc.MigrationSnapshotPosition):
        bigger.migrate_from(source, ahead)
    assert bigger.position == 0
    source.restore(ahead)
    source.poison()
    with pytest.raises(base.CachePoisoned):
        bigger.migrate_from(source)
    source.restore(ahead)
    assert source.position == 50 and not source.is_poisoned
    source.check_chunk(10)  # still serves
    for layer_before, layer_now in zip(before, arrays(source), strict=True):
        for kind in layer_before:
            np.testing.assert_array_equal(layer_now[kind], layer_before[kind])
    for layer_before, layer_now in zip(target_before, arrays(target), strict=True):
        for kind in layer_before:
            np.testing.assert_array_equal(layer_now[kind], layer_before[kind])


def test_check_chunk_grows_capacity():
    args = tiny_args()
    cache = dc.Deepseek4Cache(args, dp.plan(args, 64), context_length=4096)
    fill(cache, 0)
    cache.commit(60)
    before = arrays(cache)
    cache.check_chunk(10)  # 70 > 64: grows to the serving context (one 131,072 step)
    assert cache.capacity == 4096 and cache.position == 60
    assert cache.nbytes == dp.plan(args, 4096).resident_bytes == cache.plan().resident_bytes
    np.testing.assert_array_equal(np.array(cache[3].main_kv_state), before[3]["main_kv_state"])
    np.testing.assert_array_equal(arrays(cache)[2]["compressed"][:15], before[2]["compressed"][:15])
    with pytest.raises(base.ContextExhausted):
        cache.check_chunk(4096)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from worker.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_plan_flash_without_weights(capsys):
    import json

    rc, out, _ = run_cli(
        capsys, "plan", "--model", "deepseek4-flash", "--context", "131072", "--json"
    )
    assert rc == 0
    record = json.loads(out.strip().splitlines()[-1])
    assert record["n_layers"] == 43 and record["context_length"] == 131_072
    assert record["bytes_per_token"] == FLASH_BYTES_PER_TOKEN
    assert record["fixed_bytes"] == 17_842_176
    assert record["resident_bytes"] == 17_842_176 + FLASH_BYTES_PER_TOKEN * 131_072
    assert record["kv_dtype"] == "bfloat16"
    rc, out, _ = run_cli(capsys, "plan", "--model", "deepseek4-flash", "--context", "1024")
    assert rc == 0 and "layer  3 (ratio 128): window [128, 512], compressed [8, 512]" in out


def test_cli_plan_errors(capsys):
    rc, _, err = run_cli(capsys, "plan", "--model", "deepseek4-flash", "--context", "0")
    assert rc == 2 and "--context" in err
    rc, _, err = run_cli(capsys, "plan", "--model", "deepseek4-flash", "--context", "2097152")
    assert rc == 2 and "exceeds model bound" in err
    rc, _, err = run_cli(capsys, "plan", "--model", "no-such-model", "--context", "16")
    assert rc == 2 and "unknown model" in err


def test_flash_is_config_only():
    from model.registry import ModelNotFound, load_model

    with pytest.raises(ModelNotFound, match="config only"):
        load_model("deepseek4-flash")
