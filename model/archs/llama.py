"""The Llama family in MLX, loaded from a llama.cpp GGUF: Llama 2/3, Mistral, Qwen 2, Qwen 3.

Follows mlx-lm's ``models/llama.py`` and ``qwen3.py`` and llama.cpp's graphs for these
architectures (``src/models/llama.cpp``, ``qwen2.cpp``, ``qwen3.cpp``); `ModelArgs.from_gguf`
reads the variants from the GGUF (docs/models.md, "The Llama family").
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache_plan import CachePlan, LayerSpec, plan_cache
from ..gguf.reader import GGUFError, GGUFFile
from ..gguf.weights import flat_block_name, load_gguf_weights, unused_tensors
from ..kv_cache import KVCacheModel, ModelCache
from ..runtime.streams import split_map
from ._args import DecoderArgs, gguf_sizes, rope_scale
from ._attention import cache_attention
from ._packed import PackedModel, ProjectedAttention

ARCHITECTURE = "llama"
# llama.cpp's rope type per architecture (``llama_model_rope_type``): NORM rotates adjacent
# pairs, i.e. MLX's traditional=True; NEOX rotates the two halves of each head.
NEOX_ARCHITECTURES = frozenset({"qwen2", "qwen3"})
ARCHITECTURES = frozenset({ARCHITECTURE}) | NEOX_ARCHITECTURES
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    architecture: str
    rope_traditional: bool
    rope_scale: float = 1.0  # positions are multiplied by it (linear scaling: 1 / factor)
    rope_freqs: bool = False  # the GGUF has Llama 3's per-pair frequency divisors
    attention_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = True
    sliding_window: int = 0  # 0: no layer has a window
    sliding_layers: tuple[bool, ...] = ()

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelArgs:
        """Read ``{arch}.*`` metadata and which optional tensors the file has.

        Raises:
            GGUFError: naming a missing key or a variant this module does not implement
                (another architecture, partial rotary dims, per-layer head counts, K and V
                heads of different widths, a rope scaling type other than none/linear).
        """
        arch = gguf.architecture
        if arch not in ARCHITECTURES:
            raise GGUFError(f"{gguf.path.name}: architecture {arch!r} is not one of "
                            f"{sorted(ARCHITECTURES)}")
        has = gguf.has_tensor
        sizes = gguf_sizes(gguf)
        n_layers = sizes["num_hidden_layers"]
        n_heads, n_kv_heads, head_dim = _heads(gguf)
        window = int(gguf.arch_key("attention.sliding_window", 0) or 0)
        return cls(
            **sizes,
            architecture=arch,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            head_dim=head_dim,
            rope_theta=float(gguf.arch_key("rope.freq_base", 10_000.0)),  # llama.cpp's default
            rope_traditional=arch not in NEOX_ARCHITECTURES,
            rope_scale=rope_scale(gguf),
            rope_freqs=has(ROPE_FREQS),
            attention_bias=has("blk.0.attn_q.bias"),
            output_bias=has("blk.0.attn_output.bias"),
            mlp_bias=has("blk.0.ffn_gate.bias"),
            qk_norm=has("blk.0.attn_q_norm.weight"),
            tie_word_embeddings=not has("output.weight"),
            sliding_window=window,
            sliding_layers=_sliding_layers(gguf, n_layers) if window else (False,) * n_layers,
        )

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s window in tokens, or None (global). A window as long as the
        context never binds, so such a layer keeps append-only rows, not a full-size ring."""
        w = self.sliding_window
        return w if self.sliding_layers[layer] and 0 < w < self.context_length else None

    def layer_specs(self) -> list[LayerSpec]:
        return [LayerSpec(self.num_key_value_heads, self.head_dim, self.window(i))
                for i in range(self.num_hidden_layers)]


def _heads(gguf: GGUFFile) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim); llama.cpp's defaults: KV heads = heads, head dim =
    width / heads, rotary dims = head dim. Raises GGUFError for what is not implemented."""
    name, key = gguf.path.name, gguf.arch_key

    def count(value) -> int:
        if isinstance(value, list):  # llama.cpp accepts per-layer arrays
            if len(set(value)) != 1:
                raise GGUFError(f"{name}: per-layer head counts {value} are not supported")
            value = value[0]
        return int(value)

    n_heads = count(gguf.require(f"{gguf.architecture}.attention.head_count"))
    n_kv_heads = count(key("attention.head_count_kv", n_heads))
    head_dim = int(key("attention.key_length", int(key("embedding_length", 0)) // n_heads))
    value_dim = int(key("attention.value_length", head_dim))
    rotary = int(key("rope.dimension_count", head_dim))
    if value_dim != head_dim or rotary != head_dim:
        raise GGUFError(f"{name}: key width {head_dim}, value width {value_dim} and rotary "
                        f"dims {rotary} must be equal")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise GGUFError(f"{name}: {n_heads} query heads do not group over {n_kv_heads} KV heads")
    return n_heads, n_kv_heads, head_dim


def _sliding_layers(gguf: GGUFFile, n_layers: int) -> tuple[bool, ...]:
    """Which layers use the window: ``attention.sliding_window_pattern`` as a per-layer
    list, or a period n (layer i slides iff ``i % n < n - 1``; 0: all), or all if absent."""
    pattern = gguf.arch_key("attention.sliding_window_pattern")
    if pattern is None:
        return (True,) * n_layers
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise GGUFError(f"{gguf.path.name}: sliding_window_pattern has {len(pattern)} "
                            f"entries for {n_layers} layers")
        return tuple(bool(p) for p in pattern)
    period = int(pattern)
    return tuple(period == 0 or i % period < period - 1 for i in range(n_layers))


def rope_periods(base: float, dims: int, factors: np.ndarray) -> mx.array:
    """``mx.fast.rope``'s ``freqs`` (the inverse frequencies, positions per radian) for
    Llama 3 scaling: llama.cpp divides pair i's frequency ``base^(-2i/dims)`` by
    ``factors[i]`` (``rope_freqs``, ggml's ``rope_ext`` freq_factors). Float32 ``(dims/2,)``."""
    inverse = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    return mx.array((inverse * factors.astype(np.float64)).astype(np.float32))


class Rope(nn.Module):
    """RoPE as llama.cpp applies it to these architectures: ``llama`` rotates adjacent pairs
    (``LLAMA_ROPE_TYPE_NORM``; its converter permutes HF's q/k rows to interleaved order),
    ``qwen2`` and ``qwen3`` rotate halves (``NEOX``); Llama 3's ``rope_freqs`` divide the
    frequencies, linear scaling divides the positions."""

    def __init__(self, args: ModelArgs, factors: np.ndarray | None = None):
        super().__init__()
        self.dims, self.traditional = args.head_dim, args.rope_traditional
        self.base, self.scale = args.rope_theta, args.rope_scale
        self._periods = None if factors is None else rope_periods(args.rope_theta,
                                                                   args.head_dim, factors)

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        """``x``: ``(B, heads, L, head_dim)`` at positions ``offset + [0, L)``."""
        base = self.base if self._periods is None else None
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=base,
                            scale=self.scale, offset=offset, freqs=self._periods)


class Attention(nn.Module, ProjectedAttention):
    def __init__(self, args: ModelArgs, layer: int, rope: Rope):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = args.head_dim**-0.5
        self.window = args.window(layer)
        self.rope, self.qk_norm = rope, args.qk_norm
        hd, dim, bias = args.head_dim, args.hidden_size, args.attention_bias
        self.attn_q = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.attn_k = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.attn_v = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.attn_output = nn.Linear(self.n_heads * hd, dim, bias=args.output_bias)
        if args.qk_norm:
            self.attn_q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
            self.attn_k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache, position: int
               ) -> mx.array:
        """One job's projected queries, keys and values ``(B, L, heads * head_dim)`` at
        `position`: normed (Qwen 3), rotated, written to `cache`, attended; ``(B, L, heads *
        head_dim)`` before the output projection."""
        B, L, _ = q.shape
        q = q.reshape(B, L, self.n_heads, -1)
        k = k.reshape(B, L, self.n_kv_heads, -1)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.qk_norm:  # Qwen 3: per head, before RoPE
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        # (B, heads, L, head_dim)
        q = self.rope(q.transpose(0, 2, 1, 3), position)
        k = self.rope(k.transpose(0, 2, 1, 3), position)
        keys, values, mask = cache.update(k, v, position)
        out = cache_attention(q, keys, values, mask, scale=self.scale, position=position,
                              window=self.window, n_kv_heads=self.n_kv_heads)
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` (llama.cpp's ``LLM_FFN_SILU``, ``LLM_FFN_PAR``)."""
    return nn.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, ffn, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.ffn_gate = nn.Linear(dim, ffn, bias=bias)
        self.ffn_up = nn.Linear(dim, ffn, bias=bias)
        self.ffn_down = nn.Linear(ffn, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        # rows are independent: on a CPU device they run on parallel streams
        return self.ffn_down(split_map(swiglu, [self.ffn_gate(x), self.ffn_up(x)], axis=1))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, rope: Rope):
        super().__init__()
        self.attn = Attention(args, layer, rope)
        self.mlp = MLP(args)
        self.attn_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache, position: int) -> mx.array:
        return self._mlp(x + self.attn(self.attn_norm(x), cache, position))

    def packed(self, x: mx.array, caches: list, positions: list[int], lengths: list[int]
               ) -> mx.array:
        """`__call__` over several jobs' chunks packed along ``L`` (`Attention.packed`)."""
        return self._mlp(x + self.attn.packed(self.attn_norm(x), caches, positions, lengths))

    def _mlp(self, h: mx.array) -> mx.array:
        return h + self.mlp(self.ffn_norm(h))


class Model(nn.Module, KVCacheModel, PackedModel):
    """A Llama-family text model.

    ``model(inputs, cache)`` runs one chunk and returns the final-normed hidden state of its
    last position; ``model.logits(hidden)`` applies the output head (tied or separate) to
    it alone (``every_position=True`` keeps every position, for prompt log-probabilities).
    ``model.packed(inputs, caches)`` runs several jobs' chunks in one forward pass
    (`model.archs._packed.PackedModel`).

    Args:
        rope_factors: Llama 3's per-pair frequency divisors (the GGUF's ``rope_freqs``),
            float ``(head_dim / 2,)``, or None.
    """

    def __init__(self, args: ModelArgs, rope_factors: np.ndarray | None = None):
        super().__init__()
        self.args = args
        self.token_embd = nn.Embedding(args.vocab_size, args.hidden_size)
        rope = Rope(args, rope_factors)
        self.blk = [Block(args, i, rope) for i in range(args.num_hidden_layers)]
        self.output_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def architecture(self) -> str:
        """``llama``, ``qwen2`` or ``qwen3``: a cache state saved by one loads into no other."""
        return self.args.architecture

    @property
    def sliding_window(self) -> int:
        """The window chunk plans align to (`model.planner.plan_chunks`): the GGUF's, or 0
        without one, which the planner reads as token granularity (chunks of the default
        size, balanced to the token)."""
        return self.args.sliding_window

    def __call__(self, inputs: mx.array, cache: ModelCache,
                 every_position: bool = False) -> mx.array:
        """One chunk of token ids, int32 ``(B, L)``, at ``cache.position``: its layers write
        rows ``[position, position + L)``, uncommitted (`model.chunk.launch_chunk` commits).
        Returns the final-normed hidden state, float ``(B, hidden)`` of the last position or
        ``(B, L, hidden)`` of each with `every_position`."""
        h = self.embed(inputs)
        for layer, block in enumerate(self.blk):
            h = block(h, cache[layer], cache.position)
        return self.output_norm(h if every_position else h[:, -1, :])

    def embed(self, inputs: mx.array) -> mx.array:
        """Token ids, int32 ``(..., L)`` -> their embeddings ``(..., L, hidden)``."""
        return self.token_embd(inputs)

    def logits(self, hidden: mx.array) -> mx.array:
        """``(..., hidden)`` -> ``(..., vocab)`` through the output head."""
        if self.args.tie_word_embeddings:
            return self.token_embd.as_linear(hidden)
        return self.output(hidden)



def load(gguf: GGUFFile, dtype: mx.Dtype = mx.float32) -> Model:
    """Build a `Model` and load its weights from `gguf`, dequantized to `dtype` (the RoPE
    frequency divisors stay float32).

    Raises:
        GGUFError: a tensor is missing, of another shape or an unsupported type, or the file
            holds a tensor this module would not use (a variant it does not implement).
    """
    args = ModelArgs.from_gguf(gguf)
    factors = gguf.tensor(ROPE_FREQS) if args.rope_freqs else None
    if factors is not None and factors.shape != (args.head_dim // 2,):
        raise GGUFError(f"{gguf.path.name}: tensor {ROPE_FREQS!r} has shape {factors.shape}, "
                        f"expected ({args.head_dim // 2},)")
    model = Model(args, factors)
    unused = unused_tensors(model, gguf, flat_block_name, also=(ROPE_FREQS,))
    if unused:
        raise GGUFError(f"{gguf.path.name}: tensor {unused[0]!r} (of {len(unused)} unused) "
                        f"is not part of the {args.architecture} model this module builds")
    return load_gguf_weights(model, gguf, flat_block_name, dtype)


def cache_plan(args: ModelArgs, context_length: int, kv_dtype: mx.Dtype) -> CachePlan:
    """Sizes of the KV cache for `context_length` tokens of `kv_dtype` rows (not allocated).

    Raises:
        the errors of `model.cache_plan.plan_cache` (e.g. an empty context).
    """
    return plan_cache(args.layer_specs(), context_length, kv_dtype)
