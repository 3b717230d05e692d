"""`model.kernels.flash_attention` on the CPU: the dispatch rules and the key-split plan
(the kernel itself runs on a CUDA GPU only; `python -m bench.gpu_attention --check` checks it
there against the unfused path)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from model.kernels import flash_attention as fa


def test_the_cpu_never_takes_the_fused_path():
    q = mx.zeros((1, 4, 8, 256), dtype=mx.bfloat16)
    assert not fa.available() and not fa.applies(q, q[:, :1])


def test_supports_bf16_head_dim_256_and_whole_kv_groups():
    def arrays(d=256, dtype=mx.bfloat16, h=4, kvh=1):
        return mx.zeros((1, h, 8, d), dtype=dtype), mx.zeros((1, kvh, 8, d), dtype=dtype)

    assert fa.supports(*arrays())
    assert not fa.supports(*arrays(d=128))
    assert not fa.supports(*arrays(dtype=mx.float32))
    assert not fa.supports(*arrays(h=4, kvh=3))
    with pytest.raises(ValueError, match="head dim"):
        fa.flash_attention(*arrays(d=128), arrays(d=128)[1], 0.1, 0, None)


@pytest.mark.parametrize("q_blocks, key_blocks, splits", [
    (512, 128, 1),    # 8K queries x 4 heads fill the GPU already
    (128, 128, 3),    # a 2,048-token chunk of 4 heads: split to reach TARGET_BLOCKS
    (128, 64, 2),     # 64 key blocks: at least MIN_KEY_BLOCKS_PER_SPLIT (32) each
    (128, 9, 1),      # a sliding layer's 9 blocks: not worth a split
    (4, 3, 1),        # too few keys to split
    (1, 1000, 31),    # 264 wanted, 1,000 // 32 allowed
])
def test_key_splits_fill_the_gpu_without_tiny_splits(q_blocks, key_blocks, splits):
    assert fa.splits_for(q_blocks, key_blocks) == splits


def test_the_kernel_source_ships_with_the_package():
    from importlib.resources import files

    kernels = files("model.kernels")
    assert kernels.joinpath("flash_attention.cu").read_text() == fa.SOURCE
    assert kernels.joinpath("mma.cuh").read_text() == fa.HEADER
    assert "mma.sync.aligned.m16n8k16" in fa.HEADER and "qk_tiles<" in fa.SOURCE


def test_the_grid_plan_counts_the_keys_a_block_may_see():
    # a 2,048-token chunk of 4 heads after 6,144 keys: 32 query blocks, split 3 ways
    assert fa.grid_plan(1, 4, 2048, 8192, None) == (32, 3, 4)
    # under a 512 window a block sees 576 keys (9 blocks of 64): too few to split
    assert fa.grid_plan(1, 4, 2048, 2559, 512) == (32, 1, 4)
    # 8 warps: blocks of 128 queries; 128 key blocks allow 4 splits of 32
    assert fa.grid_plan(1, 4, 2048, 8192, None, warps=8) == (16, 4, 8)


def test_a_packed_step_launches_a_block_per_64_queries_of_each_job():
    jobs = (*fa.fresh_jobs((1, 64)), fa.PackedJob(65, 65 + 300, 300), fa.PackedJob(130, 130, 0))
    table = fa.query_blocks(jobs, 64).tolist()
    # (first query row, rows, block within the job, first key row, keys, position): no block
    # spans two jobs; the third job's keys start with its cache's 300 rows
    assert table == [[0, 1, 0, 0, 1, 0], [1, 64, 0, 1, 64, 0],
                     [65, 65, 0, 65, 365, 300], [65, 65, 1, 65, 365, 300],
                     [130, 130, 0, 430, 130, 0], [130, 130, 1, 430, 130, 0],
                     [130, 130, 2, 430, 130, 0]]


@pytest.mark.parametrize(("keys", "jobs", "match"), [
    (10, fa.fresh_jobs((4, 5)), r"q \(1, 4, 10, 256\)"),  # rows sum to 9
    (12, fa.fresh_jobs((4, 6)), r"keys mlx.core.bfloat16 \(1, 1, 12, 256\)"),  # keys sum to 10
    (10, (fa.PackedJob(4, 3, 0), fa.PackedJob(6, 7, 0)), "PackedJob"),  # fewer keys than rows
    (10, (fa.PackedJob(4, 4, 0), fa.PackedJob(6, 6, -1)), "PackedJob"),  # keys before 0
    (15, (fa.PackedJob(4, 4, 0), fa.PackedJob(6, 11, 4)), "PackedJob"),  # 5 keys before 4
])
def test_packed_attention_refuses_jobs_that_miss_the_rows_or_keys(keys, jobs, match):
    q = mx.zeros((1, 4, 10, 256), dtype=mx.bfloat16)
    k = mx.zeros((1, 1, keys, 256), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match=match):
        fa.packed_flash_attention(q, k, k, 0.1, jobs, None)


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_the_split_combine_weights_each_split_by_its_share_of_the_softmax(splits):
    # (B, H, splits, L, D) partial outputs with their log-sum-exps: the combined rows are
    # the softmax over all keys, i.e. the splits weighted by exp(lse_s) / sum exp(lse)
    key = mx.random.key(splits)
    parts = mx.random.normal((1, 2, splits, 5, 8), key=key)
    lse = 3 * mx.random.normal((1, 2, splits, 5), key=mx.random.split(key)[0])
    weights = mx.exp(lse - mx.logsumexp(lse, axis=2, keepdims=True))[..., None]
    expected = (weights * parts).sum(axis=2)
    out = fa._combine(parts, lse, mx.float32)
    assert out.shape == (1, 2, 5, 8) and out.dtype == mx.float32
    assert mx.allclose(out, expected, atol=1e-6).item()
    assert fa._combine(parts, lse, mx.bfloat16).dtype == mx.bfloat16
