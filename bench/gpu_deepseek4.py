"""DeepSeek-V4 attention on a CUDA GPU: exactness checks and a micro-benchmark of the fused
per-query key-list kernel (`model.kernels.sparse_attention`).

- `check_sparse_kernel`: the kernel against `gathered_attention` (float32 on the same bf16
  inputs) at DeepSeek-V4-Flash's attention shape (64 heads of 512, one KV head), lists of
  window, dense-compressed and top-k shapes with empty slots, a query with no key, random
  sinks; max |difference| over max |reference| within `BF16_TOLERANCE`.
- `check_gathered_model`: a DeepSeek-V4-Flash prefix (random weights, bf16) prefilled
  through the product's path (the kernel, top-k rows gathered) against the masked dense
  form (MLX attention over every compressed row under a mask); final logits within
  `MODEL_TOLERANCE`.
- `micro`: one ratio-4 layer's attention for a 2,048-token chunk at 8K (window 128 + top-k
  512 per query): the kernel, `gathered_attention` in MLX ops, and the masked dense MLX
  attention the model ran before.
"""

from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import mlx.core as mx
import numpy as np

from model.archs import deepseek4
from model.archs.deepseek4 import model as ds_model
from model.archs.deepseek4.sparse import gathered_attention
from model.kernels import sparse_attention as sa
from model.prefill import start_prefill

from .common import Recorder, log
from .gpu_attention import BF16_TOLERANCE, _seconds

H, D = 64, 512
# A 4-layer bf16 prefix through two attention paths (different summation orders and
# roundings of P): final logits differ by bf16 noise grown through 4 layers and the MoE,
# a few x 2^-8 of max |logit|; a wrong selection or mask moves them by O(1).
MODEL_TOLERANCE = 3e-2

SPARSE_CHECKS = [  # (queries, slots per query, rows, share of empty slots)
    (1, 128, 300, 0.0), (100, 192, 500, 0.3), (2048, 640, 4224, 0.1),
    (37, 640, 700, 0.9), (5, 33, 40, 0.0),  # a partial last tile
]


def _sparse_inputs(L: int, K: int, N: int, empty: float, seed: int = 0):
    rng = np.random.default_rng(seed + L)
    q = mx.random.normal((1, H, L, D), key=mx.random.key(seed + L)).astype(mx.bfloat16)
    kv = mx.random.normal((N, D), key=mx.random.key(seed + N)).astype(mx.bfloat16)
    idx = np.stack([rng.choice(N, K, replace=False) for _ in range(L)]).astype(np.int32)
    idx[rng.random(idx.shape) < empty] = -1
    sinks = mx.array(rng.standard_normal(H), dtype=mx.float32)
    return q, kv, mx.array(idx), sinks


def check_sparse_kernel(rec: Recorder) -> bool:
    ok = True
    for L, K, N, empty in SPARSE_CHECKS:
        q, kv, idx, sinks = _sparse_inputs(L, K, N, empty)
        if L > 1:
            idx[0] = -1  # query 0 sees no key: zeros
        ours = sa.sparse_attention(q, kv, idx, sinks, D**-0.5).astype(mx.float32)
        ref = gathered_attention(q.astype(mx.float32), kv.astype(mx.float32), idx, sinks,
                                 D**-0.5)
        diff = float(mx.abs(ours - ref).max() / mx.abs(ref).max())
        good = diff <= BF16_TOLERANCE and not mx.isnan(ours).any().item()
        if L > 1:
            good &= float(mx.abs(ours[0]).max()) == 0.0
        ok &= good
        rec("sparse_attention_check", diff, "max|diff|/max|ref|", ceiling=BF16_TOLERANCE,
            heads=H, head_dim=D, queries=L, slots=K, rows=N, empty_share=empty)
    return ok


def _prefill_logits(model, ids: list[int], chunk: int) -> mx.array:
    prefill = start_prefill(model, ids, vocab_size=model.args.vocab_size,
                            context_length=model.args.context_length, chunk_tokens=chunk,
                            kv_dtype=mx.bfloat16)
    return mx.array(prefill.run())


def check_gathered_model(rec: Recorder, n_layers: int = 4, n: int = 8192,
                         chunk: int = 2048) -> bool:
    model = deepseek4.dummy_model(deepseek4.flash_args(), n_layers=n_layers,
                                  dtype=mx.bfloat16)
    ids = mx.random.randint(0, model.args.vocab_size, (n,), key=mx.random.key(1)).tolist()
    fused = _prefill_logits(model, ids, chunk)
    with ExitStack() as stack:  # the masked dense form: MLX attention, no gathering
        stack.enter_context(mock.patch.object(sa, "applies", lambda q, kv: False))
        stack.enter_context(mock.patch.object(ds_model.Attention, "gather_top_k", False))
        dense = _prefill_logits(model, ids, chunk)
    diff = float(mx.abs(fused - dense).max() / mx.abs(dense).max())
    ok = diff <= MODEL_TOLERANCE and not mx.isnan(fused).any().item()
    rec("deepseek4_gathered_check", diff, "max|diff|/max|logit|", ceiling=MODEL_TOLERANCE,
        layers=n_layers, n_tokens=n, chunk_tokens=chunk,
        top1_agrees=int(fused.argmax()) == int(dense.argmax()))
    return ok


def micro(rec: Recorder, L: int = 2048, position: int = 6144, topk: int = 512,
          window: int = 128) -> None:
    """One ratio-4 layer's attention, the chunk at `position` (`position + L` tokens in)."""
    n_rows = (position + L) // 4
    n_prev = window - 1
    N = n_prev + L + n_rows
    rng = np.random.default_rng(0)
    q = mx.random.normal((1, H, L, D)).astype(mx.bfloat16)
    kv = mx.random.normal((N, D)).astype(mx.bfloat16)
    sinks = mx.zeros((H,), dtype=mx.float32)
    win = np.arange(L)[:, None] + np.arange(window)[None, :]  # rows of each query's window
    top = np.stack([rng.choice(n_rows, topk, replace=False) for _ in range(L)])
    idx = mx.array(np.concatenate([win, n_prev + L + top], axis=1).astype(np.int32))
    mask = np.zeros((L, N), dtype=bool)
    np.put_along_axis(mask, np.array(idx), True, axis=1)
    mask = mx.array(mask)
    flops = 2 * 2 * H * D * L * (window + topk)
    keys = kv[None, None]
    for impl, fn in (
            ("prefillq fused", lambda: sa.sparse_attention(q, kv, idx, sinks, D**-0.5)),
            ("gathered mlx ops", lambda: gathered_attention(q, kv, idx, sinks, D**-0.5)),
            ("mlx sdpa masked dense", lambda: mx.fast.scaled_dot_product_attention(
                q, keys, keys, scale=D**-0.5, mask=mask, sinks=sinks.astype(q.dtype)))):
        s = _seconds(fn)
        rec("deepseek4_attention_seconds", s, "s", impl=impl, queries=L, position=position,
            slots=window + topk, keys=N, tflops_useful=round(flops / s / 1e12, 1))
    log("deepseek4 attention micro-benchmark done")
