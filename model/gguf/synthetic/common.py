"""What the tiny-model writers share: seeded random initializers and the on-disk cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from ..reader import GGUFError, file_sha256, read_gguf
from ..store import build_once, cache_dir


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
