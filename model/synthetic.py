"""Tiny synthetic GGUF models, written with `gguf.GGUFWriter`, for fast process-level tests.

Same architecture, metadata keys, tensor names and tokenizer format as the real files; small
dims and random weights from a fixed seed, so every process that writes one writes the same
bytes. The sliding window is small (16 tokens) so short prompts wrap it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from .loader import file_sha256

CACHE_DIR_ENV = "PREFILLQ_CACHE_DIR"

# A byte-fallback SentencePiece vocabulary: 4 control tokens, 256 byte tokens, then text.
_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>"]
_TEXT = ["\u2581"] + [chr(c) for c in range(33, 127)] + [
    "\u2581" + w for w in ("the", "a", "of", "and", "to", "is", "in", "number", "even", "odd")
]
TOKEN_TYPE = {"normal": 1, "unknown": 2, "control": 3, "byte": 6}


def _tokenizer_arrays() -> tuple[list[str], list[float], list[int]]:
    tokens = _CONTROL + [f"<0x{b:02X}>" for b in range(256)] + _TEXT
    types = [TOKEN_TYPE["control"]] * 3 + [TOKEN_TYPE["unknown"]]
    types += [TOKEN_TYPE["byte"]] * 256 + [TOKEN_TYPE["normal"]] * len(_TEXT)
    # longer words score higher so "▁the" wins over its pieces, as in a real SPM vocab
    scores = [0.0] * 260 + [float(len(t)) - i * 1e-3 for i, t in enumerate(_TEXT)]
    return tokens, scores, types


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
) -> Path:
    """Write a random-weight Gemma 3 GGUF (5 local layers then 1 global per 6).

    Weights are float32 and scaled so activations stay O(1) through the layers.
    """
    tokens, scores, types = _tokenizer_arrays()
    rng = np.random.default_rng(seed)

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:  # llama.cpp stores Gemma norms with the +1 added
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    writer = GGUFWriter(str(path), "gemma3")
    writer.add_name("prefillq tiny gemma3")
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

    writer.add_tensor("token_embd.weight", linear(len(tokens), hidden) * 0.5)
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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def cache_dir() -> Path:
    """Where generated models live: ``$PREFILLQ_CACHE_DIR`` or ``~/.cache/prefillq``."""
    base = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "prefillq"
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def tiny_gemma3_path() -> tuple[Path, str]:
    """The tiny Gemma 3 GGUF, written once (atomically: several workers may race)."""
    target = cache_dir() / "gemma3-tiny-seed0.gguf"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".gguf.tmp")
        os.close(fd)
        try:
            write_tiny_gemma3(tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target, file_sha256(target)
