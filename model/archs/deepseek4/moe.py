"""DeepSeek-V4 mixture of experts: sqrt-softplus routing (hash routing by token id on the
first layers), clamped SwiGLU experts and a shared expert (DeepSeek-V4 reference
``inference/model.py``, ``Gate``, ``Expert`` and ``MoE``).

The routed experts run one of three ways, each exact up to the matmuls' rounding
(`expert_path`): host-grouped matmuls on the CPU; on a GPU, batched matmuls over a padded
expert-major layout (`MoE._padded`), or ``gather_mm`` over expert-sorted rows for chunks of
a few tokens and skewed routing, where it is faster (`padded_capacity`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .layers import Param

if TYPE_CHECKING:
    from .model import ModelArgs


def _clamped_swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """SwiGLU with the reference ``Expert`` clamp: gate <= limit, |up| <= limit (if limit > 0)."""
    if limit > 0:
        gate, up = mx.minimum(gate, limit), mx.clip(up, -limit, limit)
    return nn.silu(gate) * up


class MoE(nn.Module):
    """Routed experts (sqrt-softplus scores; hash routing on the first layers) + shared."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args = args
        H, E, F = args.hidden_size, args.n_routed_experts, args.moe_intermediate_size
        self.hashed = layer < args.num_hash_layers
        self.limit = args.swiglu_limits[layer] if args.swiglu_limits else args.swiglu_limit
        self.ffn_gate_inp = nn.Linear(H, E, bias=False)
        if self.hashed:
            self.ffn_gate_tid2eid = Param(
                (args.vocab_size, args.num_experts_per_tok), dtype=mx.int32
            )
        else:
            self.exp_probs_b = Param((E,), attr="bias")
        self.ffn_gate_exps = Param((E, F, H))
        self.ffn_up_exps = Param((E, F, H))
        self.ffn_down_exps = Param((E, H, F))
        Fs = F * args.n_shared_experts
        self.ffn_gate_shexp = nn.Linear(H, Fs, bias=False)
        self.ffn_up_shexp = nn.Linear(H, Fs, bias=False)
        self.ffn_down_shexp = nn.Linear(Fs, H, bias=False)

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        a, k = self.args, self.args.num_experts_per_tok
        scores = mx.sqrt(mx.logaddexp(self.ffn_gate_inp(x).astype(mx.float32), 0.0))  # (B,L,E)
        if self.hashed:
            inds = self.ffn_gate_tid2eid.weight[ids]
        else:
            biased = scores + self.exp_probs_b.bias
            inds = mx.argpartition(-biased, k - 1, axis=-1)[..., :k]
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if a.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        weights = (weights * a.routed_scaling_factor).astype(x.dtype)
        B, L, H = x.shape
        routed = {"grouped": self._grouped, "padded": self._padded,
                  "gathered": self._gathered}[expert_path()]
        y = routed(x.reshape(B * L, H), inds.reshape(B * L, k), weights.reshape(B * L, k))
        shared = _clamped_swiglu(self.ffn_gate_shexp(x), self.ffn_up_shexp(x), self.limit)
        return y.reshape(B, L, H) + self.ffn_down_shexp(shared)

    def _expert(self, x: mx.array, e: int, weights: mx.array) -> mx.array:
        gate = x @ self.ffn_gate_exps.weight[e].T
        up = x @ self.ffn_up_exps.weight[e].T
        h = _clamped_swiglu(gate, up, self.limit) * weights[:, None]
        return h @ self.ffn_down_exps.weight[e].T

    def _grouped(self, x: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        """Routed experts, one matmul per used expert over its tokens ``(N, H)``.

        Reads the expert ids on the host (evaluates the graph so far); on the CPU it beats
        ``gather_mm``, which runs one matrix-vector product per token.
        """
        N, k = inds.shape
        flat = np.array(inds).reshape(-1)
        order = np.argsort(flat, kind="stable")  # (token, slot) pairs grouped by expert
        counts = np.bincount(flat, minlength=self.args.n_routed_experts)
        xs, ws = x[mx.array(order // k)], weights.reshape(-1)[mx.array(order)]
        bounds = np.concatenate([[0], np.cumsum(counts)])
        outs = [
            self._expert(xs[bounds[e] : bounds[e + 1]], int(e), ws[bounds[e] : bounds[e + 1]])
            for e in np.nonzero(counts)[0]
        ]
        y = mx.concatenate(outs)[mx.array(np.argsort(order))]  # back to (token, slot) order
        return y.reshape(N, k, -1).sum(axis=1)

    def _gathered(self, x: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        """Routed experts with ``gather_mm`` over expert-sorted rows (no host sync; GPU).

        The rows are reshaped to ``(N*k, 1, H)``, not indexed ``[:, None, :]``: MLX's sorted
        ``gather_mm`` silently returns wrong values for an axis-inserted lhs
        (ml-explore/mlx#4253; measured on CUDA by ``bench.gpu_deepseek4.check_padded_experts``).
        """
        N, k = inds.shape
        flat = inds.reshape(-1)
        order = mx.argsort(flat)
        xs, ids = x[order // k].reshape(N * k, 1, x.shape[-1]), flat[order]

        def mm(a: mx.array, w: mx.array) -> mx.array:
            return mx.gather_mm(a, w.swapaxes(-1, -2), rhs_indices=ids, sorted_indices=True)

        gate, up = mm(xs, self.ffn_gate_exps.weight), mm(xs, self.ffn_up_exps.weight)
        h = _clamped_swiglu(gate, up, self.limit)
        h = h * weights.reshape(-1)[order, None, None]
        y = mm(h, self.ffn_down_exps.weight)[:, 0, :][mx.argsort(order)]
        return y.reshape(N, k, -1).sum(axis=1)

    def _padded(self, x: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        """Routed experts as three batched matmuls over ``(E, cap, H)``: each expert's rows,
        padded to `cap` (`padded_capacity`, read on the host: one sync per call).

        A batched GEMM streams every expert's weights once, at full width. MLX 0.32's CUDA
        ``gather_mm`` over sorted rows is a CUTLASS grouped GEMM with 256-row tiles and
        one-element loads (``mlx/backend/cuda/gemms/grouped_gemm_unaligned.cu``), which runs
        a 2,048-token chunk's ~48 rows per expert at a few percent of the tensor cores. A
        padding row copies some other pair's token; its outputs are never read. Falls back
        to `_gathered` where `padded_capacity` declines.

        Args: `x` ``(N, H)``, `inds` ``(N, k)`` int expert ids, `weights` ``(N, k)`` in
        `x`'s dtype. Returns ``(N, H)``.
        """
        N, k = inds.shape
        if N * k < MIN_PAIRS:  # declined whatever the counts: no host read
            return self._gathered(x, inds, weights)
        E, H = self.args.n_routed_experts, x.shape[-1]
        flat = inds.reshape(-1).astype(mx.int32)
        counts = (flat[:, None] == mx.arange(E, dtype=mx.int32)).astype(mx.int32).sum(axis=0)
        cap = padded_capacity(np.array(counts), N * k)
        if cap is None:
            return self._gathered(x, inds, weights)
        order = mx.argsort(flat)  # pair ids grouped by expert
        starts = mx.cumsum(counts) - counts  # (E,) each expert's first sorted position
        sorted_pos = mx.minimum(starts[:, None] + mx.arange(cap), N * k - 1)
        pairs = order[sorted_pos]  # (E, cap): the pair in each padded row
        xs = x[pairs // k]  # (E, cap, H)
        gate = xs @ self.ffn_gate_exps.weight.swapaxes(-1, -2)
        up = xs @ self.ffn_up_exps.weight.swapaxes(-1, -2)
        h = _clamped_swiglu(gate, up, self.limit) * weights.reshape(-1)[pairs][..., None]
        out = (h @ self.ffn_down_exps.weight.swapaxes(-1, -2)).reshape(E * cap, H)
        rank = mx.argsort(order) - starts[flat]  # each pair's row within its expert
        return out[flat * cap + rank].reshape(N, k, H).sum(axis=1)


# Where `MoE._padded` gives way to gather_mm, placed by `bench.gpu_deepseek4.experts_sweep`
# at DeepSeek-V4-Flash's shapes (docs/benchmarks.md, "DeepSeek-V4's experts and RoPE angles").
MIN_PAIRS = 64  # below ~11 tokens gather_mm touches only a few experts and is faster
FREE_CAP = 48  # up to this many rows an expert the padded matmuls cost their weights' streaming
PAD_LIMIT = 12.0  # padded rows per real pair past which gather_mm is faster


def busiest_rows(counts: np.ndarray) -> int:
    """The largest of `counts` (int ``(E,)``) rounded up to a multiple of 16: the rows per
    expert of the padded layout (a chunk length yields few distinct matmul shapes)."""
    return -(-int(counts.max(initial=0)) // 16) * 16


def padded_capacity(counts: np.ndarray, n_pairs: int) -> int | None:
    """Rows per expert for `MoE._padded`, or ``None`` where ``gather_mm`` is faster.

    `counts`: int ``(E,)``, (token, expert) pairs per expert; `n_pairs` their sum. The
    capacity is `busiest_rows`. Declined below `MIN_PAIRS` pairs, and where the capacity is
    over `FREE_CAP` and the ``E * cap`` padded rows exceed `PAD_LIMIT` times the pairs
    (routing skewed onto a few experts).
    """
    cap = busiest_rows(counts)
    if n_pairs < MIN_PAIRS or cap == 0:
        return None
    if cap > FREE_CAP and counts.size * cap > PAD_LIMIT * n_pairs:
        return None
    return cap


def expert_path() -> str:
    """``"grouped"`` (host-grouped matmuls) on the CPU, ``"padded"`` elsewhere."""
    return "grouped" if mx.default_device() == mx.cpu else "padded"
