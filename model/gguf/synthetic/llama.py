"""The tiny Llama-family GGUFs (``llama-tiny``, ``qwen2-tiny``, ``qwen3-tiny``): the metadata
keys, tensor names and layouts of llama.cpp's converter for each architecture, a small
byte-level BPE vocabulary, random float32 weights from a fixed seed.

Each variant exercises what its family adds (`model.archs.llama`): ``llama-tiny`` Llama 3's
frequency scaling (a ``rope_freqs`` tensor) and a separate output head, ``qwen2-tiny`` q/k/v
biases, ``qwen3-tiny`` per-head q/k norms, a head dim wider than width / heads and a tied
head. Random weights need no permutation: they are in GGUF layout as written (llama.cpp's
converter permutes HF's q/k rows for ``llama`` into the interleaved pairs its RoPE rotates).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize

from .common import RandomInit, add_bpe_tokenizer, cached_model, f32, finish


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3's RoPE scaling config (HF ``rope_scaling`` of type llama3)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class TinyLlama:
    """One tiny variant: architecture, sizes and the optional parts it has.

    Attributes:
        name: ``general.name``; change it whenever the weights change, so cached files are
            rewritten (`tiny_llama_path`).
        biases: q/k/v biases (Qwen 2); `extra_biases`: attention output and MLP biases.
        tied: no ``output.weight`` (the head is the embedding).
        llama3: written as the ``rope_freqs`` tensor, as llama.cpp's converter does.
        linear_factor: ``rope.scaling.type`` linear with this factor (0: none).
        sliding_window, sliding_pattern: ``attention.sliding_window`` (0: none) and the
            per-layer ``attention.sliding_window_pattern`` (None: not written).
    """

    name: str
    architecture: str
    pre: str
    bos: str
    eos: str
    add_bos: bool
    hidden: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    rope_base: float = 1_000_000.0
    context_length: int = 4096
    rms_eps: float = 1e-6
    biases: bool = False
    extra_biases: bool = False
    qk_norm: bool = False
    tied: bool = True
    llama3: Llama3Scaling | None = None
    linear_factor: float = 0.0
    sliding_window: int = 0
    sliding_pattern: tuple[bool, ...] | None = None


LLAMA_TINY = TinyLlama(
    name="prefillq tiny llama", architecture="llama", pre="llama-bpe",
    bos="<|begin_of_text|>", eos="<|end_of_text|>", add_bos=True, head_dim=32,
    rope_base=500_000.0, rms_eps=1e-5, tied=False,
    # a short original context, so positions of a test prompt reach the scaled dims
    llama3=Llama3Scaling(factor=8.0, original_context=256),
)  # fmt: skip
QWEN2_TINY = TinyLlama(
    name="prefillq tiny qwen2", architecture="qwen2", pre="qwen2", bos="<|endoftext|>",
    eos="<|im_end|>", add_bos=False, hidden=96, n_heads=6, n_kv_heads=2, ffn=160,
    biases=True, tied=False,
)  # fmt: skip
QWEN3_TINY = TinyLlama(
    name="prefillq tiny qwen3", architecture="qwen3", pre="qwen2", bos="<|endoftext|>",
    eos="<|im_end|>", add_bos=False, n_heads=2, n_kv_heads=1, head_dim=128, qk_norm=True,
)  # fmt: skip
TINY_LLAMAS = {"llama-tiny": LLAMA_TINY, "qwen2-tiny": QWEN2_TINY, "qwen3-tiny": QWEN3_TINY}


def llama3_rope_factors(base: float, dims: int, s: Llama3Scaling) -> np.ndarray:
    """The ``rope_freqs`` divisors llama.cpp's converter writes for Llama 3 scaling
    (``convert_hf_to_gguf.py``, ``LlamaModel.generate_extra_tensors``): 1 for wavelengths
    under ``original / high_freq_factor``, `factor` over ``original / low_freq_factor``,
    a smooth blend between. Float32 ``(dims / 2,)``."""
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    factors = []
    for freq in 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s.factor)
        else:
            smooth = (s.original_context / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / s.factor + smooth))
    return f32(factors)


def _add_metadata(writer: GGUFWriter, c: TinyLlama) -> None:
    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.hidden)
    writer.add_block_count(c.n_layers)
    writer.add_feed_forward_length(c.ffn)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_base)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    if c.linear_factor:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.linear_factor)
    if c.sliding_window:
        writer.add_sliding_window(c.sliding_window)
        if c.sliding_pattern is not None:
            writer.add_sliding_window_pattern(list(c.sliding_pattern))


def _add_block(writer: GGUFWriter, init: RandomInit, p: str, c: TinyLlama) -> None:
    """One block's tensors, shapes ``(out, in)`` as GGUF stores linear layers."""
    linear, norm = init.linear, init.norm
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    writer.add_tensor(p + "attn_norm.weight", norm(c.hidden))
    for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
        writer.add_tensor(p + name + ".weight", linear(rows, c.hidden))
        if c.biases:  # Qwen 2's key biases are large: the test sees them
            writer.add_tensor(p + name + ".bias", init.normal(rows, scale=0.5))
    writer.add_tensor(p + "attn_output.weight", linear(c.hidden, q))
    if c.qk_norm:
        writer.add_tensor(p + "attn_q_norm.weight", norm(c.head_dim))
        writer.add_tensor(p + "attn_k_norm.weight", norm(c.head_dim))
    writer.add_tensor(p + "ffn_norm.weight", norm(c.hidden))
    writer.add_tensor(p + "ffn_gate.weight", linear(c.ffn, c.hidden))
    writer.add_tensor(p + "ffn_up.weight", linear(c.ffn, c.hidden))
    writer.add_tensor(p + "ffn_down.weight", linear(c.hidden, c.ffn))
    if c.extra_biases:
        for name, rows in (("attn_output", c.hidden), ("ffn_gate", c.ffn), ("ffn_up", c.ffn),
                           ("ffn_down", c.hidden)):
            writer.add_tensor(p + name + ".bias", init.normal(rows, scale=0.2))


class _QuantizingWriter(GGUFWriter):
    """A `GGUFWriter` that stores 2-D weights as `quant` (the ``gguf`` package quantizes;
    rows whose width is not a multiple of the type's block stay float32)."""

    def __init__(self, path: str, arch: str, quant: GGMLQuantizationType | None):
        super().__init__(path, arch)
        self.quant = quant

    def add_tensor(self, name: str, tensor: np.ndarray, **kwargs) -> None:
        block = GGML_QUANT_SIZES[self.quant][0] if self.quant is not None else 0
        if block and tensor.ndim == 2 and tensor.shape[1] % block == 0:
            if self.quant == GGMLQuantizationType.F16:
                tensor = tensor.astype(np.float16)
            else:
                kwargs["raw_dtype"] = self.quant
                tensor = quantize(tensor, self.quant)
        super().add_tensor(name, tensor, **kwargs)


def write_tiny_llama(path: str | Path, config: TinyLlama = LLAMA_TINY, *, seed: int = 0,
                     rope_freqs: bool = True, quant: GGMLQuantizationType | None = None,
                     edit: Callable[[GGUFWriter], object] | None = None) -> Path:
    """Write the random-weight GGUF of `config` to `path`; the same arguments give the same
    bytes.

    Args:
        rope_freqs: False leaves Llama 3's scaling tensor out (the same weights otherwise).
        quant: the type of the 2-D weights (default float32), e.g. Q4_1 as SmolLM2's GGUF.
        edit: called with the writer last, to add keys or tensors (tests of bad files).
    """
    writer = _QuantizingWriter(str(path), config.architecture, quant)
    writer.add_name(config.name)
    _add_metadata(writer, config)
    vocab = add_bpe_tokenizer(writer, config.pre, config.bos, config.eos,
                              add_bos=config.add_bos, control=("<|im_start|>",))
    init = RandomInit(seed)
    writer.add_tensor("token_embd.weight", init.normal(vocab, config.hidden))
    if config.llama3 is not None and rope_freqs:
        factors = llama3_rope_factors(config.rope_base, config.head_dim, config.llama3)
        writer.add_tensor("rope_freqs.weight", factors)
    for i in range(config.n_layers):
        _add_block(writer, init, f"blk.{i}.", config)
    writer.add_tensor("output_norm.weight", init.norm(config.hidden))
    if not config.tied:
        writer.add_tensor("output.weight", init.linear(vocab, config.hidden))
    if edit is not None:
        edit(writer)
    return finish(writer, path)


def tiny_llama_path(config: TinyLlama) -> tuple[Path, str]:
    """The GGUF of `config` (seed 0) and its sha256, written once (see `cached_model`)."""
    filename = config.name.removeprefix("prefillq ").replace(" ", "-") + "-seed0.gguf"
    return cached_model(filename, lambda path: write_tiny_llama(path, config), config.name)

