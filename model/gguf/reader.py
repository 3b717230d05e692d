"""GGUF reading: metadata as Python values, tensors dequantized to float32 numpy arrays.

Parsing and dequantization are the `gguf` package's (llama.cpp's own Python reader); this
module only adapts its output to plain values and names the errors.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize


@functools.cache
def supported_tensor_types() -> frozenset[GGMLQuantizationType]:
    """The tensor types `GGUFFile.tensor` reads: every type the installed `gguf` package
    dequantizes (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, IQ*, TQ*, ...),
    found by dequantizing one zero block of each, plus I32 (returned as int32)."""
    found = {GGMLQuantizationType.I32}
    for qtype, (_, block_bytes) in GGML_QUANT_SIZES.items():
        try:
            dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        found.add(qtype)
    return frozenset(found)


class GGUFError(ValueError):
    """A GGUF file is unreadable, or holds something this project cannot load."""


class _Reader(GGUFReader):
    """`GGUFReader` over a plain ndarray view of its memory map.

    `np.memmap` slicing runs `__array_finalize__` on every one of the ~1M header reads that a
    262,144-token vocabulary takes; a plain view of the same buffer parses faster
    (docs/benchmarks.md, "Figures behind the code's choices"). Tensor data stays memory-mapped.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)


@dataclass
class GGUFFile:
    """An opened GGUF file.

    Attributes:
        path: the file.
        metadata: every key-value pair, as str / int / float / bool / list values.
        tensor_types: tensor name -> GGML type name (e.g. ``"Q4_K"``).
    """

    path: Path
    metadata: dict[str, Any]
    tensor_types: dict[str, str]
    _reader: GGUFReader = field(repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, name: str, default: Any = None) -> Any:
        """Metadata key ``{architecture}.{name}``, or `default` when absent."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def require(self, key: str) -> Any:
        """Metadata value for `key`. Raises GGUFError naming the key when it is absent."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path.name}: missing metadata key {key!r}")
        return self.metadata[key]

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32 (I32 tensors: int32), in row-major numpy order.

        GGUF lists dimensions innermost first (``ne0, ne1``); the returned array is
        ``(ne1, ne0)``, i.e. a linear layer's weight comes back as ``(out, in)``.

        Raises:
            GGUFError: the tensor is absent or of an unsupported type.
        """
        tensor = self._tensors.get(name)
        if tensor is None:
            raise GGUFError(f"{self.path.name}: missing tensor {name!r}")
        if tensor.tensor_type not in supported_tensor_types():
            known = ", ".join(sorted(t.name for t in supported_tensor_types()))
            raise GGUFError(
                f"{self.path.name}: tensor {name!r} has unsupported type "
                f"{tensor.tensor_type.name} (supported: {known})"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if tensor.tensor_type == GGMLQuantizationType.I32:  # integer tables (e.g. tid2eid)
            return np.ascontiguousarray(tensor.data, dtype=np.int32).reshape(shape)
        values = dequantize(tensor.data, tensor.tensor_type)
        return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    @property
    def _tensors(self) -> dict:
        cached = self.__dict__.get("_tensor_index")
        if cached is None:
            cached = {t.name: t for t in self._reader.tensors}
            self.__dict__["_tensor_index"] = cached
        return cached


def _field_value(field) -> Any:
    if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1:
        item_type = field.types[1]
        if item_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        # Numeric arrays: one vectorized copy instead of a Python object per element.
        return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file: parse metadata and the tensor index (tensor data is memory-mapped).

    Raises:
        GGUFError: the file is missing, truncated, or not a GGUF file.
    """
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    try:
        reader = _Reader(path)
    except (ValueError, IndexError, OSError) as e:  # IndexError: a truncated file
        raise GGUFError(f"{path.name}: not a readable GGUF file: {e}") from e
    metadata = {name: _field_value(f) for name, f in reader.fields.items()}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return GGUFFile(path=path, metadata=metadata, tensor_types=types, _reader=reader)


def file_sha256(path: str | Path, block_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in `block_bytes` blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()
