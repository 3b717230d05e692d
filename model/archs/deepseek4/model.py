"""DeepSeek-V4 (Flash) in MLX, loaded from a llama.cpp ``deepseek4`` GGUF.

Equations: the DeepSeek-V4 paper and its reference ``inference/model.py`` (shipped in
deepseek-ai's DeepSeek-V4 Hugging Face repositories); docs/models.md lists the parts.
Modules are named after GGUF tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...cache import window_mask
from ...cache_state import CacheState
from ...gguf.reader import GGUFFile
from ...gguf.weights import load_gguf_weights
from ...kernels import sparse_attention as fused
from ...kv_cache import KVCacheModel
from .cache import Deepseek4Cache, LayerCache
from .compressor import Compressor
from .indexer import Indexer
from .layers import Param, hc_mixes, rope, rope_inv_freq, sinkhorn
from .moe import MoE
from .planning import ARCHITECTURE, OVERLAP_RATIO
from .sparse import compressed_slots, gathered_attention, window_slots

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
    """DeepSeek-V4-Flash (its ``config.json`` in deepseek-ai/DeepSeek-V4-Flash), MTP layer
    dropped; `overrides` replace fields."""
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


class Attention(nn.Module):
    # ratio-4 layers gather the indexer's top-k rows (False: dense attention under a mask)
    gather_top_k = True

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

    def _attend(self, q, keys, position: int, b: int, n_prev: int,
                visible: mx.array | None) -> mx.array:
        """Attention of the chunk's queries ``b, b+1, ...`` ``(1, heads, n, hd)`` over the
        window keys (the ``n_prev`` before the chunk, then the chunk's) and the compressed
        rows `visible` ``(n, n_rows)`` marks (None on layers without them)."""
        n, L = q.shape[2], keys.shape[2] - (0 if visible is None else visible.shape[1]) - n_prev
        mask = [window_mask(position + b, n, position - n_prev, n_prev + L, self.window)]
        if visible is not None:
            mask.append(visible)
        return mx.fast.scaled_dot_product_attention(
            q, keys, keys, scale=self.head_dim**-0.5, mask=mx.concatenate(mask, axis=1),
            sinks=self.attn_sinks.weight.astype(q.dtype))

    def _visible_rows(self, x, qr, layer: LayerCache, position: int, n_rows: int):
        """Boolean ``(L, n_rows)``: the compressed rows each of the chunk's queries attends
        (row j pools tokens < (j+1)*r: visible to query p iff j < (p+1)//r; on ratio-4
        layers only the indexer's top-k of those), or None without them. The top-k is scored
        for the whole chunk, as the gathered path does: bf16 index scores tie often, and
        other matmul shapes (per query block) could break the ties otherwise."""
        if not self.ratio:
            return None
        q_pos = mx.arange(position, position + x.shape[1])[:, None]
        visible = mx.arange(n_rows)[None, :] < (q_pos + 1) // self.ratio
        if self.ratio == OVERLAP_RATIO:
            visible = self.indexer.select(x, qr, layer, position, visible, self._inv_freq)
        return visible

    def _gathers(self, q: mx.array, keys: mx.array, n_rows: int) -> bool:
        """Per-query key lists (`sparse`), not keys under a mask: on a CUDA GPU in bf16
        (the fused kernel), and on ratio-4 layers whose top-k binds (`gather_top_k`)."""
        if fused.applies(q, keys):
            return True
        return (self.gather_top_k and self.ratio == OVERLAP_RATIO
                and n_rows > self.args.index_topk)

    def _attend_listed(self, q, x, qr, kv, layer: LayerCache, position: int, n_prev: int,
                       n_rows: int) -> mx.array:
        """The chunk's queries ``(1, heads, L, hd)`` over their lists into `kv` ``(n_prev
        + L + n_rows, hd)`` (window, then visible or top-k compressed rows): ``(L, heads,
        hd)``."""
        L = q.shape[2]
        slots = [window_slots(L, n_prev, self.window)]
        if self.ratio:
            top = None
            if self.ratio == OVERLAP_RATIO and n_rows > self.args.index_topk:
                top = self.indexer.top_rows(x, qr, layer, position, n_rows, self._inv_freq)
            slots.append(compressed_slots(position, L, n_prev + L, n_rows, self.ratio, top))
        idx = mx.concatenate(slots, axis=1)
        attend = fused.sparse_attention if fused.applies(q, kv) else gathered_attention
        return attend(q, kv, idx, self.attn_sinks.weight, self.head_dim**-0.5)

    def _keys(self, x: mx.array, kv: mx.array, layer: LayerCache, position: int) -> tuple:
        """Write the chunk's rows `kv` ``(L, hd)`` into `layer`; return the keys it attends
        ``(1, 1, n_prev + L + n_rows, hd)`` (window rows, then compressed rows), n_prev, n_rows."""
        L = kv.shape[0]
        n_prev = min(position, self.window - 1)
        keys = [layer.ring.read(position - n_prev, position), kv]
        layer.ring.write(kv, position)
        n_rows = (position + L) // self.ratio if self.ratio else 0
        if self.ratio:
            g0, rows = self.attn_compressor(x[0], layer, "main", position, self._inv_freq)
            if rows is not None:
                layer.compressed[g0 : g0 + rows.shape[0]] = rows.astype(layer.compressed.dtype)
            if self.ratio == OVERLAP_RATIO:
                self.indexer.update(x, layer, position, self._inv_freq)
            keys.append(layer.compressed[:n_rows])
        return mx.concatenate(keys)[None, None], n_prev, n_rows  # K = V

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
        keys, n_prev, n_rows = self._keys(x, kv, layer, position)
        keys = keys.astype(q.dtype)
        q = q.transpose(0, 2, 1, 3)  # (1, heads, L, hd)
        if self._gathers(q, keys, n_rows):
            out = self._attend_listed(q, x, qr, keys[0, 0], layer, position, n_prev, n_rows)
        else:
            # query blocks bound the (heads, block, keys) scores of long contexts
            block = max(1, min(L, SCORE_BUDGET // (nh * keys.shape[2])))
            visible = self._visible_rows(x, qr, layer, position, n_rows)
            out = mx.concatenate(
                [
                    self._attend(q[:, :, b : b + block], keys, position, b, n_prev,
                                 None if visible is None else visible[b : b + block])
                    for b in range(0, L, block)
                ],
                axis=2,
            ).transpose(0, 2, 1, 3)
        out = rope(out.reshape(B, L, nh, hd), positions, self._inv_freq, inverse=True)
        # grouped low-rank output: group g of heads -> its own (o_lora_rank, nh*hd/og) matrix
        og = self.args.o_groups
        wa = self.attn_output_a.weight.reshape(og, self.args.o_lora_rank, -1)
        out = out.reshape(L, og, -1).transpose(1, 0, 2) @ wa.swapaxes(1, 2)  # (og, L, rank)
        return self.attn_output_b(out.transpose(1, 0, 2).reshape(B, L, -1))


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


class Model(nn.Module, KVCacheModel):
    """DeepSeek-V4. ``model(inputs, cache)`` runs one chunk and returns the final-normed
    hidden of its last position; ``model.logits(hidden)`` applies the (untied) head.

    The reference only prefills from position 0; here every chunk starts at
    ``cache.position`` and the cache carries what the equations need across chunks (the
    previous ``W - 1`` window rows, the compressor's remainder tokens and, at ratio 4, the
    previous complete window), so chunked prefill equals one pass at any chunk boundary.
    Batch size 1 (one job per cache)."""

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

    def __call__(self, inputs: mx.array, cache: Deepseek4Cache,
                 every_position: bool = False) -> mx.array:
        """Run one chunk at ``cache.position`` without committing it.

        Args:
            inputs: token ids, int32 ``(1, L)`` (hash-routed layers need them).
            cache: the job's `Deepseek4Cache`; layers write at ``[position, position + L)``.
            every_position: return every position's hidden state, not the last one's.
        Returns:
            float ``(1, hidden)``: the final-normed hidden state of the last position, or
            ``(1, L, hidden)`` of every position with `every_position`.
        """
        B, L = inputs.shape
        a = self.args
        h = self.token_embd(inputs)
        h = mx.broadcast_to(h[:, :, None, :], (B, L, a.hc_mult, a.hidden_size))
        for i, block in enumerate(self.blk):
            h = block(h, inputs, cache[i], cache.position)
        last = h if every_position else h[:, -1]  # (B, [L,] hc, H)
        mixes = hc_mixes(last, self.output_hc_fn.weight, a.rms_norm_eps)
        pre = mx.sigmoid(mixes * self.output_hc_scale.weight[0] + self.output_hc_base.weight)
        pre = (pre + a.hc_eps).astype(last.dtype)
        return self.output_norm((pre[..., None] * last).sum(axis=-2))

    def logits(self, hidden: mx.array) -> mx.array:
        """``(B, hidden)`` -> ``(B, vocab)``."""
        return self.output(hidden)

    def empty_cache(self, kv_dtype: mx.Dtype, capacity: int, context_length: int,
                    capacity_step: int | None) -> Deepseek4Cache:
        """`make_cache`'s cache (`Deepseek4Cache.for_model`)."""
        return Deepseek4Cache.for_model(self.args, kv_dtype, capacity, context_length,
                                        capacity_step)

    def cache_from_state(self, state: CacheState) -> Deepseek4Cache:
        """The cache `state` was saved from (`Deepseek4Cache.from_state`; raises
        CacheStateError)."""
        return Deepseek4Cache.from_state(self.args, state)


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
