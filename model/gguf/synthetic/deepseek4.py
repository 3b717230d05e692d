"""The tiny DeepSeek-V4 GGUF (``deepseek4-tiny``): the config, tensor names and shapes of
docs/deepseek4-tiny.md, with random float32 weights from a fixed seed.

All tensors are float32 except ``blk.{i}.ffn_gate_tid2eid.weight`` (int32, (V, k), k distinct
expert ids per row). Weights are scaled so activations stay O(1). The embeddings share one
large common direction u ("massive activation"), and the q-LoRA, indexer projection and
indexer compressor carry a rank-1 term along it, so indexer weights and q_I . K_I are mostly
positive: relu zeros then never tie at the top-k boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from .common import RandomInit, add_bpe_tokenizer, cached_model, f32, finish

DEEPSEEK4_TINY: dict[str, int | float | bool | str | list[int]] = {
    "block_count": 6,
    "context_length": 4096,
    "embedding_length": 64,
    "embedding_length_out": 256,
    "attention.head_count": 4,
    "attention.head_count_kv": 1,
    "attention.key_length": 32,
    "attention.value_length": 32,
    "rope.dimension_count": 8,
    "rope.freq_base": 10000.0,
    "attention.compress_rope_freq_base": 160000.0,
    "rope.scaling.type": "yarn",
    "rope.scaling.factor": 16.0,
    "rope.scaling.original_context_length": 65536,
    "rope.scaling.yarn_beta_fast": 32.0,
    "rope.scaling.yarn_beta_slow": 1.0,
    "attention.q_lora_rank": 16,
    "attention.output_lora_rank": 16,
    "attention.output_group_count": 2,
    "attention.sliding_window": 16,
    "attention.compress_ratios": [0, 0, 4, 128, 4, 128],
    "attention.indexer.head_count": 2,
    "attention.indexer.key_length": 16,
    "attention.indexer.top_k": 3,
    "expert_count": 4,
    "expert_used_count": 2,
    "expert_shared_count": 1,
    "expert_feed_forward_length": 32,
    "expert_weights_scale": 1.5,
    "expert_weights_norm": True,
    "expert_gating_func": 4,  # sqrt(softplus), hf2q's numbering
    "hash_layer_count": 2,
    "swiglu_clamp_exp": 10.0,
    "hyper_connection.count": 4,
    "hyper_connection.sinkhorn_iterations": 20,
    "hyper_connection.epsilon": 1e-6,
    "attention.layer_norm_rms_epsilon": 1e-6,
}

# Changed whenever the weights change, so cached files get rewritten (`tiny_deepseek4_path`).
DEEPSEEK4_TINY_NAME = "prefillq tiny deepseek4 v2"

DEEPSEEK4_BOS, DEEPSEEK4_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@dataclass(frozen=True)
class _Dims:
    """The sizes `DEEPSEEK4_TINY` sets, under short names."""

    vocab: int
    hidden: int = DEEPSEEK4_TINY["embedding_length"]
    hc: int = DEEPSEEK4_TINY["hyper_connection.count"]
    n_heads: int = DEEPSEEK4_TINY["attention.head_count"]
    head_dim: int = DEEPSEEK4_TINY["attention.key_length"]
    rope_dim: int = DEEPSEEK4_TINY["rope.dimension_count"]
    q_rank: int = DEEPSEEK4_TINY["attention.q_lora_rank"]
    o_rank: int = DEEPSEEK4_TINY["attention.output_lora_rank"]
    o_groups: int = DEEPSEEK4_TINY["attention.output_group_count"]
    idx_heads: int = DEEPSEEK4_TINY["attention.indexer.head_count"]
    idx_dim: int = DEEPSEEK4_TINY["attention.indexer.key_length"]
    n_experts: int = DEEPSEEK4_TINY["expert_count"]
    k_used: int = DEEPSEEK4_TINY["expert_used_count"]
    ffn: int = DEEPSEEK4_TINY["expert_feed_forward_length"]


@dataclass(frozen=True)
class _Directions:
    """The shared directions that keep the indexer's scores positive (module docstring).

    Attributes:
        u: (hidden,) the common direction of every embedding.
        s: (q_rank,) where u lands in the q-LoRA latent.
        key: (idx_dim,) the indexer key/query direction, on the non-rotary dims so RoPE keeps
            it.
    """

    u: np.ndarray
    s: np.ndarray
    key: np.ndarray


def _add_metadata(writer: GGUFWriter, config: dict) -> None:
    """Write `config` as ``deepseek4.*`` keys (lists as uint32 arrays, floats as float32)."""
    for name, value in config.items():
        key = f"deepseek4.{name}"
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)


def _add_hyper_connections(writer: GGUFWriter, init: RandomInit, p: str, d: _Dims) -> None:
    """The hyper-connection mixers and pre-norms of the attention and FFN sublayers."""
    mix = (2 + d.hc) * d.hc  # pre, post and the hc x hc residual mix
    for sub in ("attn", "ffn"):
        writer.add_tensor(p + f"hc_{sub}_fn.weight", init.linear(mix, d.hc * d.hidden) * 0.1)
        writer.add_tensor(p + f"hc_{sub}_base.weight", init.normal(mix, scale=0.5))
        writer.add_tensor(p + f"hc_{sub}_scale.weight", f32(init.rng.uniform(0.5, 1.0, 3)))
        writer.add_tensor(p + f"{sub}_norm.weight", init.norm(d.hidden))


def _add_attention(
    writer: GGUFWriter, init: RandomInit, p: str, d: _Dims, dirs: _Directions
) -> None:
    """q-LoRA, the shared KV projection, the grouped output LoRA and the attention sinks."""
    linear, norm = init.linear, init.norm
    q_a = linear(d.q_rank, d.hidden) + f32(np.outer(dirs.s, dirs.u))
    writer.add_tensor(p + "attn_q_a.weight", q_a)
    writer.add_tensor(p + "attn_q_a_norm.weight", norm(d.q_rank))
    writer.add_tensor(p + "attn_q_b.weight", linear(d.n_heads * d.head_dim, d.q_rank))
    writer.add_tensor(p + "attn_kv.weight", linear(d.head_dim, d.hidden))
    writer.add_tensor(p + "attn_kv_a_norm.weight", norm(d.head_dim))
    writer.add_tensor(
        p + "attn_output_a.weight",
        linear(d.o_groups * d.o_rank, d.n_heads * d.head_dim // d.o_groups),
    )
    writer.add_tensor(p + "attn_output_b.weight", linear(d.hidden, d.o_groups * d.o_rank))
    writer.add_tensor(p + "attn_sinks.weight", init.normal(d.n_heads))


def _add_compressor(writer: GGUFWriter, init: RandomInit, p: str, d: _Dims, ratio: int) -> None:
    """The KV compressor of a layer with compression `ratio` (4: overlapping windows)."""
    width = (2 if ratio == 4 else 1) * d.head_dim
    writer.add_tensor(p + "attn_compressor_ape.weight", init.normal(ratio, width, scale=0.1))
    writer.add_tensor(p + "attn_compressor_kv.weight", init.linear(width, d.hidden))
    writer.add_tensor(p + "attn_compressor_gate.weight", init.linear(width, d.hidden))
    writer.add_tensor(p + "attn_compressor_norm.weight", init.norm(d.head_dim))


def _add_indexer(writer: GGUFWriter, init: RandomInit, p: str, d: _Dims, dirs: _Directions) -> None:
    """The sparse-attention indexer of a ratio-4 layer: query, head weights, key compressor."""
    linear, ih, ihd = init.linear, d.idx_heads, d.idx_dim
    q_b = linear(ih, ihd, d.q_rank) + np.einsum("d,r->dr", dirs.key, dirs.s)
    writer.add_tensor(p + "indexer.attn_q_b.weight", f32(q_b.reshape(ih * ihd, d.q_rank)))
    writer.add_tensor(p + "indexer.proj.weight", linear(ih, d.hidden, gain=0.3) + f32(2.0 * dirs.u))
    writer.add_tensor(p + "indexer_compressor_ape.weight", init.normal(4, 2 * ihd, scale=0.1))
    kv = linear(2 * ihd, d.hidden) + np.outer(np.tile(dirs.key, 2), dirs.u)
    writer.add_tensor(p + "indexer_compressor_kv.weight", f32(kv))
    writer.add_tensor(p + "indexer_compressor_gate.weight", linear(2 * ihd, d.hidden))
    writer.add_tensor(p + "indexer_compressor_norm.weight", init.norm(ihd))


def _add_moe(writer: GGUFWriter, init: RandomInit, p: str, d: _Dims, hashed: bool) -> None:
    """The router (a token-id hash table when `hashed`, else a bias), experts, shared expert."""
    linear = init.linear
    writer.add_tensor(p + "ffn_gate_inp.weight", linear(d.n_experts, d.hidden, gain=3.0))
    if hashed:
        ids = np.argsort(init.rng.random((d.vocab, d.n_experts)), axis=1)[:, : d.k_used]
        writer.add_tensor(p + "ffn_gate_tid2eid.weight", ids.astype(np.int32))
    else:
        writer.add_tensor(p + "exp_probs_b.bias", init.normal(d.n_experts, scale=0.1))
    writer.add_tensor(p + "ffn_gate_exps.weight", linear(d.n_experts, d.ffn, d.hidden))
    writer.add_tensor(p + "ffn_up_exps.weight", linear(d.n_experts, d.ffn, d.hidden))
    writer.add_tensor(p + "ffn_down_exps.weight", linear(d.n_experts, d.hidden, d.ffn))
    writer.add_tensor(p + "ffn_gate_shexp.weight", linear(d.ffn, d.hidden))
    writer.add_tensor(p + "ffn_up_shexp.weight", linear(d.ffn, d.hidden))
    writer.add_tensor(p + "ffn_down_shexp.weight", linear(d.hidden, d.ffn))


def _add_output(writer: GGUFWriter, init: RandomInit, d: _Dims) -> None:
    """The final hyper-connection collapse, norm and (untied) output head."""
    writer.add_tensor("output_hc_fn.weight", init.linear(d.hc, d.hc * d.hidden) * 0.1)
    writer.add_tensor("output_hc_base.weight", init.normal(d.hc, scale=0.5))
    writer.add_tensor("output_hc_scale.weight", f32(init.rng.uniform(0.5, 1.0, 1)))
    writer.add_tensor("output_norm.weight", init.norm(d.hidden))
    writer.add_tensor("output.weight", init.linear(d.vocab, d.hidden))


def write_tiny_deepseek4(path: str | Path, *, seed: int = 0) -> Path:
    """Write the random-weight DeepSeek-V4 GGUF of docs/deepseek4-tiny.md (arch ``deepseek4``)
    to `path`; the same seed gives the same bytes."""
    writer = GGUFWriter(str(path), "deepseek4")
    writer.add_name(DEEPSEEK4_TINY_NAME)
    _add_metadata(writer, DEEPSEEK4_TINY)
    vocab = add_bpe_tokenizer(writer, "deepseek-v3", DEEPSEEK4_BOS, DEEPSEEK4_EOS, add_bos=True)
    d = _Dims(vocab=vocab)
    init = RandomInit(seed)
    u, s = init.unit(d.hidden), init.unit(d.q_rank)
    key = np.zeros(d.idx_dim)
    key[: d.idx_dim - d.rope_dim] = init.unit(d.idx_dim - d.rope_dim)
    dirs = _Directions(u=u, s=s, key=key)
    embd = f32(init.rng.standard_normal((d.vocab, d.hidden)) + 8.0 * u)
    writer.add_tensor("token_embd.weight", embd)
    for i, ratio in enumerate(DEEPSEEK4_TINY["attention.compress_ratios"]):
        p = f"blk.{i}."
        _add_hyper_connections(writer, init, p, d)
        _add_attention(writer, init, p, d, dirs)
        if ratio:
            _add_compressor(writer, init, p, d, ratio)
        if ratio == 4:
            _add_indexer(writer, init, p, d, dirs)
        _add_moe(writer, init, p, d, hashed=i < DEEPSEEK4_TINY["hash_layer_count"])
    _add_output(writer, init, d)
    return finish(writer, path)


def tiny_deepseek4_path() -> tuple[Path, str]:
    """The tiny DeepSeek-V4 GGUF (seed 0) and its sha256, written once (see `cached_model`).

    A cached file written by an older `write_tiny_deepseek4` (another ``general.name``) is
    rewritten.
    """
    return cached_model("deepseek4-tiny-seed0.gguf", write_tiny_deepseek4, DEEPSEEK4_TINY_NAME)
