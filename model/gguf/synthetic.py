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
from gguf import GGUFValueType, GGUFWriter

from .reader import file_sha256

CACHE_DIR_ENV = "PREFILLQ_CACHE_DIR"

# A byte-fallback SentencePiece vocabulary: 4 control tokens, 256 byte tokens, then text.
_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>"]
_TEXT = (
    ["\u2581"]
    + [chr(c) for c in range(33, 127)]
    + ["\u2581" + w for w in ("the", "a", "of", "and", "to", "is", "in", "number", "even", "odd")]
)
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
    return _cached_model("gemma3-tiny-seed0.gguf", write_tiny_gemma3)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4 (arch "deepseek4"): config, tensor names and shapes of docs/deepseek4-tiny.md.

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

# Bumped whenever the weights change, so cached files get rewritten (tiny_deepseek4_path).
DEEPSEEK4_TINY_NAME = "prefillq tiny deepseek4 v2"

# GPT-2 byte-level BPE: 2 control tokens, the 256 byte tokens, then the tokens of these merges.
DEEPSEEK4_BOS, DEEPSEEK4_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
_DS4_MERGES = [
    "Ġ t", "h e", "Ġ a", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "Ġ o",
    "e n", "Ġ c", "i s", "i t", "Ġ b", "o r", "e s", "Ġ f", "Ġ p", "a n", "e d", "Ġ m",
    "in g", "Ġo f", "Ġ i", "a r", "o u", "Ġt o", "n d", "Ġa nd", "Ġi n", "Ġi s", "l l",
    "Ġ d", "l e", "Ġ n", "Ġ h", "Ġo n", "Ġw h",
]  # fmt: skip


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (`openai/gpt-2:src/encoder.py`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return chars


def _deepseek4_vocab() -> tuple[list[str], list[int], list[str]]:
    byte_chars = bytes_to_unicode()
    tokens = [DEEPSEEK4_BOS, DEEPSEEK4_EOS] + [byte_chars[b] for b in sorted(byte_chars)]
    for merge in _DS4_MERGES:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens, f"merge {merge!r} uses an unknown token"
        assert left + right not in tokens, f"merge {merge!r} repeats a token"
        tokens.append(left + right)
    types = [TOKEN_TYPE["control"]] * 2 + [TOKEN_TYPE["normal"]] * (len(tokens) - 2)
    return tokens, types, list(_DS4_MERGES)


def _write_deepseek4_metadata(writer: GGUFWriter, config: dict) -> None:
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


def write_tiny_deepseek4(path: str | Path, *, seed: int = 0) -> Path:
    """Write the random-weight DeepSeek-V4 GGUF of docs/deepseek4-tiny.md (arch ``deepseek4``).

    All tensors are float32 except ``blk.{i}.ffn_gate_tid2eid.weight`` (int32, (V, k), k
    distinct expert ids per row). Weights are scaled so activations stay O(1). The embeddings
    share one large common direction u ("massive activation"), and the q-LoRA, indexer
    projection and indexer compressor carry a rank-1 term along it, so indexer weights and
    q_I . K_I are mostly positive: relu zeros then never tie at the top-k boundary.
    """
    c = DEEPSEEK4_TINY
    tokens, types, merges = _deepseek4_vocab()
    vocab, hidden, hc = len(tokens), c["embedding_length"], c["hyper_connection.count"]
    nh, hd, rd = c["attention.head_count"], c["attention.key_length"], c["rope.dimension_count"]
    qr, orank, og = (
        c["attention.q_lora_rank"],
        c["attention.output_lora_rank"],
        c["attention.output_group_count"],
    )
    ih, ihd = c["attention.indexer.head_count"], c["attention.indexer.key_length"]
    n_exp, k_used, ffn = c["expert_count"], c["expert_used_count"], c["expert_feed_forward_length"]
    rng = np.random.default_rng(seed)

    def f32(a) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    def linear(*shape: int, gain: float = 1.0) -> np.ndarray:  # (..., out, in)
        return f32(gain * rng.standard_normal(shape) / np.sqrt(shape[-1]))

    def norm(dim: int) -> np.ndarray:
        return f32(1.0 + 0.1 * rng.standard_normal(dim))

    def unit(dim: int) -> np.ndarray:
        v = rng.standard_normal(dim)
        return v / np.linalg.norm(v)

    u = unit(hidden)  # the common direction of every embedding
    s = unit(qr)  # where u lands in the q-LoRA latent
    key_dir = np.zeros(ihd)  # indexer key/query direction, on non-rotary dims so RoPE keeps it
    key_dir[: ihd - rd] = unit(ihd - rd)

    writer = GGUFWriter(str(path), "deepseek4")
    writer.add_name(DEEPSEEK4_TINY_NAME)
    _write_deepseek4_metadata(writer, c)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-v3")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(DEEPSEEK4_BOS))
    writer.add_eos_token_id(tokens.index(DEEPSEEK4_EOS))
    writer.add_add_bos_token(True)

    writer.add_tensor("token_embd.weight", f32(rng.standard_normal((vocab, hidden)) + 8.0 * u))
    for i, ratio in enumerate(c["attention.compress_ratios"]):
        p = f"blk.{i}."
        for sub in ("attn", "ffn"):
            writer.add_tensor(p + f"hc_{sub}_fn.weight", linear((2 + hc) * hc, hc * hidden) * 0.1)
            writer.add_tensor(
                p + f"hc_{sub}_base.weight", f32(0.5 * rng.standard_normal((2 + hc) * hc))
            )
            writer.add_tensor(p + f"hc_{sub}_scale.weight", f32(rng.uniform(0.5, 1.0, 3)))
            writer.add_tensor(p + f"{sub}_norm.weight", norm(hidden))
        writer.add_tensor(p + "attn_q_a.weight", linear(qr, hidden) + f32(np.outer(s, u)))
        writer.add_tensor(p + "attn_q_a_norm.weight", norm(qr))
        writer.add_tensor(p + "attn_q_b.weight", linear(nh * hd, qr))
        writer.add_tensor(p + "attn_kv.weight", linear(hd, hidden))
        writer.add_tensor(p + "attn_kv_a_norm.weight", norm(hd))
        writer.add_tensor(p + "attn_output_a.weight", linear(og * orank, nh * hd // og))
        writer.add_tensor(p + "attn_output_b.weight", linear(hidden, og * orank))
        writer.add_tensor(p + "attn_sinks.weight", f32(rng.standard_normal(nh)))
        if ratio:
            coff = 2 if ratio == 4 else 1
            writer.add_tensor(
                p + "attn_compressor_ape.weight", f32(0.1 * rng.standard_normal((ratio, coff * hd)))
            )
            writer.add_tensor(p + "attn_compressor_kv.weight", linear(coff * hd, hidden))
            writer.add_tensor(p + "attn_compressor_gate.weight", linear(coff * hd, hidden))
            writer.add_tensor(p + "attn_compressor_norm.weight", norm(hd))
        if ratio == 4:
            q_b = linear(ih, ihd, qr) + np.einsum("d,r->dr", key_dir, s)
            writer.add_tensor(p + "indexer.attn_q_b.weight", f32(q_b.reshape(ih * ihd, qr)))
            writer.add_tensor(
                p + "indexer.proj.weight", linear(ih, hidden, gain=0.3) + f32(2.0 * u)
            )
            writer.add_tensor(
                p + "indexer_compressor_ape.weight", f32(0.1 * rng.standard_normal((4, 2 * ihd)))
            )
            kv = linear(2 * ihd, hidden) + np.outer(np.tile(key_dir, 2), u)
            writer.add_tensor(p + "indexer_compressor_kv.weight", f32(kv))
            writer.add_tensor(p + "indexer_compressor_gate.weight", linear(2 * ihd, hidden))
            writer.add_tensor(p + "indexer_compressor_norm.weight", norm(ihd))
        writer.add_tensor(p + "ffn_gate_inp.weight", linear(n_exp, hidden, gain=3.0))
        if i < c["hash_layer_count"]:
            ids = np.argsort(rng.random((vocab, n_exp)), axis=1)[:, :k_used]
            writer.add_tensor(p + "ffn_gate_tid2eid.weight", ids.astype(np.int32))
        else:
            writer.add_tensor(p + "exp_probs_b.bias", f32(0.1 * rng.standard_normal(n_exp)))
        writer.add_tensor(p + "ffn_gate_exps.weight", linear(n_exp, ffn, hidden))
        writer.add_tensor(p + "ffn_up_exps.weight", linear(n_exp, ffn, hidden))
        writer.add_tensor(p + "ffn_down_exps.weight", linear(n_exp, hidden, ffn))
        writer.add_tensor(p + "ffn_gate_shexp.weight", linear(ffn, hidden))
        writer.add_tensor(p + "ffn_up_shexp.weight", linear(ffn, hidden))
        writer.add_tensor(p + "ffn_down_shexp.weight", linear(hidden, ffn))
    writer.add_tensor("output_hc_fn.weight", linear(hc, hc * hidden) * 0.1)
    writer.add_tensor("output_hc_base.weight", f32(0.5 * rng.standard_normal(hc)))
    writer.add_tensor("output_hc_scale.weight", f32(rng.uniform(0.5, 1.0, 1)))
    writer.add_tensor("output_norm.weight", norm(hidden))
    writer.add_tensor("output.weight", linear(vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _cached_model(name: str, write, is_current=lambda path: True) -> tuple[Path, str]:
    target = cache_dir() / name
    if not target.exists() or not is_current(target):
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".gguf.tmp")
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target, file_sha256(target)


def tiny_deepseek4_path() -> tuple[Path, str]:
    """The tiny DeepSeek-V4 GGUF (seed 0) and its sha256, written once, atomically.

    A cached file written by an older version of `write_tiny_deepseek4` (another
    ``general.name``) is rewritten.
    """

    def is_current(path: Path) -> bool:
        from .reader import GGUFError, read_gguf

        try:
            return read_gguf(path).metadata.get("general.name") == DEEPSEEK4_TINY_NAME
        except GGUFError:
            return False

    return _cached_model("deepseek4-tiny-seed0.gguf", write_tiny_deepseek4, is_current)
