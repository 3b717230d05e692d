"""The tiny Gemma 3 GGUF (``gemma3-tiny``): 64 wide, 6 layers, a 16-token sliding window.

Same architecture, metadata keys, tensor names and tokenizer format as a llama.cpp Gemma 3
GGUF (`model.archs.gemma3` reads both); random float32 weights from a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFWriter, RopeScalingType

from ...tokenizer.vocab import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
)
from .common import RandomInit, cached_model, finish

GEMMA3_TINY_NAME = "prefillq tiny gemma3 v2"

# A byte-fallback SentencePiece vocabulary: 4 control tokens, 256 byte tokens, then text.
_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>"]
_TEXT = (
    ["\u2581"]
    + [chr(c) for c in range(33, 127)]
    + ["\u2581" + w for w in ("the", "a", "of", "and", "to", "is", "in", "number", "even", "odd")]
)


def _spm_vocab(vocab_size: int | None = None) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the tiny SentencePiece vocabulary, padded up to
    `vocab_size` where one is given with pieces text never splits into (``<unused0>``, ...,
    scored far below the rest)."""
    tokens = _CONTROL + [f"<0x{b:02X}>" for b in range(256)] + _TEXT
    types = [TOKEN_TYPE_CONTROL] * 3 + [TOKEN_TYPE_UNKNOWN]
    types += [TOKEN_TYPE_BYTE] * 256 + [TOKEN_TYPE_NORMAL] * len(_TEXT)
    # longer words score higher so "▁the" wins over its pieces, as in a real SPM vocab
    scores = [0.0] * 260 + [float(len(t)) - i * 1e-3 for i, t in enumerate(_TEXT)]
    unused = max(0, (vocab_size or 0) - len(tokens))
    tokens += [f"<unused{i}>" for i in range(unused)]
    return tokens, scores + [-1e6] * unused, types + [TOKEN_TYPE_NORMAL] * unused


def _add_tokenizer(writer: GGUFWriter, vocab_size: int | None = None) -> int:
    """Write the vocabulary (`_spm_vocab`) and special ids; returns the vocabulary size."""
    tokens, scores, types = _spm_vocab(vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)  # as Gemma 3's GGUF: llama.cpp's default is on
    return len(tokens)


def _add_layers(
    writer: GGUFWriter, init: RandomInit, *, hidden: int, n_layers: int, n_heads: int,
    n_kv_heads: int, head_dim: int, ffn: int,
) -> None:  # fmt: skip
    """Write every block's tensors, then the output norm (the head is tied to the embedding)."""
    linear, norm = init.linear, init.norm
    for i in range(n_layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_q.weight", linear(n_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_k.weight", linear(n_kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_v.weight", linear(n_kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_output.weight", linear(hidden, n_heads * head_dim))
        writer.add_tensor(p + "attn_q_norm.weight", norm(head_dim))
        writer.add_tensor(p + "attn_k_norm.weight", norm(head_dim))
        writer.add_tensor(p + "ffn_gate.weight", linear(ffn, hidden))
        writer.add_tensor(p + "ffn_up.weight", linear(ffn, hidden))
        writer.add_tensor(p + "ffn_down.weight", linear(hidden, ffn))
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            writer.add_tensor(p + name + ".weight", norm(hidden))
    writer.add_tensor("output_norm.weight", norm(hidden))


def write_tiny_gemma3(
    path: str | Path,
    *,
    seed: int = 0,
    hidden: int = 64,
    n_layers: int = 6,
    n_heads: int = 4,
    n_kv_heads: int = 1,
    head_dim: int = 16,
    ffn: int = 128,
    sliding_window: int = 16,
    context_length: int = 4096,
    vocab_size: int | None = None,
    rope_scaling_factor: float = 0.0,
) -> Path:
    """Write a random-weight Gemma 3 GGUF (5 local layers then 1 global per 6) to `path`.

    Weights are float32 and scaled so activations stay O(1) through the layers; the same
    arguments give the same bytes. `vocab_size` pads the tiny vocabulary with unused
    tokens (a real model's embedding and output head at the tiny one's tokenizer).
    `rope_scaling_factor` (0: none) writes linear RoPE scaling as llama.cpp's converter does
    for Gemma 3 4B and larger (factor 8).
    """
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_name(GEMMA3_TINY_NAME)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(sliding_window)
    if rope_scaling_factor:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling_factor)
    vocab = _add_tokenizer(writer, vocab_size)
    init = RandomInit(seed)
    writer.add_tensor("token_embd.weight", init.linear(vocab, hidden) * 0.5)
    _add_layers(
        writer, init, hidden=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, ffn=ffn,
    )  # fmt: skip
    return finish(writer, path)


def tiny_gemma3_path() -> tuple[Path, str]:
    """The tiny Gemma 3 GGUF (seed 0) and its sha256, written once (see `cached_model`).

    A cached file written by an older `write_tiny_gemma3` (another ``general.name``) is
    rewritten.
    """
    return cached_model("gemma3-tiny-seed0.gguf", write_tiny_gemma3, GEMMA3_TINY_NAME)
