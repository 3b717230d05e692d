"""DeepSeek-V4 compressor: gated pooling of every `ratio` tokens into one KV row, carrying
the partial window across chunks (DeepSeek-V4 reference ``inference/model.py``,
``Compressor``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import LayerCache
from .layers import Param, rope
from .planning import OVERLAP_RATIO

if TYPE_CHECKING:
    from .model import ModelArgs


class Compressor(nn.Module):
    """Gated pooling of every `ratio` tokens into one row (reference ``Compressor``)."""

    def __init__(self, args: ModelArgs, ratio: int, dim: int):
        super().__init__()
        self.ratio, self.dim = ratio, dim
        self.coff = 2 if ratio == OVERLAP_RATIO else 1
        self.ape = Param((ratio, self.coff * dim))
        self.kv = nn.Linear(args.hidden_size, self.coff * dim, bias=False)
        self.gate = nn.Linear(args.hidden_size, self.coff * dim, bias=False)
        self.norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)

    def __call__(self, x, layer: LayerCache, prefix: str, position: int, inv_freq) -> tuple:
        """Pool the chunk `x` ``(L, H)`` at `position`, carrying state in `layer`.

        Returns:
            ``(first_row, rows)``: new compressed rows ``(n, dim)`` (normed, RoPE'd at
            ``row*ratio``), or ``rows=None`` when no window completed in this chunk.
        """
        r, d, L = self.ratio, self.dim, x.shape[0]
        off = r if self.coff == 2 else 0  # remainder slots follow the previous window
        kv_state = getattr(layer, f"{prefix}_kv_state")
        score_state = getattr(layer, f"{prefix}_score_state")
        ape = self.ape.weight[mx.arange(position, position + L) % r]  # no host array
        kv = self.kv(x).astype(mx.float32)
        score = self.gate(x).astype(mx.float32) + ape
        rem, g0 = position % r, position // r
        seq_kv = mx.concatenate([kv_state[off : off + rem], kv])  # from token g0*r on
        seq_score = mx.concatenate([score_state[off : off + rem], score])
        n = (rem + L) // r
        tail = rem + L - n * r
        prev_kv, prev_score = kv_state[:r], score_state[:r]  # previous window (overlap)
        kv_state, score_state = mx.array(kv_state), mx.array(score_state)
        if tail:
            kv_state[off : off + tail] = seq_kv[n * r :]
            score_state[off : off + tail] = seq_score[n * r :]
        rows = None
        if n:
            if self.coff == 2:
                # window k pools A-halves of window k-1 and B-halves of window k (8 rows)
                full_kv = mx.concatenate([prev_kv, seq_kv[: n * r]]).reshape(n + 1, r, 2 * d)
                full_sc = mx.concatenate([prev_score, seq_score[: n * r]]).reshape(n + 1, r, 2 * d)
                pool_kv = mx.concatenate([full_kv[:-1, :, :d], full_kv[1:, :, d:]], axis=1)
                pool_sc = mx.concatenate([full_sc[:-1, :, :d], full_sc[1:, :, d:]], axis=1)
                kv_state[:r] = seq_kv[(n - 1) * r : n * r]
                score_state[:r] = seq_score[(n - 1) * r : n * r]
            else:
                pool_kv = seq_kv[: n * r].reshape(n, r, d)
                pool_sc = seq_score[: n * r].reshape(n, r, d)
            pooled = (mx.softmax(pool_sc, axis=1) * pool_kv).sum(axis=1)  # per-column softmax
            pooled = self.norm(pooled.astype(x.dtype))
            rows = rope(pooled[None, :, None, :], np.arange(g0, g0 + n) * r, inv_freq)[0, :, 0]
        setattr(layer, f"{prefix}_kv_state", kv_state)
        setattr(layer, f"{prefix}_score_state", score_state)
        return g0, rows
