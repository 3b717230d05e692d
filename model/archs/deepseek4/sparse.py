"""DeepSeek-V4 attention as per-query key lists (the reference's ``sparse_attn``).

`window_slots` and `compressed_slots` build each query's list into `Attention._keys`' rows;
`gathered_attention` attends them in MLX ops (the reference for the CUDA kernel,
`model.kernels.sparse_attention`, and the path on other devices).
"""

from __future__ import annotations

import mlx.core as mx

# Gathered key elements held at once (queries x slots x head dim): long chunks run in
# blocks of queries.
GATHER_BUDGET = 1 << 26


def window_slots(L: int, n_prev: int, window: int) -> mx.array:
    """int32 ``(L, window)``: the window of each of a chunk's `L` queries as rows of its
    keys. The keys are the `n_prev` rows before the chunk, then the chunk's, so the chunk's
    query ``i`` sits at row ``n_prev + i`` and sees rows ``(n_prev + i - window, n_prev +
    i]``; a slot before row 0 (the prompt's start) is -1."""
    rows = mx.arange(L)[:, None] + (n_prev - window + 1) + mx.arange(window)[None, :]
    return mx.where(rows >= 0, rows, -1).astype(mx.int32)


def compressed_slots(position: int, L: int, base: int, n_rows: int, ratio: int,
                     top: mx.array | None = None) -> mx.array:
    """int32 ``(L, n_rows)`` (or ``(L, k)`` with `top`): the compressed rows each query
    ``position + i`` may see, as rows of the keys (compressed row ``j`` at ``base + j``);
    -1 for a row it may not.

    Row ``j`` pools tokens below ``(j + 1) * ratio``, so query ``p`` sees ``j < (p + 1) //
    ratio``. `top`: int ``(L, k)``, the indexer's chosen rows per query (top-k), which
    may name rows a query cannot see yet (its score was -inf); they become -1.
    """
    seen = (mx.arange(position, position + L)[:, None] + 1) // ratio  # (L, 1)
    rows = mx.arange(n_rows)[None, :] if top is None else top.astype(mx.int32)
    return mx.where(rows < seen, rows + base, -1).astype(mx.int32)


def gathered_attention(q: mx.array, kv: mx.array, idx: mx.array, sinks: mx.array,
                       scale: float, budget: int = GATHER_BUDGET) -> mx.array:
    """Each query's attention over the rows of `kv` its list names, with a per-head sink.

    ``softmax`` over the listed rows' scores ``scale * q . kv[row]`` plus the sink logit
    (the sink's share is dropped), then the weighted sum of the same rows (K = V):
    DeepSeek-V4 reference ``inference/model.py`` ``Attention`` and ``kernel.py``
    ``sparse_attn``. On a ratio-4 layer it touches the top-k rows per query instead of every
    compressed row under a mask, which is what keeps a 1M-token context affordable.

    Args:
        q: ``(1, H, L, D)``.
        kv: ``(N, D)``, keys = values.
        idx: int32 ``(L, K)``, row numbers into `kv`, -1 for an empty slot.
        sinks: ``(H,)``, sink logits.
        scale: score scale.
        budget: gathered elements at once (``queries x K x D``); more run in blocks.
    Returns:
        ``(L, H, D)`` in q's dtype, computed in float32; zeros for a query with no key.
        Rows must be below N; they are not checked (callers build `idx` with
        `window_slots` and `compressed_slots`).
    """
    L, K = idx.shape
    qt = q[0].transpose(1, 0, 2)  # (L, H, D)
    block = max(1, min(L, budget // max(1, K * q.shape[-1])))
    sink = sinks.astype(mx.float32)[None, :, None]
    outs = []
    for b in range(0, L, block):
        rows = idx[b : b + block]
        keys = kv[mx.maximum(rows, 0)].astype(mx.float32)  # (n, K, D)
        scores = (qt[b : b + block].astype(mx.float32) @ keys.swapaxes(1, 2)) * scale
        scores = mx.where((rows >= 0)[:, None, :], scores, -mx.inf)  # (n, H, K)
        logits = mx.concatenate([scores, mx.broadcast_to(sink, (*scores.shape[:2], 1))], -1)
        weights = mx.softmax(logits, axis=-1)[..., :K]
        outs.append((weights @ keys).astype(q.dtype))
    return mx.concatenate(outs, axis=0)
