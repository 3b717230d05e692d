"""Attention of a chunk's queries over what a `model.kv_cache` layer returned, on MLX's SDPA.

Shared by the architectures whose layers use the standard caches (`gemma3`, `llama`). On a
CUDA GPU MLX fuses ``mx.fast.scaled_dot_product_attention`` (cuDNN) for float16/bfloat16
with head dims that are multiples of 8 up to 128; elsewhere (the CPU, wider heads) it
composes matmuls and a softmax, which is why long chunks are attended in blocks here.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..cache import window_mask
from ..runtime.streams import split_map

# The fewest queries per block on the CPU: below this, a block's own ops (slices, a mask, an
# attention call) cost more than the scores a smaller block would skip.
MIN_CPU_BLOCK = 64


def attention_block(window: int | None = None) -> int:
    """Queries per block of `blocked_attention` on the default device.

    On the CPU, bound by exponentials (so skipping masked scores pays): 512, or for a
    sliding-window layer the window itself if smaller, at least `MIN_CPU_BLOCK`. A block of
    ``b`` queries under a window ``w`` computes ``b x (b + w - 1)`` scores for ``b x w``
    visible ones; a 512-query block under a 16-token window would compute 33 scores per
    visible one, a 64-query block 5. Elsewhere 1,024 (bound by kernel launches, so fewer,
    larger blocks pay).
    """
    if mx.default_device() != mx.cpu:
        return 1024
    return min(512, max(MIN_CPU_BLOCK, window)) if window else 512


def blocked_above(window: int | None = None) -> int:
    """Chunk length in queries above which `cache_attention` attends in blocks: one block on
    the CPU (`attention_block` of `window`), 2,048 elsewhere (shorter chunks run faster in
    one masked attention there)."""
    return attention_block(window) if mx.default_device() == mx.cpu else 2048


def masked_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask
                     ) -> mx.array:
    """MLX's attention under `mask` (``"causal"``, a bool array, or None)."""
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def blocked_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    position: int,
    window: int | None,
    block: int | None = None,
) -> mx.array:
    """Causal (optionally sliding-window) attention of a long chunk, in blocks of queries.

    One (L, n_keys) masked attention computes, and exponentiates, every score, then the mask
    discards the ones a query may not see: half of them for a whole-prompt causal pass,
    more under a window. Each block of `block` queries here attends only to the keys some
    query in it may see, ``[first query - window + 1, last query]`` (or from the first key
    without a window), under the same mask, so the softmax runs over the same keys and the
    masked-out scores are mostly never computed. Block ``b`` of a chunk at `position` with
    ``n_prev`` earlier keys costs ``block x (n_prev + (b + 1) block)`` scores instead of
    ``block x (n_prev + L)``; with a window, ``block x (block + window - 1)``.

    Args:
        q: ``(B, heads, L, head_dim)``, queries at positions ``[position, position + L)``.
        keys, values: ``(B, kv_heads, n_prev + L, head_dim)``, the first at position
            ``position - n_prev`` (`RingKVCache.update`: ``min(position, window - 1)``;
            `GlobalKVCache.update`: all ``position`` earlier rows).
        scale: the score scale.
        position: the chunk's first position.
        window: the sliding window (a query at p sees keys in ``(p - window, p]``), or None.
        block: queries per block (default `attention_block` of `window`).
    Returns:
        ``(B, heads, L, head_dim)``.
    """
    block = block or attention_block(window)
    L = q.shape[2]
    k_start = position - (keys.shape[2] - L)
    outs = []
    for i0 in range(0, L, block):
        i1 = min(i0 + block, L)
        first = position + i0
        lo = (max(k_start, first - window + 1) if window else k_start) - k_start
        hi = position + i1 - k_start
        if window and first + (i1 - i0) - 1 - (k_start + lo) >= window:
            mask = window_mask(first, i1 - i0, k_start + lo, hi - lo, window)
        else:
            mask = "causal"  # MLX aligns the last query with the last key: exactly this
        outs.append(mx.fast.scaled_dot_product_attention(
            q[:, :, i0:i1], keys[:, :, lo:hi], values[:, :, lo:hi], scale=scale, mask=mask))
    return mx.concatenate(outs, axis=2)


def attend_by_groups(fn: Callable[..., mx.array], n_kv_heads: int, q: mx.array,
                     keys: mx.array, values: mx.array, *args) -> mx.array:
    """``fn(q, keys, values, *args)`` with its heads on parallel CPU streams.

    Query heads are independent; a group of ``n_heads / n_kv_heads`` consecutive ones shares
    one KV head. With one KV head the query heads are split; otherwise whole groups, each
    slice taking its own KV heads. Shapes as `blocked_attention`'s.
    """
    if n_kv_heads == 1:
        return split_map(fn, [q], axis=1, shared=(keys, values, *args))
    B, H, L, D = q.shape
    grouped = q.reshape(B, n_kv_heads, H // n_kv_heads, L, D)

    def group_slice(q5: mx.array, k: mx.array, v: mx.array) -> mx.array:
        return fn(q5.reshape(B, -1, L, D), k, v, *args)

    return split_map(group_slice, [grouped, keys, values], axis=1)


def cache_attention(q: mx.array, keys: mx.array, values: mx.array, mask, *, scale: float,
                    position: int, window: int | None, n_kv_heads: int) -> mx.array:
    """A chunk's queries ``(B, heads, L, head_dim)`` over the keys, values and mask a
    `model.kv_cache` layer's ``update`` returned: one masked attention, or blocks of queries
    (`blocked_attention`) for a chunk longer than `blocked_above` of `window`; heads on
    parallel CPU streams (`attend_by_groups`). Returns ``(B, heads, L, head_dim)``."""
    if q.shape[2] > blocked_above(window) and mask is not None:
        return attend_by_groups(blocked_attention, n_kv_heads, q, keys, values, scale,
                                position, window)
    return attend_by_groups(masked_attention, n_kv_heads, q, keys, values, scale, mask)
