"""DeepSeek-V4 attention as per-query key lists (`model.archs.deepseek4.sparse`), on the CPU:
the lists hand-checked, the gathered attention equal to masked dense attention with the
sink, the tiny model's gathered top-k layers equal to their masked dense form, and the fused
CUDA kernel's dispatch rules (the kernel itself runs on a GPU only: `python -m bench.gpu
--check` compares it there with `gathered_attention`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.archs import deepseek4 as ds
from model.archs.deepseek4 import model as ds_model
from model.archs.deepseek4.sparse import compressed_slots, gathered_attention, window_slots
from model.chunk import prefill_chunk
from model.gguf.reader import read_gguf
from model.gguf.synthetic import tiny_deepseek4_path
from model.kernels import sparse_attention as sa

# float32 on the CPU: gathered vs masked dense attention measure ~3e-7 x max |out|.
ATTENTION_BOUND = 3e-6
# tiny model, gathered top-k vs masked dense, x max |logit| (test_deepseek4's CHUNKED_BOUND)
MODEL_BOUND = 3e-6


def test_window_slots_name_the_window_rows_before_each_query():
    # a chunk of 3 at a position with 2 earlier rows kept (window 4: n_prev = 3 would be the
    # most; 2 means the prompt started 2 rows ago): row r holds position position - 2 + r
    assert window_slots(3, 2, 4).tolist() == [[-1, 0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4]]
    # the first chunk of a prompt: nothing before query 0
    assert window_slots(2, 0, 3).tolist() == [[-1, -1, 0], [-1, 0, 1]]


def test_compressed_slots_show_a_row_once_its_tokens_are_in():
    # ratio 4, queries at 6, 7, 8 over 3 rows placed after 5 window rows: row j pools
    # tokens < 4 (j + 1), so query 7 is the first to see row 1 and query 11 row 2
    assert compressed_slots(6, 3, 5, 3, 4).tolist() == [
        [5, -1, -1], [5, 6, -1], [5, 6, -1]]
    # top-k lists: a chosen row the query cannot see yet is dropped
    top = mx.array([[2, 0], [1, 0], [0, 1]])
    assert compressed_slots(6, 3, 5, 3, 4, top).tolist() == [[-1, 5], [6, 5], [5, 6]]


def _dense_reference(q, kv, idx, sinks, scale):
    """Masked dense attention over every row of kv, the listed ones visible, MLX's sink."""
    L, N = idx.shape[0], kv.shape[0]
    listed = np.zeros((L, N), dtype=bool)
    for i, rows in enumerate(np.array(idx)):
        listed[i, rows[rows >= 0]] = True
    keys = kv[None, None]
    out = mx.fast.scaled_dot_product_attention(q, keys, keys, scale=scale,
                                               mask=mx.array(listed), sinks=sinks)
    return out[0].transpose(1, 0, 2)  # (L, H, D)


@pytest.mark.parametrize("L, N, K, budget", [
    (5, 40, 12, 1 << 26),   # one block
    (33, 70, 20, 640),      # blocks of 1 query: the budget binds
    (9, 16, 16, 1 << 26),   # every row listed for someone, -1 slots between
])
def test_gathered_attention_equals_masked_dense_attention_with_the_sink(L, N, K, budget):
    rng = np.random.default_rng(L + N)
    H, D = 4, 32
    q = mx.array(rng.standard_normal((1, H, L, D)), dtype=mx.float32)
    kv = mx.array(rng.standard_normal((N, D)), dtype=mx.float32)
    sinks = mx.array(rng.standard_normal(H) * 2, dtype=mx.float32)
    idx = np.stack([rng.choice(N, K, replace=False) for _ in range(L)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.3] = -1  # empty slots
    idx[0, :-1] = -1  # query 0 sees one key
    out = gathered_attention(q, kv, mx.array(idx), sinks, D**-0.5, budget=budget)
    ref = _dense_reference(q, kv, mx.array(idx), sinks, D**-0.5)
    diff = float(mx.abs(out - ref).max() / mx.abs(ref).max())
    assert out.shape == (L, H, D) and diff <= ATTENTION_BOUND


def test_a_query_with_no_key_attends_only_the_sink():
    q = mx.ones((1, 2, 2, 8))
    kv = mx.ones((3, 8))
    idx = mx.array([[-1, -1], [0, 2]], dtype=mx.int32)
    out = gathered_attention(q, kv, idx, mx.zeros((2,)), 1.0)
    assert float(mx.abs(out[0]).max()) == 0.0 and float(out[1].min()) > 0.99


@pytest.fixture(scope="module")
def model():
    path, _ = tiny_deepseek4_path()
    return ds.load(read_gguf(path), mx.float32)


def _logits(model, ids, chunk):
    cache = model.make_cache(mx.float32, capacity=len(ids))
    for start in range(0, len(ids), chunk):
        hidden = prefill_chunk(model, cache, ids[start : start + chunk])
    return np.array(model.logits(hidden)[0])


def test_the_tiny_models_gathered_top_k_equals_its_masked_dense_form(model, monkeypatch):
    a = model.args
    assert ds_model.OVERLAP_RATIO in a.compress_ratios[: a.num_hidden_layers]
    n = 200  # 50 ratio-4 rows > top-k 3: the indexer binds
    assert n // ds_model.OVERLAP_RATIO > a.index_topk
    ids = [int(t) for t in np.random.default_rng(4).integers(0, a.vocab_size, n)]
    calls = []
    real = ds_model.gathered_attention
    monkeypatch.setattr(ds_model, "gathered_attention",
                        lambda *args, **kw: calls.append(1) or real(*args, **kw))
    gathered = _logits(model, ids, 64)
    assert calls, "no chunk took the gathered path"
    monkeypatch.setattr(ds_model.Attention, "gather_top_k", False)
    calls.clear()
    dense = _logits(model, ids, 64)
    assert not calls
    scale = float(np.abs(dense).max())
    assert float(np.abs(gathered - dense).max()) <= MODEL_BOUND * scale
    assert int(gathered.argmax()) == int(dense.argmax())


def test_the_fused_kernel_takes_bf16_head_dim_512_in_blocks_of_64_heads():
    def arrays(d=512, dtype=mx.bfloat16, h=64):
        return mx.zeros((1, h, 4, d), dtype=dtype), mx.zeros((10, d), dtype=dtype)

    assert sa.supports(*arrays()) and sa.supports(*arrays(h=128))
    assert not sa.supports(*arrays(d=256))
    assert not sa.supports(*arrays(dtype=mx.float32))
    assert not sa.supports(*arrays(h=32))
    assert not sa.applies(*arrays())  # the CPU never takes it
    with pytest.raises(ValueError, match="head dim"):
        sa.sparse_attention(*arrays(d=256), mx.zeros((4, 2), mx.int32), mx.zeros((64,)), 1.0)
    with pytest.raises(ValueError, match="idx must be"):
        sa.sparse_attention(*arrays(), mx.zeros((3, 2), mx.int32), mx.zeros((64,)), 1.0)


def test_the_kernels_shared_memory_fits_an_h100_class_sm():
    # 227 KB of shared memory per block on sm_90 (Hopper): the Q tile, two key tiles,
    # the S exchange and the indices
    assert sa.shared_bytes(512, 32) == 149_760 <= 227 * 1024
    assert "qk_tiles<" in sa.SOURCE and "cp_async16" in sa.SOURCE
