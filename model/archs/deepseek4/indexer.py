"""DeepSeek-V4 lightning indexer: the top-k compressed rows each query of a ratio-4 layer
attends (DeepSeek-V4 reference ``inference/model.py``, ``Indexer``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import LayerCache
from .compressor import Compressor
from .layers import rope
from .planning import OVERLAP_RATIO

if TYPE_CHECKING:
    from .model import ModelArgs


class Indexer(nn.Module):
    """Lightning indexer: per query, the top-k visible compressed rows (reference ``Indexer``).

    The reference's Hadamard rotation of q and k is orthogonal and cancels in q.k; its FP4
    quantization simulation is not modelled.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = (
            args.index_n_heads,
            args.index_head_dim,
            args.index_topk,
        )
        self.attn_q_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.indexer_compressor = Compressor(args, OVERLAP_RATIO, self.head_dim)

    def update(self, x: mx.array, layer: LayerCache, position: int, inv_freq) -> None:
        """Pool the chunk `x` ``(1, L, H)`` into index keys (rows completed by it)."""
        g0, rows = self.indexer_compressor(x[0], layer, "indexer", position, inv_freq)
        if rows is not None:
            layer.indexer[g0 : g0 + rows.shape[0]] = rows.astype(layer.indexer.dtype)

    def top_rows(self, x, qr, layer: LayerCache, position: int, n_rows: int, inv_freq
                 ) -> mx.array:
        """int32 ``(L, topk)``: the `topk` compressed rows with the highest index scores for
        each query ``position + i`` of `x` ``(1, L, H)`` among the ``n_rows > topk`` rows
        of `layer`. A query that sees fewer than `topk` rows (row ``j`` is visible to query
        ``p`` iff ``j < (p + 1) // 4``) gets all of them plus rows it cannot see, which
        callers drop (`sparse.compressed_slots`)."""
        B, L, _ = x.shape
        q = self.attn_q_b(qr).reshape(B, L, self.n_heads, self.head_dim)
        q = rope(q, np.arange(position, position + L), inv_freq)[0]  # (L, heads, head_dim)
        keys = layer.indexer[:n_rows].astype(q.dtype)
        weights = self.proj(x)[0] * (self.head_dim**-0.5 * self.n_heads**-0.5)  # (L, heads)
        per_head = nn.relu(q @ keys.T)  # (L, heads, n_rows)
        score = (weights[..., None] * per_head).sum(axis=1).astype(mx.float32)
        seen = (mx.arange(position, position + L)[:, None] + 1) // OVERLAP_RATIO
        score = mx.where(mx.arange(n_rows)[None, :] < seen, score, -mx.inf)
        # exactly top-k rows (ties broken arbitrarily, as torch.topk does)
        return mx.argpartition(-score, self.topk - 1, axis=-1)[..., : self.topk]

    def select(self, x, qr, layer: LayerCache, position: int, visible: mx.array, inv_freq):
        """Boolean ``(L, n_rows)``: the rows each query ``position + i`` of `x` ``(1, L, H)``
        attends, the top-k by index score among `visible` (all of them if fewer): the mask
        form of `top_rows`, for dense attention."""
        n_rows = visible.shape[1]
        if n_rows <= self.topk:
            return visible
        top = self.top_rows(x, qr, layer, position, n_rows, inv_freq)
        chosen = mx.put_along_axis(mx.zeros(visible.shape, mx.bool_), top, mx.array(True),
                                   axis=-1)
        return visible & chosen
