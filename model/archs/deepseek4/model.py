"""DeepSeek-V4 (Flash) in MLX, loaded from a llama.cpp ``deepseek4`` GGUF.

Equations: shared/research/deepseek_v4.md (DeepSeek-V4 reference ``inference/model.py``):
mHC residual streams (4 copies mixed by Sinkhorn-normalised matrices), q-LoRA, one shared
KV head (K = V) with a circular window, per-layer compress ratio 0/4/128 with gated-pooling
compressors (ratio 4 overlapping) and a lightning indexer on ratio-4 layers, an attention
sink, inverse RoPE on the output, a grouped low-rank output projection and an MoE with
sqrt-softplus scoring whose first layers route by token id.

The reference only prefills from position 0; here every chunk starts at ``cache.position``
and carries across chunks what the equations need: the previous ``W - 1`` window rows, the
compressor's remainder tokens and (ratio 4) the previous complete window, so chunked
prefill equals one pass at any chunk boundary. Modules are named after GGUF tensors.
Batch size 1 (one job per cache).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...gguf.reader import GGUFFile
from ...gguf.weights import load_gguf_weights
from .cache import OVERLAP_RATIO, Deepseek4Cache, LayerCache

ARCHITECTURE = "deepseek4"
# Attention scores held at once per layer (elements): long chunks run in query blocks.
SCORE_BUDGET = 1 << 27


@dataclass(frozen=True)
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_dim: int  # rotary dims: the LAST ones of each head
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    num_hash_layers: int
    vocab_size: int
    context_length: int
    rope_theta: float = 10_000.0
    compress_rope_theta: float = 160_000.0
    rope_factor: float = 16.0
    original_context_length: int = 65_536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0  # 0 = no clamp
    swiglu_limits: tuple[float, ...] | None = None  # per layer, when the GGUF has an array
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelArgs:
        """Read ``deepseek4.*`` metadata. Raises GGUFError naming a missing key."""
        a = f"{ARCHITECTURE}."

        def req(key):
            return gguf.require(a + key)

        def opt(key, default):
            return gguf.metadata.get(a + key, default)

        tokens = gguf.metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else int(gguf._tensors["token_embd.weight"].shape[1])
        clamp = opt("swiglu_clamp_exp", 10.0)
        n_layers = int(req("block_count"))
        ratios = tuple(int(r) for r in req("attention.compress_ratios"))[:n_layers]
        return cls(
            hidden_size=int(req("embedding_length")),
            num_hidden_layers=n_layers,
            num_attention_heads=int(req("attention.head_count")),
            head_dim=int(req("attention.key_length")),
            rope_dim=int(req("rope.dimension_count")),
            q_lora_rank=int(req("attention.q_lora_rank")),
            o_lora_rank=int(req("attention.output_lora_rank")),
            o_groups=int(req("attention.output_group_count")),
            sliding_window=int(req("attention.sliding_window")),
            compress_ratios=ratios,
            index_n_heads=int(req("attention.indexer.head_count")),
            index_head_dim=int(req("attention.indexer.key_length")),
            index_topk=int(req("attention.indexer.top_k")),
            n_routed_experts=int(req("expert_count")),
            num_experts_per_tok=int(req("expert_used_count")),
            n_shared_experts=int(opt("expert_shared_count", 1)),
            moe_intermediate_size=int(req("expert_feed_forward_length")),
            num_hash_layers=int(opt("hash_layer_count", 0)),
            vocab_size=vocab,
            context_length=int(req("context_length")),
            rope_theta=float(opt("rope.freq_base", 10_000.0)),
            compress_rope_theta=float(opt("attention.compress_rope_freq_base", 160_000.0)),
            rope_factor=float(opt("rope.scaling.factor", 16.0)),
            original_context_length=int(opt("rope.scaling.original_context_length", 65_536)),
            beta_fast=float(opt("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(opt("rope.scaling.yarn_beta_slow", 1.0)),
            routed_scaling_factor=float(opt("expert_weights_scale", 1.5)),
            norm_topk_prob=bool(opt("expert_weights_norm", True)),
            swiglu_limit=float(clamp[0] if isinstance(clamp, list) else clamp),
            swiglu_limits=tuple(float(c) for c in clamp[:n_layers])
            if isinstance(clamp, list)
            else None,
            hc_mult=int(opt("hyper_connection.count", 4)),
            hc_sinkhorn_iters=int(opt("hyper_connection.sinkhorn_iterations", 20)),
            hc_eps=float(opt("hyper_connection.epsilon", 1e-6)),
            rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        )


def flash_args(**overrides) -> ModelArgs:
    """DeepSeek-V4-Flash (research doc §1), MTP layer dropped; `overrides` replace fields."""
    args = ModelArgs(
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        head_dim=512,
        rope_dim=64,
        q_lora_rank=1024,
        o_lora_rank=1024,
        o_groups=8,
        sliding_window=128,
        compress_ratios=(0, 0) + (4, 128) * 20 + (4,),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=256,
        num_experts_per_tok=6,
        n_shared_experts=1,
        moe_intermediate_size=2048,
        num_hash_layers=3,
        vocab_size=129_280,
        context_length=1_048_576,
    )
    return replace(args, **overrides)


def rope_inv_freq(args: ModelArgs, ratio: int) -> np.ndarray:
    """float64 ``(rope_dim/2,)`` inverse frequencies: base 10000 on ratio-0 layers, else the
    compress base with YaRN interpolation (reference ``precompute_freqs_cis``; no mscale)."""
    dim = args.rope_dim
    base = args.compress_rope_theta if ratio else args.rope_theta
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if not ratio:
        return freqs

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(args.original_context_length / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(args.beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 0.001), 0, 1)
    smooth = 1 - ramp
    return freqs / args.rope_factor * (1 - smooth) + freqs * smooth


def rope(x: mx.array, positions: np.ndarray, inv_freq: np.ndarray, inverse: bool = False):
    """Rotate interleaved pairs of the last ``2*len(inv_freq)`` dims of `x` ``(B, L, N, D)``
    at `positions` ``(L,)``; `inverse` applies the conjugate rotation."""
    B, L, N, D = x.shape
    rd = 2 * inv_freq.shape[0]
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # (L, rd/2)
    cos = mx.array(np.cos(angles), dtype=x.dtype)[None, :, None, :]
    sin = mx.array(np.sin(angles), dtype=x.dtype)[None, :, None, :]
    if inverse:
        sin = -sin
    pairs = x[..., D - rd :].reshape(B, L, N, rd // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(B, L, N, rd)
    return mx.concatenate([x[..., : D - rd], rotated], axis=-1)


class Param(nn.Module):
    """A bare GGUF tensor (``name.weight`` or ``name.bias``)."""

    def __init__(self, shape: tuple[int, ...], attr: str = "weight", dtype=mx.float32):
        super().__init__()
        setattr(self, attr, mx.zeros(shape, dtype))


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
        ape = self.ape.weight[mx.array(np.arange(position, position + L) % r)]
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

    def select(self, x, qr, layer: LayerCache, position: int, visible: mx.array, inv_freq):
        """Boolean ``(L, n_rows)``: the rows each query ``position + i`` of `x` ``(1, L, H)``
        attends, the top-k by index score among `visible` (all of them if fewer)."""
        B, L, _ = x.shape
        n_rows = visible.shape[1]
        if n_rows <= self.topk:
            return visible
        q = self.attn_q_b(qr).reshape(B, L, self.n_heads, self.head_dim)
        q = rope(q, np.arange(position, position + L), inv_freq)[0]  # (L, heads, head_dim)
        keys = layer.indexer[:n_rows].astype(q.dtype)
        weights = self.proj(x)[0] * (self.head_dim**-0.5 * self.n_heads**-0.5)  # (L, heads)
        per_head = nn.relu(q @ keys.T)  # (L, heads, n_rows)
        score = (weights[..., None] * per_head).sum(axis=1).astype(mx.float32)
        score = mx.where(visible, score, -mx.inf)
        # exactly top-k rows (ties broken arbitrarily, as torch.topk does), then drop invisible
        top = mx.argpartition(-score, self.topk - 1, axis=-1)[..., : self.topk]
        chosen = mx.put_along_axis(mx.zeros(score.shape, mx.bool_), top, mx.array(True), axis=-1)
        return visible & chosen


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args = args
        self.ratio = args.compress_ratios[layer]
        nh, hd, og = args.num_attention_heads, args.head_dim, args.o_groups
        self.n_heads, self.head_dim, self.window = nh, hd, args.sliding_window
        self.attn_q_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.attn_q_a_norm = nn.RMSNorm(args.q_lora_rank, eps=args.rms_norm_eps)
        self.attn_q_b = nn.Linear(args.q_lora_rank, nh * hd, bias=False)
        self.attn_kv = nn.Linear(args.hidden_size, hd, bias=False)
        self.attn_kv_a_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.attn_output_a = Param((og * args.o_lora_rank, nh * hd // og))
        self.attn_output_b = nn.Linear(og * args.o_lora_rank, args.hidden_size, bias=False)
        self.attn_sinks = Param((nh,))
        if self.ratio:
            self.attn_compressor = Compressor(args, self.ratio, hd)
        if self.ratio == OVERLAP_RATIO:
            self.indexer = Indexer(args)
        self._inv_freq = rope_inv_freq(args, self.ratio)

    def _attend(
        self, q, x, qr, keys, layer: LayerCache, position: int, b: int, n_prev: int, n_rows: int
    ) -> mx.array:
        """Attention of the chunk's queries ``b, b+1, ...`` ``(1, heads, n, hd)`` over the
        window keys (the ``n_prev`` before the chunk, then the chunk's) and compressed rows."""
        n, L = q.shape[2], keys.shape[2] - n_rows - n_prev
        q_pos = mx.arange(position + b, position + b + n)[:, None]
        k_pos = mx.arange(position - n_prev, position + L)[None, :]
        mask = [(k_pos <= q_pos) & (q_pos - k_pos < self.window)]
        if self.ratio:
            # row j pools tokens < (j+1)*r: visible to query p iff j < (p+1)//r
            visible = mx.arange(n_rows)[None, :] < (q_pos + 1) // self.ratio
            if self.ratio == OVERLAP_RATIO:
                visible = self.indexer.select(x, qr, layer, position + b, visible, self._inv_freq)
            mask.append(visible)
        return mx.fast.scaled_dot_product_attention(
            q,
            keys,
            keys,
            scale=self.head_dim**-0.5,
            mask=mx.concatenate(mask, axis=1),
            sinks=self.attn_sinks.weight.astype(q.dtype),
        )

    def __call__(self, x: mx.array, layer: LayerCache, position: int) -> mx.array:
        B, L, _ = x.shape
        assert B == 1, "the DeepSeek-V4 cache holds one sequence"
        nh, hd, eps = self.n_heads, self.head_dim, self.args.rms_norm_eps
        positions = np.arange(position, position + L)
        qr = self.attn_q_a_norm(self.attn_q_a(x))
        q = self.attn_q_b(qr).reshape(B, L, nh, hd)
        q = q * mx.rsqrt((q * q).mean(axis=-1, keepdims=True) + eps)  # weightless per head
        q = rope(q, positions, self._inv_freq)
        kv = self.attn_kv_a_norm(self.attn_kv(x))[:, :, None, :]
        kv = rope(kv, positions, self._inv_freq)[0, :, 0].astype(layer.window.dtype)  # (L, hd)

        n_prev = min(position, self.window - 1)
        keys = [layer.window_rows(position - n_prev, position), kv]
        layer.write_window(kv, position)
        n_rows = (position + L) // self.ratio if self.ratio else 0
        if self.ratio:
            g0, rows = self.attn_compressor(x[0], layer, "main", position, self._inv_freq)
            if rows is not None:
                layer.compressed[g0 : g0 + rows.shape[0]] = rows.astype(layer.compressed.dtype)
            if self.ratio == OVERLAP_RATIO:
                self.indexer.update(x, layer, position, self._inv_freq)
            keys.append(layer.compressed[:n_rows])
        keys = mx.concatenate(keys).astype(q.dtype)[None, None]  # (1, 1, n_keys, hd), K = V
        q = q.transpose(0, 2, 1, 3)  # (1, heads, L, hd)
        # query blocks bound the (heads, block, keys) scores of long contexts
        block = max(1, min(L, SCORE_BUDGET // (nh * keys.shape[2])))
        out = mx.concatenate(
            [
                self._attend(
                    q[:, :, b : b + block],
                    x[:, b : b + block],
                    qr[:, b : b + block],
                    keys,
                    layer,
                    position,
                    b,
                    n_prev,
                    n_rows,
                )
                for b in range(0, L, block)
            ],
            axis=2,
        )
        out = rope(out.transpose(0, 2, 1, 3), positions, self._inv_freq, inverse=True)
        # grouped low-rank output: group g of heads -> its own (o_lora_rank, nh*hd/og) matrix
        og = self.args.o_groups
        wa = self.attn_output_a.weight.reshape(og, self.args.o_lora_rank, -1)
        out = out.reshape(L, og, -1).transpose(1, 0, 2) @ wa.swapaxes(1, 2)  # (og, L, rank)
        return self.attn_output_b(out.transpose(1, 0, 2).reshape(B, L, -1))


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

        Reads the expert ids on the host (evaluates the graph so far): on the CPU this is
        ~15x faster than ``gather_mm``, which runs one matrix-vector product per token.
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


def sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Row softmax, then alternate column/row normalisation (reference ``hc_split_sinkhorn``)."""
    comb = mx.softmax(comb, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


def hc_mixes(h: mx.array, fn: mx.array, eps: float) -> mx.array:
    """``(..., hc, H)`` -> ``(..., n_mix)``: linear mixes of the RMS-scaled flat streams."""
    flat = h.reshape(*h.shape[:-2], -1).astype(mx.float32)
    return (flat @ fn.T) * mx.rsqrt((flat * flat).mean(axis=-1, keepdims=True) + eps)


class Block(nn.Module):
    """Attention and MoE, each wrapped in mHC pre-mix / post-mix of the 4 residual streams."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args = args
        hc, H = args.hc_mult, args.hidden_size
        self.attn = Attention(args, layer)
        self.ffn = MoE(args, layer)
        self.attn_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.ffn_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", Param(((2 + hc) * hc, hc * H)))
            setattr(self, f"hc_{part}_base", Param(((2 + hc) * hc,)))
            setattr(self, f"hc_{part}_scale", Param((3,)))

    def _hc(self, h: mx.array, part: str, sublayer) -> mx.array:
        a, hc = self.args, self.args.hc_mult
        fn, base, scale = (getattr(self, f"hc_{part}_{n}").weight for n in ("fn", "base", "scale"))
        mixes = hc_mixes(h, fn, a.rms_norm_eps)  # (B, L, (2+hc)*hc)
        pre = mx.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + a.hc_eps
        post = 2 * mx.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        comb = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).reshape(*mixes.shape[:-1], hc, hc)
        comb = sinkhorn(comb, a.hc_sinkhorn_iters, a.hc_eps).astype(h.dtype)
        x = (pre.astype(h.dtype)[..., None] * h).sum(axis=-2)  # (B, L, H)
        out = sublayer(x)
        # stream j <- post_j * out + sum_i comb[i, j] * stream i
        return post.astype(h.dtype)[..., None] * out[..., None, :] + comb.swapaxes(-1, -2) @ h

    def __call__(self, h: mx.array, ids: mx.array, layer: LayerCache, position: int):
        h = self._hc(h, "attn", lambda x: self.attn(self.attn_norm(x), layer, position))
        return self._hc(h, "ffn", lambda x: self.ffn(self.ffn_norm(x), ids))


class Model(nn.Module):
    """DeepSeek-V4. ``model(inputs, cache)`` runs one chunk and returns the final-normed
    hidden of its last position; ``model.logits(hidden)`` applies the (untied) head."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hc, H = args.hc_mult, args.hidden_size
        self.token_embd = nn.Embedding(args.vocab_size, H)
        self.blk = [Block(args, i) for i in range(args.num_hidden_layers)]
        self.output_hc_fn = Param((hc, hc * H))
        self.output_hc_base = Param((hc,))
        self.output_hc_scale = Param((1,))
        self.output_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.output = nn.Linear(H, args.vocab_size, bias=False)

    @property
    def sliding_window(self) -> int:
        return self.args.sliding_window

    def __call__(self, inputs: mx.array, cache: Deepseek4Cache) -> mx.array:
        """Run one chunk at ``cache.position`` without committing it.

        Args:
            inputs: token ids, int32 ``(1, L)`` (hash-routed layers need them).
            cache: the job's `Deepseek4Cache`; layers write at ``[position, position + L)``.
        Returns:
            float ``(1, hidden)``: the final-normed hidden state of the last position.
        """
        B, L = inputs.shape
        a = self.args
        h = self.token_embd(inputs)
        h = mx.broadcast_to(h[:, :, None, :], (B, L, a.hc_mult, a.hidden_size))
        for i, block in enumerate(self.blk):
            h = block(h, inputs, cache[i], cache.position)
        last = h[:, -1]  # (B, hc, H)
        mixes = hc_mixes(last, self.output_hc_fn.weight, a.rms_norm_eps)
        pre = mx.sigmoid(mixes * self.output_hc_scale.weight[0] + self.output_hc_base.weight)
        pre = (pre + a.hc_eps).astype(last.dtype)
        return self.output_norm((pre[..., None] * last).sum(axis=-2))

    def logits(self, hidden: mx.array) -> mx.array:
        """``(B, hidden)`` -> ``(B, vocab)``."""
        return self.output(hidden)

    def make_cache(
        self, kv_dtype: mx.Dtype = mx.float32, capacity: int = 0, context_length: int = 0
    ) -> Deepseek4Cache:
        return Deepseek4Cache.for_model(self.args, kv_dtype, capacity, context_length)


def gguf_name(param: str) -> str:
    """Module path -> GGUF tensor name, e.g. ``blk.2.attn.indexer.indexer_compressor.kv.weight``
    -> ``blk.2.indexer_compressor_kv.weight``."""
    name = param.replace(".attn.", ".").replace(".ffn.", ".")
    name = name.replace(".indexer.indexer_compressor.", ".indexer_compressor.")
    return re.sub(r"(attn_compressor|indexer_compressor)\.(\w+)\.", r"\1_\2.", name)


def load(gguf: GGUFFile, dtype: mx.Dtype = mx.float32) -> Model:
    """Build a `Model` from `gguf`, weights dequantized to `dtype` (token-id tables int32).

    Raises:
        GGUFError: a tensor is missing, has an unexpected shape or unsupported type.
    """
    return load_gguf_weights(Model(ModelArgs.from_gguf(gguf)), gguf, gguf_name, dtype)


def dummy_model(
    args: ModelArgs,
    n_layers: int | None = None,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    **overrides,
) -> Model:
    """Random weights with real shapes (``--load-format dummy``), for benchmarks.

    Args:
        n_layers: keep the first `n_layers` layers of the schedule (default all).
        overrides: other `ModelArgs` fields (e.g. ``n_routed_experts=16`` to fit memory).
    """
    if n_layers is not None:
        overrides |= dict(
            num_hidden_layers=n_layers, compress_ratios=tuple(args.compress_ratios[:n_layers])
        )
    args = replace(args, **overrides)
    mx.random.seed(seed)
    model = Model(args)
    weights = []
    for name, param in nn.utils.tree_flatten(model.parameters()):
        if param.dtype == mx.int32:
            value = mx.random.randint(0, args.n_routed_experts, param.shape, dtype=mx.int32)
        elif name.endswith(("norm.weight", "scale.weight")):
            value = mx.ones(param.shape)
        elif name.endswith(("base.weight", "ape.weight", "sinks.weight", ".bias")):
            value = mx.zeros(param.shape)
        else:
            value = mx.random.normal(param.shape) * param.shape[-1] ** -0.5
        weights.append((name, value.astype(mx.int32 if param.dtype == mx.int32 else dtype)))
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
    return model
