"""The sizes every decoder's ``ModelArgs`` here holds (`gemma3`, `llama`), and the GGUF keys
they all read the same way; each architecture adds its own fields and reads the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..gguf.reader import GGUFError, GGUFFile


@dataclass(frozen=True)
class DecoderArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int


def gguf_sizes(gguf: GGUFFile) -> dict[str, Any]:
    """The `DecoderArgs` fields every architecture reads from the same ``{arch}.*`` keys
    (heads, head width and RoPE base each reads its own way).

    Raises:
        GGUFError: naming a missing key.
    """
    a = f"{gguf.architecture}."
    return {
        "hidden_size": int(gguf.require(a + "embedding_length")),
        "num_hidden_layers": int(gguf.require(a + "block_count")),
        "intermediate_size": int(gguf.require(a + "feed_forward_length")),
        "vocab_size": len(gguf.require("tokenizer.ggml.tokens")),
        "rms_norm_eps": float(gguf.require(a + "attention.layer_norm_rms_epsilon")),
        "context_length": int(gguf.require(a + "context_length")),
    }


def rope_scale(gguf: GGUFFile) -> float:
    """The position scale of llama.cpp's ``rope_freq_scale_train``: 1 / ``rope.scaling.factor``
    (or the older ``rope.scale_linear``) for linear scaling, its default type; 1 for none.

    Raises:
        GGUFError: another scaling type (yarn, longrope) is declared.
    """
    kind = str(gguf.arch_key("rope.scaling.type", "linear"))
    if kind == "none":
        return 1.0
    if kind != "linear":
        raise GGUFError(f"{gguf.path.name}: rope scaling type {kind!r} is not supported "
                        "(none, linear, or Llama 3's rope_freqs tensor)")
    factor = float(gguf.arch_key("rope.scaling.factor", 0.0) or
                   gguf.arch_key("rope.scale_linear", 0.0) or 0.0)
    return 1.0 / factor if factor else 1.0
