"""DeepSeek-V4 mixture of experts: sqrt-softplus routing (hash routing by token id on the
first layers), clamped SwiGLU experts and a shared expert (DeepSeek-V4 reference
``inference/model.py``, ``Gate``, ``Expert`` and ``MoE``)."""

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
        routed = self._grouped if use_grouped_experts() else self._gathered
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
        """Routed experts with ``gather_mm`` over expert-sorted rows (no host sync; GPU)."""
        N, k = inds.shape
        flat = inds.reshape(-1)
        order = mx.argsort(flat)
        xs, ids = x[order // k][:, None, :], flat[order]  # (N*k, 1, H)

        def mm(a: mx.array, w: mx.array) -> mx.array:
            return mx.gather_mm(a, w.swapaxes(-1, -2), rhs_indices=ids, sorted_indices=True)

        gate, up = mm(xs, self.ffn_gate_exps.weight), mm(xs, self.ffn_up_exps.weight)
        h = _clamped_swiglu(gate, up, self.limit)
        h = h * weights.reshape(-1)[order, None, None]
        y = mm(h, self.ffn_down_exps.weight)[:, 0, :][mx.argsort(order)]
        return y.reshape(N, k, -1).sum(axis=1)


def use_grouped_experts() -> bool:
    """Host-grouped expert matmuls on the CPU, ``gather_mm`` elsewhere."""
    return mx.default_device() == mx.cpu
