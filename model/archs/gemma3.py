"""Gemma 3 (text) in MLX, loaded from a llama.cpp GGUF.

Follows mlx-lm's ``gemma3_text.py`` and llama.cpp's ``llm_build_gemma3``. Modules are named
after the GGUF tensors (``blk.N.attn_q``), so loading needs no mapping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..cache_plan import CachePlan, LayerSpec, plan_cache
from ..gguf.reader import GGUFFile
from ..gguf.weights import flat_block_name, load_gguf_weights
from ..kernels import flash_attention as fused
from ..kernels import gelu, qk_norm_rope
from ..kernels.flash_attention import applies as fused_attention_applies
from ..kernels.flash_attention import flash_attention
from ..kernels.gelu import gelu_gate
from ..kv_cache import KVCacheModel, ModelCache
from ..runtime.streams import split_map
from ._args import DecoderArgs, gguf_sizes, rope_scale
from ._attention import cache_attention
from ._gemma3_graph import GraphForward, shared_kv_bytes
from ._packed import PackedModel, ProjectedAttention

ARCHITECTURE = "gemma3"
# llama.cpp hard-codes the local RoPE base for Gemma 3 (``freq_base_swa``); it is not in the GGUF.
LOCAL_ROPE_BASE = 10_000.0
# llama.cpp sets the SWA pattern for Gemma 3 to 6: layer i is global iff (i + 1) % 6 == 0.
SLIDING_WINDOW_PATTERN = 6
# Gemma 3 27B's block count: llama.cpp (`LLM_TYPE_27B`) scales its queries by
# 1/sqrt(hidden / heads) (its ``query_pre_attn_scalar``, 168), every other size by
# 1/sqrt(head_dim); the GGUF does not carry the scalar.
GEMMA3_27B_LAYERS = 62


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    sliding_window: int
    rope_local_base_freq: float = LOCAL_ROPE_BASE
    sliding_window_pattern: int = SLIDING_WINDOW_PATTERN
    # global layers' positions are multiplied by it (linear scaling, 1 / factor: 1/8 in 4B,
    # 12B and 27B); llama.cpp keeps sliding layers at 1 (``rope_freq_scale_train_swa``)
    rope_scale: float = 1.0
    query_pre_attn_scalar: int = 0  # 0: head_dim

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelArgs:
        """Read ``gemma3.*`` metadata as llama.cpp's Gemma 3 loader does.

        Raises:
            GGUFError: naming a missing key, or a RoPE scaling type other than linear/none.
        """
        a = f"{ARCHITECTURE}."
        n_heads = int(gguf.require(a + "attention.head_count"))
        sizes = gguf_sizes(gguf)
        big = sizes["num_hidden_layers"] == GEMMA3_27B_LAYERS
        return cls(
            **sizes,
            num_attention_heads=n_heads,
            num_key_value_heads=int(gguf.metadata.get(a + "attention.head_count_kv", n_heads)),
            head_dim=int(gguf.metadata.get(a + "attention.key_length",
                                           sizes["hidden_size"] // n_heads)),
            sliding_window=int(gguf.require(a + "attention.sliding_window")),
            rope_theta=float(gguf.metadata.get(a + "rope.freq_base", 1_000_000.0)),
            rope_scale=rope_scale(gguf),
            query_pre_attn_scalar=sizes["hidden_size"] // n_heads if big else 0,
        )

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern != 0

    def layer_specs(self) -> list[LayerSpec]:
        return [
            LayerSpec(
                self.num_key_value_heads,
                self.head_dim,
                self.sliding_window if self.is_sliding(i) else None,
            )
            for i in range(self.num_hidden_layers)
        ]


class Attention(nn.Module, ProjectedAttention):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        # llama.cpp: 1/sqrt(head_dim) for every size but 27B (`GEMMA3_27B_LAYERS`)
        self.scale = (args.query_pre_attn_scalar or args.head_dim) ** -0.5
        sliding = args.is_sliding(layer)
        self.rope_base = args.rope_local_base_freq if sliding else args.rope_theta
        self.rope_scale = 1.0 if sliding else args.rope_scale
        self.window = args.sliding_window if sliding else None
        hd = args.head_dim
        self.attn_q = nn.Linear(args.hidden_size, self.n_heads * hd, bias=False)
        self.attn_k = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=False)
        self.attn_v = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=False)
        self.attn_output = nn.Linear(self.n_heads * hd, args.hidden_size, bias=False)
        self.attn_q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.attn_k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache, position: int
               ) -> mx.array:
        """One job's projected queries, keys and values ``(B, L, heads * head_dim)`` at
        `position`: normed, rotated, written to `cache`, attended; ``(B, L, heads *
        head_dim)`` before the output projection."""
        B, L, _ = q.shape
        q = self.attn_q_norm(q.reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.attn_k_norm(k.reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        # (B, heads, L, head_dim); NEOX-style rotation, i.e. MLX's traditional=False
        q = mx.fast.rope(q, self.head_dim, traditional=False, base=self.rope_base,
                         scale=self.rope_scale, offset=position)
        k = mx.fast.rope(k, self.head_dim, traditional=False, base=self.rope_base,
                         scale=self.rope_scale, offset=position)
        keys, values, mask = cache.update(k, v, position)
        out = self.core(q, keys, values, mask, position)
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1)

    def core(self, q: mx.array, keys: mx.array, values: mx.array, mask, position: int
             ) -> mx.array:
        """The chunk's queries ``(B, heads, L, head_dim)`` over the keys and mask its cache
        returned (`model.kv_cache`: ``GlobalKVCache.update``, ``RingKVCache.update``): on a
        CUDA GPU in bf16, the fused kernel (`model.kernels.flash_attention`); elsewhere MLX's
        attention (`model.archs._attention.cache_attention`)."""
        if fused_attention_applies(q, keys):
            return flash_attention(q, keys, values, self.scale, position, self.window)
        return cache_attention(q, keys, values, mask, scale=self.scale, position=position,
                               window=self.window, n_kv_heads=self.n_kv_heads)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ffn_gate = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.ffn_up = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.ffn_down = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        # rows are independent: on a CPU device they run on parallel streams
        gated = split_map(gelu_gate, [self.ffn_gate(x), self.ffn_up(x)], axis=1)
        return self.ffn_down(gated)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        eps = args.rms_norm_eps
        self.attn = Attention(args, layer)
        self.mlp = MLP(args)
        # llama.cpp stores Gemma's norm weights with its +1 already added: used as stored.
        self.attn_norm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_attention_norm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_ffw_norm = nn.RMSNorm(args.hidden_size, eps=eps)

    def __call__(self, x: mx.array, cache, position: int) -> mx.array:
        return self._mlp(x + self.post_attention_norm(self.attn(self.attn_norm(x), cache,
                                                                position)))

    def packed(self, x: mx.array, caches: list, positions: list[int], lengths: list[int]
               ) -> mx.array:
        """`__call__` over several jobs' chunks packed along ``L`` (`Attention.packed`)."""
        attended = self.attn.packed(self.attn_norm(x), caches, positions, lengths)
        return self._mlp(x + self.post_attention_norm(attended))

    def _mlp(self, h: mx.array) -> mx.array:
        return h + self.post_ffw_norm(self.mlp(self.ffn_norm(h)))


class Model(nn.Module, KVCacheModel, PackedModel):
    """Gemma 3 text model.

    Sliding-window attention in five of every six layers (a ring cache of
    ``sliding_window`` rows, RoPE base 10,000), global attention in every sixth (RoPE base
    from the GGUF), RMS-normed q/k, four norms per block, a GELU-tanh gated MLP, and the
    embedding scaled by sqrt(hidden) and tied to the output head.

    ``model(inputs, cache)`` runs one chunk and returns the hidden state of its last
    position; ``model.logits(hidden)`` applies the tied output head. Running the head on
    the last position only matters: at 262,144 x 640 it is the largest matmul per token
    (``every_position=True`` keeps every position, for prompt log-probabilities only).
    ``model.packed(inputs, caches)`` runs several jobs' chunks in one forward pass
    (`model.archs._packed.PackedModel`).

    Raises:
        ValueError: ``$PREFILLQ_SHARED_KV_BYTES`` is set to anything but an integer >= 0
            (`model.archs._gemma3_graph.shared_kv_bytes`), read when the model is built.
    """

    architecture = ARCHITECTURE

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.token_embd = nn.Embedding(args.vocab_size, args.hidden_size)
        self.blk = [Block(args, i) for i in range(args.num_hidden_layers)]
        self.output_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self._graph: GraphForward | None = None
        # read here, so that a bad $PREFILLQ_SHARED_KV_BYTES stops a worker at its start
        self._shared_kv_bytes = shared_kv_bytes()

    @property
    def sliding_window(self) -> int:
        return self.args.sliding_window

    def __call__(self, inputs: mx.array, cache: ModelCache,
                 every_position: bool = False) -> mx.array:
        """Run one chunk at ``cache.position`` without committing it.

        Args:
            inputs: token ids, int32 ``(B, L)``.
            cache: the job's cache; layers write rows ``[position, position + L)``.
            every_position: return every position's hidden state, not the last one's.
        Returns:
            float ``(B, hidden)``: the final-normed hidden state of the last position, or
            ``(B, L, hidden)`` of every position with `every_position`.
        """
        if graph_applies(self, cache):
            return self._graph_forward()(self, inputs, cache, every_position)
        h = self.embed(inputs)
        for layer, block in enumerate(self.blk):
            h = block(h, cache[layer], cache.position)
        return self.output_norm(h if every_position else h[:, -1, :])

    def packs(self, caches: list[ModelCache]) -> bool:
        """Whether `packed` serves chunks of `caches`: when all of them take the same path,
        the compiled graphs (`graph_applies`) or the module forward."""
        return len({graph_applies(self, cache) for cache in caches}) == 1

    def packed(self, inputs: list[mx.array], caches: list[ModelCache],
               every_position: Sequence[bool] | None = None,
               writes: Sequence[bool] | None = None) -> list[mx.array]:
        """`model.archs._packed.PackedModel.packed`, through the compiled graphs where they
        apply (`_gemma3_graph.GraphForward.packed`, which skips the rows `writes` lets it)."""
        if graph_applies(self, caches[0]):
            return self._graph_forward().packed(self, inputs, caches, every_position, writes)
        return PackedModel.packed(self, inputs, caches, every_position)

    def _graph_forward(self) -> GraphForward:
        if self._graph is None:
            gate = (gelu.fused_gelu_gate if gelu.available()
                    and self.args.intermediate_size % gelu.VECTOR == 0 else None)
            heads = qk_norm_rope.qk_norm_rope if qk_norm_rope.enabled() else None
            self._graph = GraphForward(_fused_attend, fused.packed_flash_attention, gate,
                                       heads, self._shared_kv_bytes)
        return self._graph

    def embed(self, inputs: mx.array) -> mx.array:
        """Token ids, int32 ``(..., L)`` -> the embedding scaled by sqrt(hidden), as Gemma
        does, ``(..., L, hidden)``."""
        h = self.token_embd(inputs)
        return h * mx.array(math.sqrt(self.args.hidden_size), dtype=h.dtype)

    def logits(self, hidden: mx.array) -> mx.array:
        """``(B, hidden)`` -> ``(B, vocab)`` through the tied embedding."""
        return self.token_embd.as_linear(hidden)



def graph_applies(model: Model, cache: ModelCache) -> bool:
    """Whether `model` runs its chunks as compiled graphs (`_gemma3_graph.GraphForward`)
    around the fused kernel: on a CUDA GPU (`flash_attention.available`) with bf16 weights
    and cache rows at a head dim the kernel takes."""
    return (fused.available() and model.token_embd.weight.dtype == mx.bfloat16
            and cache[0].dtype == mx.bfloat16 and model.args.head_dim in fused.HEAD_DIMS)


def _fused_attend(q, keys, values, scale, position, window, mask):
    return flash_attention(q, keys, values, scale, position, window)


def load(gguf: GGUFFile, dtype: mx.Dtype = mx.float32) -> Model:
    """Build a `Model` and load its weights from `gguf`, dequantized to `dtype`.

    Raises:
        GGUFError: a tensor is missing, has an unexpected shape or unsupported type.
    """
    return load_gguf_weights(Model(ModelArgs.from_gguf(gguf)), gguf, flat_block_name, dtype)


def cache_plan(args: ModelArgs, context_length: int, kv_dtype: mx.Dtype) -> CachePlan:
    """Sizes of the KV cache for `context_length` tokens of `kv_dtype` rows (not allocated).

    Raises:
        the errors of `model.cache_plan.plan_cache` (e.g. an empty context).
    """
    return plan_cache(args.layer_specs(), context_length, kv_dtype)
