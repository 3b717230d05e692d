"""What the tiny-model writers share: seeded random initializers and the on-disk cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from ...tokenizer.bpe import bytes_to_unicode
from ...tokenizer.vocab import TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL
from ..reader import GGUFError, file_sha256, read_gguf
from ..store import build_once, cache_dir

# A small GPT-2 byte-level BPE: the control tokens, the 256 byte tokens, then the tokens of
# these merges (English's most frequent pairs, so text tokenizes into more than bytes).
BPE_MERGES = [
    "Ġ t", "h e", "Ġ a", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "Ġ o",
    "e n", "Ġ c", "i s", "i t", "Ġ b", "o r", "e s", "Ġ f", "Ġ p", "a n", "e d", "Ġ m",
    "in g", "Ġo f", "Ġ i", "a r", "o u", "Ġt o", "n d", "Ġa nd", "Ġi n", "Ġi s", "l l",
    "Ġ d", "l e", "Ġ n", "Ġ h", "Ġo n", "Ġw h",
]  # fmt: skip


def f32(a) -> np.ndarray:
    """`a` as a C-contiguous float32 array (what `GGUFWriter.add_tensor` stores as F32)."""
    return np.ascontiguousarray(a, dtype=np.float32)


class RandomInit:
    """Float32 weights from one seeded generator: the same calls in the same order give the
    same bytes in every process.

    Shapes follow GGUF's row-major convention for linear layers, ``(..., out, in)``.
    """

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def linear(self, *shape: int, gain: float = 1.0) -> np.ndarray:
        """A weight with entries of std ``gain / sqrt(in)``, so activations stay O(1)."""
        return f32(gain * self.rng.standard_normal(shape) / np.sqrt(shape[-1]))

    def norm(self, dim: int) -> np.ndarray:
        """An RMSNorm weight near 1 (llama.cpp stores Gemma norms with the +1 added)."""
        return f32(1.0 + 0.1 * self.rng.standard_normal(dim))

    def normal(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        """Entries of std `scale`."""
        return f32(scale * self.rng.standard_normal(shape))

    def unit(self, dim: int) -> np.ndarray:
        """A random float64 unit vector of length `dim`."""
        v = self.rng.standard_normal(dim)
        return v / np.linalg.norm(v)


def bpe_vocab(control: list[str]) -> tuple[list[str], list[int]]:
    """(tokens, token types) of the tiny byte-level BPE vocabulary with `control` first."""
    byte_chars = bytes_to_unicode()
    tokens = list(control) + [byte_chars[b] for b in sorted(byte_chars)]
    for merge in BPE_MERGES:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens, f"merge {merge!r} uses an unknown token"
        assert left + right not in tokens, f"merge {merge!r} repeats a token"
        tokens.append(left + right)
    types = [TOKEN_TYPE_CONTROL] * len(control) + [TOKEN_TYPE_NORMAL] * (len(tokens) - len(control))
    return tokens, types


def add_bpe_tokenizer(writer: GGUFWriter, pre: str, bos: str, eos: str, *, add_bos: bool,
                      control: tuple[str, ...] = ()) -> int:
    """Write the tiny byte-level BPE (``tokenizer.ggml.model`` gpt2, pre-tokenizer `pre`)
    with control tokens `bos`, `eos` and `control`; returns the vocabulary size."""
    tokens, types = bpe_vocab([bos, eos, *control])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(BPE_MERGES))
    writer.add_bos_token_id(tokens.index(bos))
    writer.add_eos_token_id(tokens.index(eos))
    writer.add_add_bos_token(add_bos)
    return len(tokens)


def finish(writer: GGUFWriter, path: str | Path) -> Path:
    """Write the header, metadata and tensors `writer` holds, close it, and return `path`."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def cached_model(filename: str, write: Callable[[Path], object], name: str) -> tuple[Path, str]:
    """The tiny model `filename` in `cache_dir()` and its sha256, written first if needed.

    A cached file that does not parse or whose ``general.name`` is not `name` (written by
    another version of `write`) is rewritten; see `model.gguf.store.build_once` for why
    concurrent writers and killed writers are safe.
    """

    def is_current(path: Path) -> bool:
        try:
            return read_gguf(path).metadata.get("general.name") == name
        except GGUFError:
            return False

    target = build_once(cache_dir() / filename, write, is_current)
    return target, file_sha256(target)
